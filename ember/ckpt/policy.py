"""When the training loop checkpoints. Pure: the loop passes the step, the clock and its last
save; `CheckpointPolicy.due` names the kind of checkpoint due after that step, or None.

`[checkpoint] every_steps` and `every_seconds` are read once, into the triggers they name (a
tagged union, `Every`): `EverySteps(n)`, `EverySeconds(s)`, `EveryAuto` (Young/Daly). Both keys
may be on (every 50 steps and also every 600 s); with both off only the rules without a
trigger remain. A checkpoint is due after a step when, first rule first:

    stop        a stop was requested (a signal, the service): save, then exit 75
    final       the step is the last (max_steps)
    early_stop  [eval] patience ran out: the run completes at this step
    periodic    EverySteps(n) and the step is a multiple of n
    timed       EverySeconds(s) and s seconds passed since the last save; EveryAuto and Daly's
                interval (ember.ckpt.interval) for the last save's measured cost (the assumed
                1 s before the first) and the machine's expected time between interruptions
    best        keep_best and this step's evaluation lowered the best held-out loss
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ember.ckpt.interval import daly
from ember.recipe import CheckpointConfig, Recipe

ASSUMED_COST = 1.0  # seconds a checkpoint blocks training until one is measured (as `ember plan` assumes)


class CheckpointKind(StrEnum):
    """Why a checkpoint is taken: the rule of the module docstring that made it due."""
    STOP = "stop"
    FINAL = "final"
    EARLY_STOP = "early_stop"
    PERIODIC = "periodic"
    TIMED = "timed"
    BEST = "best"


@dataclass(frozen=True)
class EverySteps:
    steps: int  # > 0


@dataclass(frozen=True)
class EverySeconds:
    seconds: float  # > 0


@dataclass(frozen=True)
class EveryAuto:
    interruption_hours: float  # the recipe's; 0 = from the ledger's history (ember.ledger.history)


Every = EverySteps | EverySeconds | EveryAuto


def cadence(ck: CheckpointConfig) -> tuple[Every, ...]:
    """The triggers [checkpoint] every_steps and every_seconds name (none when both are 0)."""
    out: list[Every] = [EverySteps(ck.every_steps)] if ck.every_steps else []
    if ck.every_seconds == "auto":
        out.append(EveryAuto(ck.interruption_hours))
    elif ck.every_seconds:
        out.append(EverySeconds(float(ck.every_seconds)))
    return tuple(out)


def auto_of(every: tuple[Every, ...]) -> EveryAuto | None:
    """The Young/Daly trigger among `every`, if there is one."""
    return next((e for e in every if isinstance(e, EveryAuto)), None)


@dataclass(frozen=True)
class LastSave:
    at: float                   # time.monotonic() when it ended (the loop's start, before any)
    cost: float = ASSUMED_COST  # seconds it blocked the training thread


@dataclass(frozen=True)
class CheckpointPolicy:
    every: tuple[Every, ...]
    max_steps: int
    keep_best: bool
    mtbf_seconds: float = 0.0  # expected seconds between interruptions (EveryAuto only)

    @classmethod
    def of(cls, recipe: Recipe, mtbf_seconds: float = 0.0) -> CheckpointPolicy:
        """The policy of a recipe; `mtbf_seconds` as prepare() found it for EveryAuto."""
        ck = recipe.checkpoint
        return cls(cadence(ck), recipe.train.max_steps, ck.keep_best, mtbf_seconds)

    def interval(self, last: LastSave) -> float:
        """Seconds between time-based checkpoints after `last`; 0 when there are none."""
        for every in self.every:
            match every:
                case EverySeconds(seconds):
                    return seconds
                case EveryAuto():
                    return daly(max(last.cost, 1e-3), self.mtbf_seconds)
        return 0.0

    def due(self, step: int, now: float, last: LastSave, *, stop: bool = False, early: bool = False,
            best: bool = False) -> CheckpointKind | None:
        """The kind of checkpoint due after `step` at monotonic time `now`, or None (module docstring)."""
        if stop:
            return CheckpointKind.STOP
        if step == self.max_steps:
            return CheckpointKind.FINAL
        if early:
            return CheckpointKind.EARLY_STOP
        if any(isinstance(e, EverySteps) and step % e.steps == 0 for e in self.every):
            return CheckpointKind.PERIODIC
        if (seconds := self.interval(last)) and now - last.at >= seconds:
            return CheckpointKind.TIMED
        if best and self.keep_best:
            return CheckpointKind.BEST
        return None
