"""Goodput: every second of every attempt's wall-clock in exactly one bucket. Pure arithmetic.

Bucket names follow the ML goodput taxonomy (productive time against badput: program start-up,
data loading, checkpoint save and restore, wasted progress from disruption, other):

    productive         steps that survived, less their synchronous data wait
    data_loading       time steps spent blocked waiting for the input pipeline
    program_startup    process start to the first step, less checkpoint restore
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
from typing import NamedTuple

BUCKETS = ("productive", "data_loading", "program_startup", "checkpoint_restore", "checkpoint_save",
           "evaluation", "wasted_progress", "paused", "paused_for_inference", "other")
EVENT_BUCKETS = {"restore": "checkpoint_restore", "checkpoint": "checkpoint_save",
                 "final_save": "checkpoint_save", "evaluation": "evaluation", "pause": "paused",
                 "pause_inference": "paused_for_inference"}


@dataclass(frozen=True)
class Span:
    """One attempt: process start to its end (or its last sign of life, if it was killed)."""
    attempt: int
    start: float
    end: float


@dataclass(frozen=True)
class Event:
    attempt: int
    kind: str          # "startup", or a key of EVENT_BUCKETS
    start: float
    end: float


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
        return self.buckets["productive"] / self.wall_seconds if self.wall_seconds else 0.0

    def badput(self) -> list[tuple[str, float]]:
        """Badput buckets, largest first."""
        return sorted(((k, v) for k, v in self.buckets.items() if k != "productive"),
                      key=lambda kv: -kv[1])


def account(spans: list[Span], events: list[Event], steps: list[Step]) -> Goodput:
    """Split the attempts' wall-clock into BUCKETS. `other` is what no record explains."""
    buckets = dict.fromkeys(BUCKETS, 0.0)
    wall = sum(s.end - s.start for s in spans)
    for step in steps:
        if step.lost:
            buckets["wasted_progress"] += step.seconds
        else:
            buckets["productive"] += step.seconds - step.data_wait
            buckets["data_loading"] += step.data_wait
    restore_by_attempt: dict[int, float] = {}
    for e in events:
        if e.kind in EVENT_BUCKETS:
            buckets[EVENT_BUCKETS[e.kind]] += e.end - e.start
        if e.kind == "restore":
            restore_by_attempt[e.attempt] = restore_by_attempt.get(e.attempt, 0.0) + e.end - e.start
    for e in events:
        if e.kind == "startup":  # the start-up event encloses the restore
            buckets["program_startup"] += e.end - e.start - restore_by_attempt.get(e.attempt, 0.0)
    buckets["other"] = wall - sum(v for k, v in buckets.items() if k != "other")
    return Goodput(wall, buckets)
