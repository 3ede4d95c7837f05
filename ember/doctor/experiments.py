"""The doctor's controlled experiments, on a job prepared exactly as `ember run` prepares one
(ember.train.job.prepare, in a scratch folder with its own ledger). Each changes one thing and
takes its two sides interleaved (A, B, A, B...), so load from other processes, which comes and
goes, falls on both:

    baseline     the real loop (ember.train.loop.train) on the recipe as written: whole
                 iterations, each the step, the checkpoint due after it, and the bookkeeping
    checkpoint   the real loop without checkpoints, its stretches alternating with the
                 baseline's (when the recipe's period is longer than a stretch: one checkpoint
                 a stretch against none, amortised over the period)
    contention   /proc during the baseline (load, other processes' CPU, steal, run-queue wait);
                 when it shows, train_step with fewer threads against the recipe's
    input        train_step on the real input pipeline against one in-memory micro-batch
    loader       the input pipeline alone, nothing consuming: micro-batches per second
    sweep        train_step at each larger micro batch the memory plan says fits, against the
                 recipe's: forward and backward per sample
    profile      torch.profiler over a few steps: the top operators
    ddp          N processes on loopback (gloo), forked from one that imported torch once:
                 train_step under DDP against the bare model, and the all-reduce alone

--budget bounds the whole command (ember.doctor.examine starts the clock). Every experiment's
cost is estimated from the first steps' measured time before it runs; one that does not fit
in its share of the time left is shortened or skipped, and `Skipped` says why. The baseline's
evidence reorders the rest (a step that waits for data measures the input first; other
processes on the cores, contention). Steps are counted against the deadline as they run, so
the bound holds to within one step; loading the model and the first steps, which nothing
measured beforehand, are stopped at the deadline (hard_deadline).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ember.ckpt import contents
from ember.ckpt.writer import CheckpointWriter
from ember.doctor.diagnose import (
    PHASES,
    Baseline,
    CheckpointFigures,
    ContentionFigures,
    DdpFigures,
    Figures,
    InputFigures,
    Shape,
    Skipped,
    SweepFigures,
    SweepPoint,
    TopOp,
    checkpoint_cost,
    reference_step,
)
from ember.doctor.measure import synthetic
from ember.errors import EmberError
from ember.events import Event, Events
from ember.metrics.flops import mfu
from ember.metrics.stats import percentile
from ember.models import model_config
from ember.paths import scratch_dir
from ember.plan.devices import detect_devices
from ember.plan.memory import ModelShape, estimate
from ember.plan.remedies import fits, train_shape
from ember.recipe import Recipe
from ember.train.job import Job, performance, prepare
from ember.train.loop import Data, train, train_step

# Each experiment's share of the time left when it starts, against those still to run.
SHARES = {"baseline": 0.30, "checkpoint": 0.15, "contention": 0.15, "input": 0.10, "sweep": 0.15,
          "loader": 0.05, "profile": 0.05, "ddp": 0.60}
MIN_SAMPLES = 3  # per side of a comparison: fewer is no evidence (diagnose.difference)
PROFILER_START_SECONDS = 4.0  # torch.profiler's first use in a process: 4.2 s on a busy 2-core machine


class Budget:
    """--budget as a deadline on the whole command, and each experiment's share of what is left."""

    def __init__(self, seconds: float, started: float, reserve: float, startup: float):
        self.seconds, self.started = seconds, started  # started: time.monotonic() when the clock began
        self.deadline = started + seconds - reserve  # the reserve is for the output after the experiments
        self.startup = startup  # seconds this process took to reach the clock (interpreter, CLI imports)
        self.shares = dict(SHARES)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def share(self, names: list[str], pending: list[str]) -> float:
        """Seconds for experiments `names`: their shares of what is left, against those pending."""
        return max(0.0, self.left()) * sum(self.shares[n] for n in names) / sum(self.shares[p] for p in pending)

    def until(self, name: str, pending: list[str]) -> float:
        """The monotonic time experiment `name` must end by."""
        return time.monotonic() + self.share([name], pending)


class BudgetExhausted(EmberError):
    """--budget ran out before the doctor had measured anything it could report."""


