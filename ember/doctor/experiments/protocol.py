"""What every doctor experiment is (`Experiment`: a name, what it changes, `run(budget) ->
Result`), what it works with once the baseline is measured (`Lab`), and the two measuring
primitives they share: one timed call of the loop's train_step, and interleaved rounds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ember.data.loader import MicroBatch
from ember.doctor.diagnose import Difference, Shape, Skipped
from ember.doctor.experiments.budget import Budget, Stop
from ember.doctor.measure import synthetic
from ember.events import Events
from ember.recipe import Recipe
from ember.train.loop import train_step


@dataclass
class Result:
    """What one experiment found: the `Figures` fields it fills, by name, and what it skipped and why."""
    experiment: str
    figures: dict[str, Any] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)

    def skip(self, reason: str, experiment: str | None = None) -> Result:
        """Note that (part of) the experiment was not run, and why."""
        self.skipped.append(Skipped(experiment or self.experiment, reason))
        return self


@runtime_checkable
class Experiment(Protocol):
    """One controlled experiment: it changes one thing, measures both sides interleaved until
    its stop condition (budget.Stop: its share of the time, or a tight enough interval), and
    returns the figures it measured."""
    name: str     # its share in budget.SHARES, and Skipped.experiment
    changes: str  # what it changes against the recipe as written, in words

    def run(self, budget: Budget) -> Result:
        ...


@dataclass
class Lab:
    """What the experiments after the baseline work with: the doctor's job and what the baseline saw."""
    job: Any                  # ember.train.job.Job, prepared in the doctor's scratch folder
    recipe: Recipe            # as written (the job's own runs without end)
    shape: Shape
    step: float               # seconds of train_step alone, in the loop (median)
    batch: MicroBatch         # the data's first micro-batch, for the in-memory sides
    cpu: dict[str, float]     # /proc during the baseline (contention.cpu_since)
    events: Events
    tolerance: float          # seconds a step: an effect known this well stops its experiment

    def in_memory(self, batch: MicroBatch | None = None) -> Any:
        """Stands in for the loop's Data: `batch` (default: the data's first micro-batch), forever."""
        return synthetic(self.batch if batch is None else batch)


def timed_step(job: Any, data: Any) -> Callable[[], tuple[float, dict[str, float]]]:
    """One call of the loop's train_step: its seconds and phases."""
    def run() -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        result = train_step(job, data)
        return time.perf_counter() - t0, result.phases
    return run


def interleave(arms: list[tuple[Callable[[], Any], int, int]], stop: Stop, rounds: int = 12,
               first_round: float = 0.0, effect: Callable[[list[list[Any]]], Difference] | None = None
               ) -> list[list[Any]]:
    """Rounds of every arm in turn, each (step, block, drop): `block` calls, the first `drop` not
    kept (a switch's transient); until `rounds` rounds, the next would end past `stop.until`, or
    the `effect` of what was kept so far is settled (stop.settled)."""
    out: list[list[Any]] = [[] for _ in arms]
    last = first_round
    for n in range(rounds):
        if not stop.fits(last) or (effect is not None and stop.settled(effect(out), n)):
            break
        t0 = time.monotonic()
        for (step, block, drop), kept in zip(arms, out):
            for j in range(block):
                s = step()
                if j >= drop:
                    kept.append(s)
        last = time.monotonic() - t0
    return out
