"""Goodput: every second of every attempt's wall-clock in exactly one bucket. Pure arithmetic.

Bucket names follow the ML goodput taxonomy (productive time against badput: program start-up,
data loading, checkpoint save and restore, wasted progress from disruption, other):

    productive         steps that survived, less their synchronous data wait
    data_loading       time steps spent blocked waiting for the input pipeline
    program_startup    process start to the first step, less checkpoint restore
    compile            torch.compile's tracing and code generation ([train] compile), taken out
                       of the steps that paid for it
    checkpoint_restore finding, verifying and loading the checkpoint to resume from
    checkpoint_save    the part of checkpointing that blocked training (final weights included)
    evaluation         evaluation passes
    wasted_progress    steps computed after an attempt's last durable checkpoint, before it died:
                       they were computed again, so all of their time was lost
    paused             soft-paused by the owner's rules or by hand (ember pause)
    paused_for_inference soft-paused while local inference ran on the same device (ember serve)
    other              the rest: shutdown, logging, time between steps
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple


class Bucket(StrEnum):
    """Where a second of wall-clock went (the module docstring); stored under these names."""
    PRODUCTIVE = "productive"
    DATA_LOADING = "data_loading"
    PROGRAM_STARTUP = "program_startup"
    COMPILE = "compile"
    CHECKPOINT_RESTORE = "checkpoint_restore"
    CHECKPOINT_SAVE = "checkpoint_save"
    EVALUATION = "evaluation"
    WASTED_PROGRESS = "wasted_progress"
    PAUSED = "paused"
    PAUSED_FOR_INFERENCE = "paused_for_inference"
    OTHER = "other"


class EventKind(StrEnum):
    """The kinds of the ledger's timed events, which the buckets are made of."""
    STARTUP = "startup"  # process start to the first step (encloses the restore)
    RESTORE = "restore"
    CHECKPOINT = "checkpoint"
    FINAL_SAVE = "final_save"
    EVALUATION = "evaluation"
    PAUSE = "pause"
    PAUSE_INFERENCE = "pause_inference"
    COMPILE = "compile"  # inside a step (its `step`): moved out of that step's bucket


BUCKETS = tuple(Bucket)
EVENT_BUCKETS = {EventKind.RESTORE: Bucket.CHECKPOINT_RESTORE, EventKind.CHECKPOINT: Bucket.CHECKPOINT_SAVE,
                 EventKind.FINAL_SAVE: Bucket.CHECKPOINT_SAVE, EventKind.EVALUATION: Bucket.EVALUATION,
                 EventKind.PAUSE: Bucket.PAUSED, EventKind.PAUSE_INFERENCE: Bucket.PAUSED_FOR_INFERENCE}


@dataclass(frozen=True)
class Span:
    """One attempt: process start to its end (or its last sign of life, if it was killed)."""
    attempt: int
    start: float
    end: float


@dataclass(frozen=True)
class Event:
    attempt: int
    kind: str          # an EventKind
    start: float
    end: float
    step: int | None = None  # the step it belongs to (a compile: the step that paid for it)


class Step(NamedTuple):  # a tuple, not a frozen dataclass: a report makes one per step (100,000 in 0.1 s, not 0.3)
    attempt: int
    step: int
    seconds: float
    data_wait: float
    lost: bool         # computed again later: wasted progress


@dataclass
class Goodput:
    wall_seconds: float
    buckets: dict[str, float] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.buckets[Bucket.PRODUCTIVE] / self.wall_seconds if self.wall_seconds else 0.0

    def badput(self) -> list[tuple[str, float]]:
        """Badput buckets, largest first."""
        return sorted(((k, v) for k, v in self.buckets.items() if k != Bucket.PRODUCTIVE),
                      key=lambda kv: -kv[1])


def account(spans: list[Span], events: list[Event], steps: list[Step]) -> Goodput:
    """Split the attempts' wall-clock into BUCKETS. `other` is what no record explains."""
    buckets = dict.fromkeys(BUCKETS, 0.0)
    wall = sum(s.end - s.start for s in spans)
    for step in steps:
        if step.lost:
            buckets[Bucket.WASTED_PROGRESS] += step.seconds
        else:
            buckets[Bucket.PRODUCTIVE] += step.seconds - step.data_wait
            buckets[Bucket.DATA_LOADING] += step.data_wait
    restore_by_attempt: dict[int, float] = {}
    for e in events:
        if e.kind in EVENT_BUCKETS:
            buckets[EVENT_BUCKETS[e.kind]] += e.end - e.start
        if e.kind == EventKind.RESTORE:
            restore_by_attempt[e.attempt] = restore_by_attempt.get(e.attempt, 0.0) + e.end - e.start
    for e in events:
        if e.kind == EventKind.STARTUP:  # the start-up event encloses the restore
            buckets[Bucket.PROGRAM_STARTUP] += e.end - e.start - restore_by_attempt.get(e.attempt, 0.0)
    lost = {(s.attempt, s.step) for s in steps if s.lost}
    for e in events:
        if e.kind == EventKind.COMPILE:  # inside a step: out of the bucket that step's seconds went to
            paid = Bucket.WASTED_PROGRESS if (e.attempt, e.step) in lost else Bucket.PRODUCTIVE
            buckets[paid] -= e.end - e.start
            buckets[Bucket.COMPILE] += e.end - e.start
    buckets[Bucket.OTHER] = wall - sum(v for k, v in buckets.items() if k != Bucket.OTHER)
    return Goodput(wall, buckets)