@contextmanager
def hard_deadline(deadline: float, what: str, budget: Budget) -> Iterator[None]:
    """Stop whatever runs at `deadline` (time.monotonic()) with BudgetExhausted: for the parts
    with no estimate of their own, loading the model and the first steps. SIGALRM, so only in
    the main thread (elsewhere the budget holds from the first step on). What it interrupts is
    safe to drop: the scratch job goes, and $EMBER_HOME's caches are replaced atomically."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        used = time.monotonic() - budget.started
        raise BudgetExhausted(f"--budget {budget.seconds:g}: used up while {what} ({budget.startup:.1f} s of "
                              f"start-up, then {used:.1f} s); nothing was measured. Give a larger --budget "
                              f"(at least {math.ceil(2 * (used + budget.startup) + 5)} s here)")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(1e-3, deadline - time.monotonic()))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Enough(Exception):
    """Ends a stretch of the real loop (raised from its progress event: see RealLoop)."""


class RealLoop:
    """The training loop itself, ember.train.loop.train, on the doctor's job, a stretch at a time.

    Its progress event, sent once per iteration right after the step's metrics row, ends a
    stretch by raising _Enough, which train() meets like any failure: its `finally` closes the
    loader and the metrics and waits for a pending checkpoint. The time between two metrics rows
    is one whole iteration: the bookkeeping after a step, the checkpoint due then (the next
    row's `checkpoint` phase) and the next step; what no phase covers is "other"."""

    def __init__(self, events: Events):
        self.out = events
        self.events = Events(self._sink)
        self.job: Job | None = None
        self.limit, self.until, self.seen, self.previous = 0, math.inf, 0, 0.0

    def _sink(self, e: Event) -> None:
        if e.kind == "warning":
            self.out.emit(e.kind, e.message, **e.data)
        if e.kind != "progress":
            return
        now = time.monotonic()
        self.seen, last, self.previous = self.seen + 1, now - self.previous, now
        if self.seen >= self.limit or now + last > self.until:
            raise _Enough

    def run(self, steps: int, until: float) -> list[dict[str, Any]]:
        """Up to `steps` iterations of the real loop, none started past `until`; their metrics rows."""
        path = self.job.run.metrics_path
        start = path.stat().st_size if path.exists() else 0
        self.limit, self.until, self.seen, self.previous = steps, until, 0, time.monotonic()
        try:
            train(self.job)
        except _Enough:
            pass
        with open(path) as fh:
            fh.seek(start)
            return [json.loads(line) for line in fh.read().splitlines()]

    def use(self, r: Recipe) -> None:
        """Loop on recipe `r` from here on (a checkpoint variant): its writer follows its mode."""
        self.job.recipe = r
        self.job.writer = CheckpointWriter(self.job.store, background=r.checkpoint.async_,
                                           nice=r.checkpoint.persist_nice)


def iterations(rows: list[dict[str, Any]]) -> list[tuple[float, dict[str, float], float]]:
    """(seconds, phases with "other", train_step seconds) of each iteration between two rows."""
    out = []
    for a, b in itertools.pairwise(rows):
        wall = b["time"] - a["time"]
        ph = {k: b["phases"].get(k, 0.0) for k in PHASES if k != "other"}
        ph["other"] = max(0.0, wall - sum(ph.values()))
        out.append((wall, ph, b["step_seconds"]))
    return out


def timed_step(job: Any, data: Any) -> Callable[[], tuple[float, dict[str, float]]]:
    """One call of the loop's train_step: its seconds and phases."""
    def run() -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        result = train_step(job, data)
        return time.perf_counter() - t0, result.phases
    return run


def interleave(arms: list[tuple[Callable[[], Any], int, int]], until: float, rounds: int = 12,
               first_round: float = 0.0) -> list[list[Any]]:
    """Rounds of every arm in turn, each (step, block, drop): `block` calls, the first `drop` not
    kept (a switch's transient); until `rounds` rounds or the next would end past `until`."""
    out: list[list[Any]] = [[] for _ in arms]
    last = first_round
    for _ in range(rounds):
        if time.monotonic() + last > until:
            break
        t0 = time.monotonic()
        for (step, block, drop), kept in zip(arms, out):
            for j in range(block):
                s = step()
                if j >= drop:
                    kept.append(s)
        last = time.monotonic() - t0
    return out


def run_all(r: Recipe, budget: Budget, ddp: int, events: Events, mtbf: float) -> tuple[Figures, list[Skipped]]:
    """Every experiment of the module docstring that fits in `budget`; their figures, and what
    was skipped and why. `mtbf`: seconds between interruptions of this machine (Young/Daly)."""
    skipped: list[Skipped] = []
    pending = ["baseline", "checkpoint", "contention", "input", "sweep", "loader", "profile"]
    pending += ["ddp"] if ddp > 1 else []
    work = scratch_dir("doctor-")
    loop = RealLoop(events)
    try:
        events.stage("doctor: preparing the job (model, data, optimizer) in a scratch folder")
        long = _endless(r)
        with hard_deadline(budget.deadline, "loading the model and preparing the job", budget):
            job = loop.job = prepare(long, work / "run", False, loop.events, None, work / "ledger.db")
        # What a fresh process needs before its first step (the DDP workers are such processes).
        cold_start = budget.startup + time.monotonic() - budget.started
        events.stage("doctor: the first steps (warm-up)")
        with hard_deadline(budget.deadline, "taking the first steps", budget):
            warm = loop.run(2, budget.deadline)
        est = warm[1]["time"] - warm[0]["time"] if len(warm) == 2 else warm[0]["step_seconds"]
        if len(warm) < 2 or budget.left() < 5 * est:
            raise EmberError(f"--budget {budget.seconds:g}: too small for this recipe here: start-up and "
                             f"preparing took {cold_start:.1f} s and a step {est:.2f} s, which leaves no time for "
                             f"the baseline; give --budget {math.ceil(cold_start + 15 * est + 5)} or more")
        shape = Shape(r.train.micro_batch, r.train.grad_accum, r.data.seq_len, r.data.workers,
                      torch.get_num_threads(), os.cpu_count() or 1, r.checkpoint.async_,
                      r.checkpoint.every_steps, r.checkpoint.every_seconds)

        before = cpu_snapshot()
        base, ck = loop_experiments(loop, long, budget, pending, est, events, skipped, mtbf)
        cpu = cpu_since(before)
        pending = [p for p in pending if p not in ("baseline", "checkpoint")]
        f = Figures(shape, baseline_figures(job, r, base, ck), checkpoint=ck)
        step = statistics.median(base[2])  # train_step alone, in the loop
        batch = job.batches().batch(0)
        if ddp > 1:  # asked for by name: first, with the time its processes need to start
            f.ddp = ddp_experiment(r, ddp, budget, pending, cold_start, step, type(job.bundle.model).__module__,
                                   events, skipped)
            pending.remove("ddp")
        for name in prioritise(f, cpu, pending, budget):
            until = budget.until(name, pending)
            if name == "contention":
                f.contention = contention(job, shape, cpu, f.baseline.step_seconds, synthetic(batch), step,
                                          until, events, skipped)
            elif name == "input":
                f.input = input_experiment(job, shape, step, until, events, skipped)
            elif name == "sweep":
                f.sweep = sweep(job, r, batch, step, until, events, skipped)
            elif name == "loader":
                loader(f.input, f.sweep, r, job, shape, until, events, skipped)
            elif name == "profile":
                f.top_ops = profile(job, synthetic(batch), step, until, events, skipped)
            pending.remove(name)
        job.writer.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    f.step_seconds = reference_step(f)
    return f, skipped


def measure_baselines(recipes: list[Recipe], seconds: float, events: Events) -> list[Baseline]:
    """The doctor's baseline (the real loop as written) of each recipe, their stretches taken in
    turn for about `seconds`, so a load that comes and goes falls on all of them: a remedy's
    measured effect, to hold its prediction against (tests, bench/doctor_accuracy.py)."""
    work = scratch_dir("doctor-compare-")
    try:
        loops = []
        for i, r in enumerate(recipes):
            loop = RealLoop(events)
            loop.job = prepare(_endless(r), work / f"run{i}", False, loop.events, None, work / f"ledger{i}.db")
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
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _endless(r: Recipe) -> Recipe:
    """`r` for the doctor's scratch job: steps without end, no supervision, and no rollback on a
    loss spike (the doctor keeps no history to roll back to)."""
    spikes = "warn" if r.guard.spike_action == "rollback" else r.guard.spike_action
    return dataclasses.replace(r, train=dataclasses.replace(r.train, max_steps=10**9, restarts=0),
                               guard=dataclasses.replace(r.guard, spike_action=spikes))


def prioritise(f: Figures, cpu: dict[str, float], pending: list[str], budget: Budget) -> list[str]:
    """The experiments left, those the baseline points at first and with a larger share: the
    input's when the step waits for data, contention's when other processes took the cores.
    The loader alone follows the sweep (it measures at the sweep's micro batches); the profile,
    evidence only, comes last."""
    ph, step = f.baseline.phases, f.baseline.step_seconds
    weight = {"contention": SHARES["contention"] + min(1.0, cpu["others"] / max(1, f.shape.cores)),
              "input": SHARES["input"] + ph["data"] / step,
              "sweep": SHARES["sweep"]}
    budget.shares.update(weight)
    first = sorted((n for n in weight if n in pending), key=lambda n: -weight[n])
    return first + [n for n in ("loader", "profile") if n in pending]


def loop_experiments(loop: RealLoop, r: Recipe, budget: Budget, pending: list[str], est: float,
                     events: Events, skipped: list[Skipped], mtbf: float) -> tuple[tuple, CheckpointFigures | None]:
    """Stretches of the real loop as written, alternating with stretches without checkpoints:
    what the recipe's checkpoints cost, all included. When the recipe's period is longer than a
    stretch, one checkpoint per stretch against none, its cost amortised over the period.
    Returns the baseline's (iteration seconds, phases, train_step seconds) and the figures."""
    ck = r.checkpoint
    timed = isinstance(ck.every_seconds, float) and ck.every_seconds > 0
    variant = None
    if not (ck.every_steps or timed or ck.every_seconds == "auto"):
        skipped.append(Skipped("checkpoint", "the recipe makes no checkpoints"))
    elif ck.every_seconds == "auto" and not ck.every_steps:
        skipped.append(Skipped("checkpoint", "[checkpoint] every_seconds = \"auto\": Young/Daly's interval "
                               "already, longer than the doctor's window"))
    else:
        variant = "off"
    seconds = budget.share(["baseline"] + (["checkpoint"] if variant else []), pending)
    sides, stretches = (2 if variant else 1), 3
    rows = max(4, min(41, int(seconds / (sides * stretches) / est) - 1))  # a stretch: rows + 1 iterations
    period_fits = bool(ck.every_steps) and not timed and ck.every_steps <= rows - 1
    if period_fits:
        rows = 1 + ck.every_steps * ((rows - 1) // ck.every_steps)  # whole checkpoint periods
    elif variant:
        variant = "every"
    if variant and sides * (rows + 1) * est > seconds:
        skipped.append(Skipped("checkpoint", f"needs ~{sides * (rows + 1) * est:.1f} s for a stretch with and "
                               f"one without; {seconds:.1f} s of the budget were left for both"))
        variant, sides = None, 1
    # Without a whole period in a stretch, the baseline's stretches make no checkpoint: a save
    # that happened to fall inside one would weigh as if it came every `rows` steps.
    as_written = r if period_fits else _checkpoints(r, 0)
    changed = {None: None, "off": _checkpoints(r, 0), "every": _checkpoints(r, rows - 1)}[variant]
    events.stage(f"doctor: the real loop, stretches of {rows} iterations as written"
                 + {None: "", "off": ", alternating with no checkpoints",
                    "every": f", alternating with a checkpoint every {rows - 1} steps"}[variant])
    until = time.monotonic() + seconds
    base: list = []
    other: list = []
    for i in range(stretches):
        if i and time.monotonic() + sides * (rows + 1) * est > until:
            break
        loop.use(as_written)
        base += iterations(loop.run(rows, until))
        if changed is not None:
            loop.use(changed)
            other += iterations(loop.run(rows, until))
    # Steps slower than the warm-up said (the machine got busier): the baseline is the one
    # experiment nothing can do without, so it takes from the others' shares what it lacks.
    while len(base) < MIN_SAMPLES:
        loop.use(as_written)
        more = iterations(loop.run(MIN_SAMPLES - len(base) + 1, budget.deadline))
        if not more:
            break
        base += more
    loop.use(r)
    if len(base) < MIN_SAMPLES:
        raise EmberError(f"--budget {budget.seconds:g}: too small for this recipe here: only {len(base)} "
                         f"iterations of the baseline fitted; give a larger --budget")
    walls = ([w for w, _, _ in base], [ph for _, ph, _ in base], [s for _, _, s in base])
    if changed is None:
        return walls, None
    if len(other) < MIN_SAMPLES:
        skipped.append(Skipped("checkpoint", f"only {len(other)} iterations of the variant fitted"))
        return walls, None
    job = loop.job
    blocked = [ph["checkpoint"] for _, ph, _ in (base if period_fits else other) if ph["checkpoint"] > 0]
    snap = 0.0
    if not ck.async_:  # what an asynchronous checkpoint would block for: the copy to host memory
        t0 = time.perf_counter()
        contents.snapshot(job.model, job.optimizer, job.scheduler, job.scaler, job.state, copy=True,
                          buffers=job.snapshot_buffers)
        snap = time.perf_counter() - t0
    every = float(ck.every_steps or math.inf)
    if timed:
        every = min(every, ck.every_seconds / statistics.mean(walls[0]))
    return walls, CheckpointFigures(variant, rows - 1, walls[0], [w for w, _, _ in other],
                                    statistics.mean(blocked) if blocked else 0.0, snap, every, mtbf)


def _checkpoints(r: Recipe, every: int) -> Recipe:
    """`r` with a checkpoint every `every` steps and no time-based ones (0: none at all)."""
    return dataclasses.replace(r, checkpoint=dataclasses.replace(r.checkpoint, every_steps=every, every_seconds=0.0))


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


def cpu_snapshot() -> dict[str, Any]:
    """Machine-wide CPU ticks (busy, steal), this process tree's ticks, its threads' run-queue wait."""
    with open("/proc/stat") as fh:
        cpu = [int(x) for x in fh.readline().split()[1:]]
    waits = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            run_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
            waits[task.name] = (run_ns, wait_ns)
        except (OSError, ValueError):
            continue
    return {"time": time.monotonic(), "busy": sum(cpu[:3]) + sum(cpu[5:7]), "steal": cpu[7] if len(cpu) > 7 else 0,
            "total": sum(cpu[:8]), "own": _tree_ticks(), "waits": waits}


def _tree_ticks() -> int:
    """CPU ticks used by this process (all threads), its reaped children and its live ones."""
    def ticks(pid: str) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15])
    total = ticks("self")
    for task in Path("/proc/self/task").iterdir():
        try:
            for child in (task / "children").read_text().split():
                total += ticks(child)
        except (OSError, ValueError, IndexError):
            continue
    return total


