"""The doctor's experiments in turn, within --budget: the job prepared and warmed up, the
baseline with the checkpoint experiment, DDP when asked for, then the rest in the order the
baseline's evidence gives (`run_all`)."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ember.doctor.diagnose import Figures, Shape, Skipped, reference_step
from ember.doctor.experiments.budget import PRECISION, SHARES, Budget, hard_deadline
from ember.doctor.experiments.checkpoint import LoopExperiment
from ember.doctor.experiments.contention import Contention, cpu_since, cpu_snapshot
from ember.doctor.experiments.ddp import Ddp
from ember.doctor.experiments.input import InputPipeline, Loader
from ember.doctor.experiments.profile import Profile
from ember.doctor.experiments.protocol import Experiment, Lab, Result
from ember.doctor.experiments.real_loop import RealLoop, baseline_figures, endless
from ember.doctor.experiments.sweep import Sweep
from ember.errors import EmberError
from ember.events import Events
from ember.metrics.peaks import measured_cpu_peak
from ember.scratch import scratch
from ember.recipe import Recipe
from ember.train.job import prepare

# The experiments after the baseline, each made from the lab and the figures found so far.
AFTER_BASELINE: list[Callable[[Lab, Figures], Experiment]] = [Contention, InputPipeline, Sweep, Loader, Profile]
PEAKS_SECONDS = 3.0  # the most the two matmul peaks take to measure, uncached, on a CPU slow at bf16


def run_all(r: Recipe, budget: Budget, ddp: int, events: Events, mtbf: float) -> tuple[Figures, list[Skipped]]:
    """Every experiment of the package docstring that fits in `budget`; their figures, and what
    was skipped and why. `mtbf`: seconds between interruptions of this machine (Young/Daly)."""
    budget.pending = ["baseline", "checkpoint", "contention", "input", "sweep", "loader", "profile"]
    budget.pending += ["ddp"] if ddp > 1 else []
    skipped: list[Skipped] = []
    loop = RealLoop(events)
    with scratch("doctor-") as work:
        est, cold_start = _warm_up(loop, r, budget, work, events)
        before = cpu_snapshot()
        base = LoopExperiment(loop, endless(r), est, events, mtbf).run(budget)
        cpu = cpu_since(before)
        skipped += base.skipped
        budget.done("baseline")
        budget.done("checkpoint")
        walls, ck = base.figures["iterations"], base.figures.get("checkpoint")
        f = Figures(_shape(r), baseline_figures(loop.job, r, walls, ck), checkpoint=ck)
        f.cpu_peaks = _cpu_peaks(r, loop.job.device, torch.get_num_threads(), budget, skipped)  # as baseline_figures
        lab = Lab(loop.job, r, f.shape, statistics.median(walls[2]), loop.job.batches().batch(0), cpu, events,
                  PRECISION * f.baseline.step_seconds)
        if ddp > 1:  # asked for by name: first, with the time its processes need to start
            _record(f, skipped, Ddp(lab, ddp, cold_start, type(loop.job.bundle.model).__module__).run(budget))
            budget.done("ddp")
        experiments = {e.name: e for e in (make(lab, f) for make in AFTER_BASELINE)}
        for name in prioritise(f, lab.cpu, budget):
            _record(f, skipped, experiments[name].run(budget))
            budget.done(name)
        loop.job.writer.wait()
    f.step_seconds = reference_step(f)
    return f, skipped


def _warm_up(loop: RealLoop, r: Recipe, budget: Budget, work: Path, events: Events) -> tuple[float, float]:
    """Prepare the job in `work` and take its first steps; seconds an iteration, and what a
    fresh process needs before its first step (the DDP ranks are such processes)."""
    events.stage("doctor: preparing the job (model, data, optimizer) in a scratch folder")
    with hard_deadline(budget.deadline, "loading the model and preparing the job", budget):
        loop.job = prepare(endless(r), work / "run", False, loop.events, None, work / "ledger.db")
    cold_start = budget.startup + time.monotonic() - budget.started
    events.stage("doctor: the first steps (warm-up)")
    with hard_deadline(budget.deadline, "taking the first steps", budget):
        warm = loop.run(2, budget.deadline)
    est = warm[1]["time"] - warm[0]["time"] if len(warm) == 2 else warm[0]["step_seconds"]
    if len(warm) < 2 or budget.left() < 5 * est:
        raise EmberError(f"--budget {budget.seconds:g}: too small for this recipe here: start-up and "
                         f"preparing took {cold_start:.1f} s and a step {est:.2f} s, which leaves no time for "
                         f"the baseline; give --budget {math.ceil(cold_start + 15 * est + 5)} or more")
    return est, cold_start


def _cpu_peaks(r: Recipe, device: torch.device, threads: int, budget: Budget,
               skipped: list[Skipped]) -> dict[str, float]:
    """An fp32 recipe on a CPU: this CPU's matmul peak in fp32 and in bf16 at the run's threads
    (measured once per machine and cached, as MFU's: ~0.5 s the first time here), for the
    compute-bound finding; else nothing. Not started with under PEAKS_SECONDS of the budget left."""
    if device.type != "cpu" or r.precision.mode != "fp32":
        return {}
    if budget.left() < PEAKS_SECONDS:
        skipped.append(Skipped("precision", f"the bf16 matmul peak: needs up to ~{PEAKS_SECONDS:.0f} s the "
                                            f"first time, {max(0.0, budget.left()):.1f} s left"))
        return {}
    return {dtype: measured_cpu_peak(threads, dtype=dtype).flops for dtype in ("fp32", "bf16")}


def _shape(r: Recipe) -> Shape:
    """The recipe settings the causes are about, as this process runs them."""
    return Shape(r.train.micro_batch, r.train.grad_accum, r.data.seq_len, r.data.workers,
                 torch.get_num_threads(), os.cpu_count() or 1, r.checkpoint.async_,
                 r.checkpoint.every_steps, r.checkpoint.every_seconds)


def _record(f: Figures, skipped: list[Skipped], result: Result) -> None:
    """Keep what `result` measured in `f`, and what it skipped."""
    for field, value in result.figures.items():
        setattr(f, field, value)
    skipped += result.skipped


def prioritise(f: Figures, cpu: dict[str, float], budget: Budget) -> list[str]:
    """The experiments pending, those the baseline points at first and with a larger share: the
    input's when the step waits for data, contention's when other processes took the cores.
    The loader alone follows the sweep (it measures at the sweep's micro batches); the profile,
    evidence only, comes last."""
    ph, step = f.baseline.phases, f.baseline.step_seconds
    weight = {"contention": SHARES["contention"] + min(1.0, cpu["others"] / max(1, f.shape.cores)),
              "input": SHARES["input"] + ph["data"] / step,
              "sweep": SHARES["sweep"]}
    budget.shares.update(weight)
    first = sorted((n for n in weight if n in budget.pending), key=lambda n: -weight[n])
    return first + [n for n in ("loader", "profile") if n in budget.pending]
