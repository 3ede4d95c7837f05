"""The baseline and the checkpoint experiment, taken together: stretches of the real loop as
written, alternating with stretches without checkpoints, so what the recipe's checkpoints cost,
all included, is the difference. When the recipe's period is longer than a stretch: one
checkpoint a stretch against none, its cost amortised over the period."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

from ember.ckpt import contents
from ember.doctor.diagnose import CheckpointFigures, Difference, difference
from ember.doctor.experiments.budget import MIN_SAMPLES, PRECISION, Budget, Stop
from ember.doctor.experiments.protocol import Result
from ember.doctor.experiments.real_loop import RealLoop, iterations
from ember.errors import EmberError
from ember.events import Events
from ember.recipe import Recipe

STRETCHES = 3  # per side, at most


@dataclass
class Plan:
    """The stretches: `rows` metrics rows each (rows - 1 iterations), on the recipe as written and,
    when `changed` is not None, on its variant (`variant`: "off" or "every"), in turn."""
    rows: int
    as_written: Recipe
    changed: Recipe | None
    variant: str | None
    period_fits: bool  # a stretch holds whole checkpoint periods of the recipe

    @property
    def sides(self) -> int:
        return 1 if self.changed is None else 2


@dataclass
class LoopExperiment:
    """The real loop as written (the baseline), against it with the checkpoints changed."""
    loop: RealLoop
    recipe: Recipe      # the doctor's job's: steps without end (real_loop.endless)
    est: float          # seconds an iteration, from the warm-up
    events: Events
    mtbf: float         # seconds between interruptions of this machine, for Young/Daly
    name = "baseline"
    changes = "the recipe's checkpoints: none, or one a stretch when its period is longer"

    def run(self, budget: Budget) -> Result:
        """The baseline's iterations (figures["iterations"]: seconds, phases, train_step seconds) and
        figures["checkpoint"]; raises EmberError when the baseline itself does not fit."""
        out = Result(self.name)
        variant = self._variant(out)
        stop = Stop(time.monotonic() + budget.share(["baseline"] + (["checkpoint"] if variant else [])),
                    PRECISION * self.est)
        p = self._plan(variant, stop.left(), out)
        self.events.stage(f"doctor: the real loop, stretches of {p.rows} iterations as written"
                          + {None: "", "off": ", alternating with no checkpoints",
                             "every": f", alternating with a checkpoint every {p.rows - 1} steps"}[p.variant])
        base, other = self._stretches(p, stop)
        base += self._top_up(p, len(base), budget.deadline)
        self.loop.use(self.recipe)
        if len(base) < MIN_SAMPLES:
            raise EmberError(f"--budget {budget.seconds:g}: too small for this recipe here: only {len(base)} "
                             f"iterations of the baseline fitted; give a larger --budget")
        out.figures["iterations"] = ([w for w, _, _ in base], [ph for _, ph, _ in base], [s for _, _, s in base])
        if p.changed is not None and len(other) < MIN_SAMPLES:
            out.skip(f"only {len(other)} iterations of the variant fitted", "checkpoint")
        elif p.changed is not None:
            out.figures["checkpoint"] = self._figures(p, base, other)
        return out

    def _variant(self, out: Result) -> str | None:
        """"off" when the recipe makes checkpoints the doctor can measure against none; else None."""
        ck = self.recipe.checkpoint
        timed = isinstance(ck.every_seconds, float) and ck.every_seconds > 0
        if not (ck.every_steps or timed or ck.every_seconds == "auto"):
            out.skip("the recipe makes no checkpoints", "checkpoint")
        elif ck.every_seconds == "auto" and not ck.every_steps:
            out.skip("[checkpoint] every_seconds = \"auto\": Young/Daly's interval already, longer than the "
                     "doctor's window", "checkpoint")
        else:
            return "off"
        return None

    def _plan(self, variant: str | None, seconds: float, out: Result) -> Plan:
        """Stretches that fit `seconds`: whole checkpoint periods when one fits in a stretch, else
        the "every" variant; no variant when not even one stretch a side fits."""
        r, ck = self.recipe, self.recipe.checkpoint
        timed = isinstance(ck.every_seconds, float) and ck.every_seconds > 0
        sides = 2 if variant else 1
        rows = max(4, min(41, int(seconds / (sides * STRETCHES) / self.est) - 1))  # a stretch: rows + 1 iterations
        period_fits = bool(ck.every_steps) and not timed and ck.every_steps <= rows - 1
        if period_fits:
            rows = 1 + ck.every_steps * ((rows - 1) // ck.every_steps)  # whole checkpoint periods
        elif variant:
            variant = "every"
        if variant and sides * (rows + 1) * self.est > seconds:
            out.skip(f"needs ~{sides * (rows + 1) * self.est:.1f} s for a stretch with and one without; "
                     f"{seconds:.1f} s of the budget were left for both", "checkpoint")
            variant = None
        # Without a whole period in a stretch, the baseline's stretches make no checkpoint: a save
        # that happened to fall inside one would weigh as if it came every `rows` steps.
        as_written = r if period_fits else _checkpoints(r, 0)
        changed = {None: None, "off": _checkpoints(r, 0), "every": _checkpoints(r, rows - 1)}[variant]
        return Plan(rows, as_written, changed, variant, period_fits)

    def _stretches(self, p: Plan, stop: Stop) -> tuple[list, list]:
        """Stretches of each side in turn, until STRETCHES, the time, or a settled difference."""
        base: list = []
        other: list = []
        for i in range(STRETCHES):
            if i and not stop.fits(p.sides * (p.rows + 1) * self.est):
                break
            if i and p.changed is not None and stop.settled(_effect(p, base, other), i, least=2):
                break
            self.loop.use(p.as_written)
            base += iterations(self.loop.run(p.rows, stop.until))
            if p.changed is not None:
                self.loop.use(p.changed)
                other += iterations(self.loop.run(p.rows, stop.until))
        return base, other

    def _top_up(self, p: Plan, have: int, deadline: float) -> list:
        """Steps slower than the warm-up said (the machine got busier): the baseline is the one
        experiment nothing can do without, so it takes from the others' shares what it lacks."""
        more: list = []
        while have + len(more) < MIN_SAMPLES:
            self.loop.use(p.as_written)
            got = iterations(self.loop.run(MIN_SAMPLES - have - len(more) + 1, deadline))
            if not got:
                break
            more += got
        return more

    def _figures(self, p: Plan, base: list, other: list) -> CheckpointFigures:
        """The checkpoint's figures from both sides' iterations, and what a snapshot alone blocks."""
        ck, job = self.recipe.checkpoint, self.loop.job
        walls = [w for w, _, _ in base]
        blocked = [ph["checkpoint"] for _, ph, _ in (base if p.period_fits else other) if ph["checkpoint"] > 0]
        snap = 0.0
        if not ck.async_:  # what an asynchronous checkpoint would block for: the copy to host memory
            t0 = time.perf_counter()
            contents.snapshot(job.model, job.optimizer, job.scheduler, job.scaler, job.state, copy=True,
                              buffers=job.snapshot_buffers)
            snap = time.perf_counter() - t0
        every = float(ck.every_steps or math.inf)
        if isinstance(ck.every_seconds, float) and ck.every_seconds > 0:
            every = min(every, ck.every_seconds / statistics.mean(walls))
        return CheckpointFigures(p.variant, p.rows - 1, walls, [w for w, _, _ in other],
                                 statistics.mean(blocked) if blocked else 0.0, snap, every, self.mtbf)


def _effect(p: Plan, base: list, other: list) -> Difference:
    """What the checkpoints cost an iteration so far, as diagnose.checkpoint_cost compares it."""
    a, b = [w for w, _, _ in base], [w for w, _, _ in other]
    return difference(b, a, "mean") if p.variant == "every" else difference(a, b, "mean")


def _checkpoints(r: Recipe, every: int) -> Recipe:
    """`r` with a checkpoint every `every` steps and no time-based ones (0: none at all)."""
    return dataclasses.replace(r, checkpoint=dataclasses.replace(r.checkpoint, every_steps=every, every_seconds=0.0))