def cpu_since(before: dict[str, Any]) -> dict[str, float]:
    """What the machine and this process did since `before`: the contention signals."""
    now = cpu_snapshot()
    hz = os.sysconf("SC_CLK_TCK")
    wall = max(now["time"] - before["time"], 1e-9)
    run = wait = 0
    for tid, (r1, w1) in now["waits"].items():
        r0, w0 = before["waits"].get(tid, (0, 0))
        run, wait = run + r1 - r0, wait + w1 - w0
    main = str(os.getpid())  # the training thread
    main_wait = (now["waits"].get(main, (0, 0))[1] - before["waits"].get(main, (0, 0))[1]) / 1e9
    with open("/proc/loadavg") as fh:
        load = float(fh.read().split()[0])
    running = 0
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("procs_running"):
                running = int(line.split()[1])
    total = max(now["total"] - before["total"], 1)
    return {"load": load, "runnable": running,
            "others": max(0.0, (now["busy"] - before["busy"] - (now["own"] - before["own"])) / hz / wall),
            "steal": (now["steal"] - before["steal"]) / total,
            "wait_share": wait / max(run + wait, 1), "main_wait_share": main_wait / wall}


def contention(job: Job, shape: Shape, cpu: dict[str, float], real_step: float, data: Any, step: float,
               until: float, events: Events, skipped: list[Skipped]) -> ContentionFigures:
    """The /proc signals; with more than one thread and a sign of contention, fewer threads measured."""
    c = ContentionFigures(cpu["load"], cpu["runnable"], cpu["others"], cpu["steal"], cpu["wait_share"],
                          cpu["main_wait_share"] * real_step)
    threads = shape.threads
    if threads <= 1:
        return c
    if c.others_cores < 0.25 and c.wait_share < 0.05 and c.steal_share < 0.05:
        skipped.append(Skipped("contention", f"no sign of it: other processes used {c.others_cores:.2f} cores, "
                               f"run-queue wait {c.wait_share:.0%}; fewer threads not measured"))
        return c
    fewer = max(1, min(threads - 1, int(shape.cores - c.others_cores)))
    # This runs only when other processes take the cores, and then a step with fewer threads
    # is no slower than one with more (20x faster here); the rounds are then sized from it.
    if time.monotonic() + step > until:
        skipped.append(Skipped("contention", f"fewer threads: a step may take ~{step:.1f} s, "
                               f"{max(0.0, until - time.monotonic()):.1f} s left of its share"))
        return c
    events.stage(f"doctor: {threads} threads against {fewer} (other processes use {c.others_cores:.1f} cores)")
    run = timed_step(job, data)

    def at(n: int) -> Callable[[], float]:
        def one() -> float:
            torch.set_num_threads(n)  # no transient: the step right after a change is no slower
            return run()[0]
        return one
    try:
        first = at(fewer)()  # warm-up, and what a round will cost
        if time.monotonic() + MIN_SAMPLES * (step + first) > until:
            skipped.append(Skipped("contention", f"fewer threads: {MIN_SAMPLES} rounds need "
                                   f"~{MIN_SAMPLES * (step + first):.1f} s, {max(0.0, until - time.monotonic()):.1f} s "
                                   f"left of its share"))
            return c
        mine, less = interleave([(at(threads), 1, 0), (at(fewer), 1, 0)], until, rounds=20, first_round=step + first)
    finally:
        torch.set_num_threads(threads)
    if len(mine) < MIN_SAMPLES:  # the rounds ran slower than the first one said: no evidence
        skipped.append(Skipped("contention", f"fewer threads: only {len(mine)} rounds fitted"))
        return c
    c.fewer_threads, c.at_threads, c.at_fewer = fewer, mine, less
    return c


