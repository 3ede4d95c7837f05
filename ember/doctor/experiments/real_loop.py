"""The training loop itself, ember.train.loop.train, as the doctor's instrument: stretches of it
on the doctor's job (`RealLoop`), the iterations its metrics rows give (`iterations`), and the
baseline's headline figures from them (`baseline_figures`, `measure_baselines`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ember.ckpt.writer import CheckpointWriter
from ember.doctor.diagnose import PHASES, Baseline, CheckpointFigures, checkpoint_cost
from ember.doctor.experiments.budget import MIN_SAMPLES
from ember.events import Event, Events
from ember.metrics.flops import mfu
from ember.metrics.stats import percentile
from ember.scratch import scratch
from ember.recipe import Recipe
from ember.train.job import Job, performance, prepare
from ember.train.loop import train


@dataclass
class Stretch:
    """When a stretch of the real loop ends: after `steps` iterations, or before one that would
    start past `until` (time.monotonic()), judged by the last iteration's length."""
    steps: int
    until: float
    seen: int = 0
    previous: float = 0.0

    def over(self, now: float) -> bool:
        """One more iteration ended at `now`: whether the stretch ends here."""
        self.seen, last, self.previous = self.seen + 1, now - self.previous, now
        return self.seen >= self.steps or now + last > self.until


class RealLoop:
    """The training loop itself on the doctor's job, a stretch at a time.

    The stretch's end is decided by its `Stretch` at the loop's progress event (sent once per
    iteration right after the step's metrics row) and taken by train() as `halt()`, its explicit
    exit that saves nothing (max_steps and a stop request would take a checkpoint the recipe never
    asked for): its `finally` closes the loader and the metrics and waits for a pending
    checkpoint, and it returns. The time between two metrics rows is one whole
    iteration: the bookkeeping after a step, the checkpoint due then (the next row's
    `checkpoint` phase) and the next step; what no phase covers is "other"."""

    def __init__(self, events: Events):
        self.out = events
        self.events = Events(self._sink)
        self.job: Job | None = None
        self.stretch = Stretch(0, math.inf)
        self.halted = False

    def _sink(self, e: Event) -> None:
        if e.kind == "warning":
            self.out.emit(e.kind, e.message, **e.data)
        if e.kind == "progress" and self.stretch.over(time.monotonic()):
            self.halted = True

    def run(self, steps: int, until: float) -> list[dict[str, Any]]:
        """Up to `steps` iterations of the real loop, none started past `until`; their metrics rows."""
        path = self.job.run.metrics_path
        start = path.stat().st_size if path.exists() else 0
        self.stretch, self.halted = Stretch(steps, until, previous=time.monotonic()), False
        train(self.job, halt=lambda: self.halted)
        with open(path) as fh:
            fh.seek(start)
            return [json.loads(line) for line in fh.read().splitlines()]

    def use(self, r: Recipe) -> None:
        """Loop on recipe `r` from here on (a checkpoint variant): its writer follows its mode."""
        self.job.recipe = r
        self.job.writer = CheckpointWriter(self.job.store, background=r.checkpoint.async_,
                                           nice=r.checkpoint.persist_nice)


def endless(r: Recipe) -> Recipe:
    """`r` for the doctor's scratch job: steps without end, no supervision, and no rollback on a
    loss spike (the doctor keeps no history to roll back to)."""
    spikes = "warn" if r.guard.spike_action == "rollback" else r.guard.spike_action
    return dataclasses.replace(r, train=dataclasses.replace(r.train, max_steps=10**9, restarts=0),
                               guard=dataclasses.replace(r.guard, spike_action=spikes))


def iterations(rows: list[dict[str, Any]]) -> list[tuple[float, dict[str, float], float]]:
    """(seconds, phases with "other", train_step seconds) of each iteration between two rows."""
    out = []
    for a, b in itertools.pairwise(rows):
        wall = b["time"] - a["time"]
        ph = {k: b["phases"].get(k, 0.0) for k in PHASES if k != "other"}
        ph["other"] = max(0.0, wall - sum(ph.values()))
        out.append((wall, ph, b["step_seconds"]))
    return out


def baseline_figures(job: Job, r: Recipe, base: tuple, ck: CheckpointFigures | None) -> Baseline:
    """The headline figures and the step breakdown from the baseline's iterations. When the
    window held none of the recipe's checkpoints, their measured cost is amortised into it."""
    walls, phases, steps = base
    mean = {k: statistics.mean(p[k] for p in phases) for k in PHASES}
    step = statistics.mean(walls)
    if ck is not None and ck.variant == "every":
        per_step, d = checkpoint_cost(ck)
        if d.significant and per_step > 0:
            mean["checkpoint"] += per_step
            step += per_step
    tokens = r.train.micro_batch * r.data.seq_len * r.train.grad_accum
    perf = performance(job.bundle, r, job.device, torch.get_num_threads())
    return Baseline(walls, steps, mean, step, percentile(walls, 50), percentile(walls, 99), tokens, tokens / step,
                    mfu(tokens / step, perf["flops_per_token"], perf["peak_flops"]), perf["peak_source"],
                    perf["device_name"])


def measure_baselines(recipes: list[Recipe], seconds: float, events: Events) -> list[Baseline]:
    """The doctor's baseline (the real loop as written) of each recipe, their stretches taken in
    turn for about `seconds`, so a load that comes and goes falls on all of them: a remedy's
    measured effect, to hold its prediction against (tests, bench/doctor_accuracy.py)."""
    with scratch("doctor-compare-") as work:
        loops = []
        for i, r in enumerate(recipes):
            loop = RealLoop(events)
            loop.job = prepare(endless(r), work / f"run{i}", False, loop.events, None, work / f"ledger{i}.db")
            loop.run(2, math.inf)  # warm-up
            loops.append(loop)
        rows = [1 + (r.checkpoint.every_steps or 1) * max(1, 10 // (r.checkpoint.every_steps or 1)) for r in recipes]
        found: list[list] = [[] for _ in recipes]
        until = time.monotonic() + seconds
        while time.monotonic() < until or min(map(len, found)) < MIN_SAMPLES:
            for loop, n, got in zip(loops, rows, found):
                torch.set_num_threads(loop.job.run.record["threads"])  # each job's own thread count
                got += iterations(loop.run(n, math.inf))
        return [baseline_figures(loop.job, r, ([w for w, _, _ in got], [p for _, p, _ in got],
                                                [s for _, _, s in got]), None)
                for loop, r, got in zip(loops, recipes, found)]