def input_experiment(job: Job, shape: Shape, step: float, until: float, events: Events,
                     skipped: list[Skipped]) -> InputFigures | None:
    """train_step on the real loader against one in-memory micro-batch, interleaved. With loader
    workers, each real block first drains what the workers prefetched meanwhile."""
    drain = math.ceil(4 * shape.workers / shape.grad_accum) if shape.workers else 0
    round_cost = (drain + 2) * step  # a real step (after the drain) and an in-memory one
    if time.monotonic() + MIN_SAMPLES * round_cost > until:
        skipped.append(Skipped("input", f"needs ~{MIN_SAMPLES * round_cost:.1f} s, "
                               f"{max(0.0, until - time.monotonic()):.1f} s left of its share"))
        return None
    events.stage("doctor: the input pipeline against in-memory batches")
    data = Data(job)
    try:
        real, memory = interleave([(timed_step(job, data), drain + 1, drain),
                                   (timed_step(job, synthetic(job.batches().batch(0))), 1, 0)],
                                  until, first_round=round_cost)
    finally:
        data.close()
    if len(real) < MIN_SAMPLES:
        skipped.append(Skipped("input", f"only {len(real)} steps fitted"))
        return None
    wait = statistics.median(p["data"] for _, p in real)
    per_loader = shape.grad_accum / max(wait, 1e-6) if not shape.workers else 0.0
    return InputFigures([s for s, _ in real], [s for s, _ in memory], wait, None, per_loader, shape.workers)


def loader(i: InputFigures | None, sw: SweepFigures | None, r: Recipe, job: Job, shape: Shape, until: float,
           events: Events, skipped: list[Skipped]) -> None:
    """The input pipeline alone, nothing consuming (its workers started first): seconds a
    micro-batch at the recipe's micro batch and at the sweep's; then the loader workers that
    would keep up with the model."""
    from ember.ckpt.state import DataCursor
    from ember.data.loader import PackedBatches, make_loader, resolve_packing
    sizes = [r.train.micro_batch] + ([p.micro_batch for p in sw.points] if sw is not None else [])
    start = 0.2 + 0.3 * shape.workers  # the workers' start-up, each time
    rates = {}
    if until - time.monotonic() > len(sizes) * (start + 0.1):
        events.stage("doctor: the input pipeline alone")
        for n, mb in enumerate(sizes):
            stop = time.monotonic() + (until - time.monotonic()) / (len(sizes) - n)
            packed = PackedBatches(job.tokens_path, r.data.seq_len, mb, r.train.seed, DataCursor(),
                                   *resolve_packing(r.data, job.tokens_path))
            it = iter(make_loader(packed, 10**6, r.data.workers, pin=False))
            next(it)
            got, t0 = 0, time.perf_counter()
            while got < 40 and (got < MIN_SAMPLES or time.monotonic() < stop):
                next(it)
                got += 1
            rates[mb] = got / max(time.perf_counter() - t0, 1e-9)
            del it  # stops its workers
    else:
        skipped.append(Skipped("loader", f"{max(0.0, until - time.monotonic()):.1f} s left of its share"))
    if sw is not None:
        sw.loader_seconds = {k: 1 / v for k, v in rates.items()}
    if i is None:
        return
    i.loader_batches_per_second = rates.get(r.train.micro_batch)
    if i.loader_batches_per_second and (shape.workers or not i.per_worker_batches_per_second):
        i.per_worker_batches_per_second = i.loader_batches_per_second / max(1, shape.workers)
    consume = shape.grad_accum / max(statistics.median(i.in_memory), 1e-9)
    if not i.per_worker_batches_per_second:  # workers, and no time to measure them: assume they keep up
        i.per_worker_batches_per_second = consume
    i.suggested_workers = min(shape.cores, max(2, math.ceil(1.5 * consume / i.per_worker_batches_per_second)))


def sweep(job: Job, r: Recipe, batch: Any, step: float, until: float, events: Events,
          skipped: list[Skipped]) -> SweepFigures | None:
    """Each larger micro batch that fits, interleaved with the recipe's (grad_accum 1, in-memory)."""
    mb = r.train.micro_batch
    fitting = fitting_micro_batches(r)
    larger = sorted(k for k in fitting if k > mb)
    if not larger:
        skipped.append(Skipped("sweep", f"no micro batch larger than {mb} fits (memory plan)"))
        return None
    events.stage("doctor: micro-batch sweep " + ", ".join(map(str, [mb] + larger)))
    one = step / r.train.grad_accum  # a step of one micro-batch, roughly

    def at(k: int) -> Callable[[], tuple[float, dict[str, float]]]:
        single = dataclasses.replace(job, recipe=job.recipe.with_changes(
            {"train.micro_batch": k, "train.grad_accum": 1}, "the micro-batch sweep"))
        return timed_step(single, synthetic(batch.rows(k)))
    points = []
    reference = at(mb)
    for n, k in enumerate(larger):
        cost = one * (1 + k / mb)  # a round: one step at each size (per-sample time at most flat)
        left = until - time.monotonic()
        if one * k / mb + MIN_SAMPLES * cost > left:
            skipped.append(Skipped("sweep", f"micro batch {', '.join(map(str, larger[n:]))}: needs "
                                   f"~{one * k / mb + MIN_SAMPLES * cost:.1f} s, {max(0.0, left):.1f} s left"))
            break
        run = at(k)
        run()  # warm-up: this size's allocations
        share = time.monotonic() + (until - time.monotonic()) / (len(larger) - n)
        ref, got = interleave([(reference, 1, 0), (run, 1, 0)], share, rounds=8, first_round=cost)
        if len(got) < MIN_SAMPLES:  # rounds slower than estimated (a busy machine): no evidence
            skipped.append(Skipped("sweep", f"micro batch {k}: only {len(got)} rounds fitted"))
            continue
        fb = lambda p: p["h2d"] + p["forward"] + p["backward"]
        points.append(SweepPoint(k, [s for s, _ in got], [fb(p) for _, p in got], [fb(p) for _, p in ref]))
    return SweepFigures(points, fitting) if points else None


def fitting_micro_batches(r: Recipe) -> dict[int, int]:
    """Micro batches 1, 2, 4, ... up to 4x the recipe's (at least 8) whose estimated peak fits,
    with that peak (memory arithmetic only: no calibration per size)."""
    try:
        m = ModelShape.from_config(model_config(r.model.path))
    except ValueError:  # an architecture the plan does not know: only the recipe's own size
        return {r.train.micro_batch: 0}
    free = detect_devices(r.train.device)[0].free
    out = {}
    mb = 1
    while mb <= max(8, 4 * r.train.micro_batch):
        peak = estimate(m, train_shape(r.with_changes({"train.micro_batch": mb}, "the micro-batch sweep"))).peak
        if not fits(peak, free, r.plan.memory_margin):
            break
        out[mb] = peak
        mb *= 2
    return out


def profile(job: Any, data: Any, step: float, until: float, events: Events,
            skipped: list[Skipped], steps: int = 3) -> list[TopOp]:
    """torch.profiler over a few steps: the top operators (a profiled step takes ~3 plain ones)."""
    need = PROFILER_START_SECONDS + 3 * steps * step
    if time.monotonic() + need > until:
        skipped.append(Skipped("profile", f"needs ~{need:.1f} s, "
                               f"{max(0.0, until - time.monotonic()):.1f} s left of its share"))
        return []
    events.stage("doctor: profiling the compute")
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if job.device.type == "cuda" else [])
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # kineto's start/stop lines
    run = timed_step(job, data)
    try:
        with torch_profile(activities=activities) as prof:
            for _ in range(steps):
                run()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    key = "self_device_time_total" if job.device.type == "cuda" else "self_cpu_time_total"
    found = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total = sum(getattr(e, key) for e in found) or 1
    top = sorted(found, key=lambda e: -getattr(e, key))[:8]
    return [TopOp(e.key, getattr(e, key) / total, e.count, getattr(e, key) / 1e6 / steps) for e in top]


def ddp_experiment(r: Recipe, world: int, budget: Budget, pending: list[str], cold_start: float, step: float,
                   model_module: str, events: Events, skipped: list[Skipped]) -> DdpFigures | None:
    """N processes on this machine, gloo over loopback, the recipe's model under DDP, forked from
    one server process that imported torch and the model's code once (`model_module`), instead
    of N processes each importing them on a shared CPU. They get what starting and a few rounds
    need (asked for by name, DDP goes before the others' shares), and are stopped at the deadline."""
    import multiprocessing

    import torch.multiprocessing as mp
    # Starting costs what this process took to its first step (measured under the same load);
    # then a warm-up and MIN_SAMPLES rounds of a synchronised step, a bare one and an all-reduce
    # (at most a step), the N processes sharing what this one had.
    need = cold_start + (1 + MIN_SAMPLES) * 3 * step * world
    until = time.monotonic() + min(budget.left() - 1.0, max(budget.share(["ddp"], pending), 1.5 * need))
    if time.monotonic() + need > until:
        skipped.append(Skipped("ddp", f"{world} processes need ~{need:.0f} s to start and measure here; "
                               f"{max(0.0, until - time.monotonic()):.1f} s left of the budget"))
        return None
    events.stage(f"doctor: DDP over gloo, {world} processes on loopback")
    out = scratch_dir("doctor-ddp-") / "result.json"
    deadline = time.time() + (until - time.monotonic())
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "ember.train.parts", "ember.train.loop", model_module])
    ctx = mp.start_processes(_ddp_worker, args=(world, r.to_dict(), deadline, str(out)), nprocs=world,
                             start_method="forkserver", join=False)
    try:
        # The processes plan their rounds to end by `until`, and report when start-up left too
        # little; they are stopped only at the command's own deadline.
        while not ctx.join(timeout=max(0.05, budget.deadline - time.monotonic())):
            if time.monotonic() >= budget.deadline:
                for p in ctx.processes:  # ours, started above: stopped by their own handles
                    p.kill()
                    p.join()
                skipped.append(Skipped("ddp", "the processes were still starting at the budget's deadline"))
                return None
        result = json.loads(out.read_text())
        if "skipped" in result:
            skipped.append(Skipped("ddp", result["skipped"]))
            return None
        return DdpFigures(**result)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def _ddp_worker(rank: int, world: int, recipe: dict, deadline: float, out: str) -> None:
    """One rank: the loop's train_step with the model under DDP (gradients synchronised on each
    step's last micro-batch), interleaved with the same step on the bare model (never synchronised)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ember.ckpt.state import seed_all
    from ember.recipe import build_recipe
    from ember.train.model import load_model, trainable_parameters
    from ember.train.parts import build_parts
    r = build_recipe(recipe, "the doctor's DDP worker")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # A file store, not TCP: a TCP store lives in rank 0, and a rank still tearing down after
    # rank 0 exited waits for it forever (seen here one run in four).
    store = Path(out).with_name("store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        seed_all(r.train.seed)
        ddp = DDP(load_model(r.model, r.method, r.train.activation_checkpointing).model)
        synced_parts = build_parts(r, torch.device("cpu"), ddp)
        bare_parts = dataclasses.replace(synced_parts, model=ddp.module)  # same weights and optimizer
        vocab = ddp.module.get_input_embeddings().weight.shape[0]
        data = synthetic(torch.randint(0, vocab, (r.train.micro_batch, r.data.seq_len),
                                       generator=torch.Generator().manual_seed(rank)))

        def step(parts: Any) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            train_step(parts, data)
            return time.perf_counter() - t0
        flat = torch.zeros(sum(p.numel() for p in trainable_parameters(ddp)))

        def allreduce() -> float:
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            return time.perf_counter() - t0
        step(synced_parts)  # warm-up: the optimizer's state, DDP's buckets
        synced: list[float] = []
        unsynced: list[float] = []
        reduce: list[float] = []
        last = 0.0
        while len(synced) < 16:
            # Every rank must run the same collectives: rank 0 decides whether a round still fits.
            go = torch.tensor([int(time.time() + 1.2 * last < deadline)])
            dist.broadcast(go, src=0)
            if not int(go):
                break
            t0 = time.perf_counter()
            synced.append(step(synced_parts))
            unsynced.append(step(bare_parts))
            reduce.append(allreduce())
            last = time.perf_counter() - t0
        if rank == 0:
            result = ({"world": world, "backend": "gloo", "synced": synced, "unsynced": unsynced, "allreduce": reduce}
                      if len(synced) >= MIN_SAMPLES else
                      {"skipped": f"after start-up only {len(synced)} rounds of {last:.2f} s fitted before the deadline"})
            Path(out).write_text(json.dumps(result))
        dist.barrier()  # no rank is still inside a collective
    except BaseException:
        dist.destroy_process_group()
        raise
    # Tearing gloo down races with the peer doing the same and hung one run in four here; the
    # result is written and closed, so the process ends without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
