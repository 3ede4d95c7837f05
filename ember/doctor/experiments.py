"""The doctor's controlled experiments. Each runs the real training step (ember.train.loop's
train_step, on a job prepared exactly as `ember run` prepares one, in a scratch folder) for a
few dozen steps, changing one thing:

    baseline     the recipe as written: real data, step-time spread, the step breakdown
    loader       the input pipeline alone, nothing consuming: micro-batches per second
    synthetic    one in-memory batch instead of the input pipeline
    sweep        micro batches 1, 2, 4, ... (those the memory plan says fit): forward and
                 backward time per sample, and its fixed part per micro-batch
    checkpoint   one checkpoint as the recipe makes them: blocked and durable time
    profile      torch.profiler over a few steps: the top operators
    ddp          N processes on loopback (gloo), DDP: step time with and without gradient
                 synchronisation, and the all-reduce alone

Time is bounded by --budget: each experiment gets a share, and steps are counted to fit it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from rich.console import Console

from ember.paths import scratch_dir
from ember.recipe import Recipe

SHARES = {"baseline": 0.25, "loader": 0.05, "synthetic": 0.15, "sweep": 0.25, "checkpoint": 0.1,
          "profile": 0.1, "ddp": 0.3}


def _steps_for(seconds: float, step: float, low: int = 3, high: int = 40) -> int:
    return max(low, min(high, int(seconds / max(step, 1e-6))))


def synthetic(batch: torch.Tensor) -> Any:
    """Stands in for the loop's Data: the same in-memory micro-batch, forever."""
    return SimpleNamespace(iter=itertools.repeat((0, batch)), batches=SimpleNamespace(first_ordinal=0),
                           close=lambda: None)


def timed(job: Any, data: Any, n: int) -> tuple[list[float], dict[str, float]]:
    from ember.train.loop import train_step
    times, phases = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        result = train_step(job, data)
        times.append(time.perf_counter() - t0)
        phases.append(result.phases)
    med = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    return times, med


def run_all(r: Recipe, budget: float, ddp: int, console: Console) -> dict[str, Any]:
    from ember.metrics.stats import spread
    from ember.plan.interval import mtbf_seconds, recommend
    from ember.plan.preflight import loader_rate
    from ember.train.job import performance, prepare
    from ember.train.loop import Data, save_checkpoint
    from ember.train.rundir import MetricsLog

    work = scratch_dir("doctor-")
    f: dict[str, Any] = {"micro_batch": r.train.micro_batch, "grad_accum": r.train.grad_accum,
                         "workers": r.data.workers,
                         "micro_batches_per_step": r.train.grad_accum, "seq_len": r.data.seq_len}
    quiet = Console(quiet=True)
    try:
        long = dataclasses.replace(r, train=dataclasses.replace(r.train, max_steps=10**9, restarts=0))
        job = prepare(long, work / "run", False, quiet, None, False)
        console.print("doctor: baseline steps (the recipe as written)")
        data = Data(job)
        t0 = time.perf_counter()
        timed(job, data, 2)  # warm-up: the optimizer state, the loader's first batches
        one = (time.perf_counter() - t0) / 2
        times, phases = timed(job, data, _steps_for(budget * SHARES["baseline"], one))
        sp = spread(times)
        # The mean for throughput (a loader that keeps up only on average shows in it), the
        # spread for the headline.
        f.update(real_step_seconds=statistics.mean(times), step_p50=sp.p50, step_p99=sp.p99, phases=phases,
                 data_wait_seconds=phases["data"], baseline_steps=len(times))
        tokens = r.train.micro_batch * r.data.seq_len * r.train.grad_accum
        perf = performance(job.bundle, r, job.device, torch.get_num_threads())
        f.update(tokens_per_second=tokens / f["real_step_seconds"], flops_per_token=perf["flops_per_token"],
                 mfu=tokens / f["real_step_seconds"] * perf["flops_per_token"] / perf["peak_flops"],
                 peak_source=perf["peak_source"], device=perf["device_name"])
        data.close()

        console.print("doctor: the input pipeline alone")
        n = _steps_for(budget * SHARES["loader"], one / max(1, r.train.grad_accum) / 4, 20, 400)
        f["loader_batches_per_second"] = loader_rate(r, job.tokens_path, batches=n)
        consume = r.train.grad_accum / max(f["real_step_seconds"] - phases["data"], 1e-9)
        per_worker = f["loader_batches_per_second"] / max(1, r.data.workers)
        f["suggested_workers"] = min(os.cpu_count() or 1, max(2, math.ceil(1.5 * consume / per_worker)))

        console.print("doctor: in-memory batches (no input pipeline)")
        batch = job.batches().batch(0)
        times, _ = timed(job, synthetic(batch), _steps_for(budget * SHARES["synthetic"], one))
        f["synthetic_step_seconds"] = statistics.mean(times)

        console.print("doctor: micro-batch sweep")
        f["fits"] = _fitting_micro_batches(r)
        sweep, single = {}, dataclasses.replace(job, recipe=dataclasses.replace(
            job.recipe, train=dataclasses.replace(job.recipe.train, grad_accum=1)))
        left = budget * SHARES["sweep"]
        for mb in sorted(set(f["fits"]) | {r.train.micro_batch}):
            if left <= 0 and mb > r.train.micro_batch:
                break
            rows = torch.cat([batch] * math.ceil(mb / batch.shape[0]))[:mb]
            t0 = time.perf_counter()
            timed(single, synthetic(rows), 1)
            est = time.perf_counter() - t0
            _, ph = timed(single, synthetic(rows), _steps_for(left / 4, est, 3, 10))
            # Forward and backward only: with tokens per optimizer step held (bigger micro batch,
            # less accumulation) the optimizer's share per sample does not change.
            sweep[mb] = ph["h2d"] + ph["forward"] + ph["backward"]
            left -= time.perf_counter() - t0
        f["sweep"] = sweep
        ks = sorted(sweep)
        if len(ks) >= 2:  # least squares: time = fixed + slope * micro_batch
            mx, my = statistics.mean(ks), statistics.mean(sweep[k] for k in ks)
            slope = sum((k - mx) * (sweep[k] - my) for k in ks) / sum((k - mx) ** 2 for k in ks)
            f["sweep_fit"] = (max(0.0, my - slope * mx), slope)
        else:
            f["sweep_fit"] = (0.0, sweep[ks[0]] / ks[0])

        console.print("doctor: one checkpoint as the recipe makes them")
        metrics = MetricsLog(job.run.metrics_path)
        from ember.ckpt import contents
        t0 = time.perf_counter()
        contents.snapshot(job.model, job.optimizer, job.scheduler, job.scaler, job.state, copy=True,
                          buffers=job.snapshot_buffers)
        f["snapshot_seconds"] = time.perf_counter() - t0
        job.state.step += 1
        t0 = time.perf_counter()
        blocked = save_checkpoint(job, metrics, 0.0)
        job.writer.wait()
        f["checkpoint_durable_seconds"] = time.perf_counter() - t0
        f["checkpoint_blocked_seconds"] = blocked
        f["checkpoint_async"] = r.checkpoint.async_
        metrics.close()
        every = float(r.checkpoint.every_steps or math.inf)
        if isinstance(r.checkpoint.every_seconds, float) and r.checkpoint.every_seconds > 0:
            every = min(every, r.checkpoint.every_seconds / f["real_step_seconds"])
        f["checkpoint_every_steps"] = every
        f["checkpoint_seconds_per_step"] = blocked / every if math.isfinite(every) else 0.0
        mtbf, _ = mtbf_seconds(r.checkpoint.interruption_hours, None, socket.gethostname())
        iv = recommend(max(blocked, 1e-4), mtbf)
        f["daly_interval_seconds"] = iv.seconds
        f["daly_seconds_per_step"] = blocked * f["real_step_seconds"] / iv.seconds

        console.print("doctor: profiling the compute")
        f["top_ops"] = _profile(job, synthetic(batch), 3)
        job.writer.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if ddp > 1:
        console.print(f"doctor: DDP over gloo, {ddp} processes on loopback")
        f.update(ddp_experiment(r, ddp, budget * SHARES["ddp"]))
        f["ddp_step_share"] = 1.0
    f["step_seconds"] = (f["ddp_sync_seconds"] * r.train.grad_accum if ddp > 1 else f["real_step_seconds"]) \
        + f["checkpoint_seconds_per_step"]
    return f


def _fitting_micro_batches(r: Recipe) -> dict[int, int]:
    """Micro batches 1, 2, 4, ... up to 4x the recipe's (at least 8) whose estimated peak fits,
    with that peak (memory arithmetic only: no calibration per size)."""
    from ember.plan.memory import ModelShape, estimate
    from ember.plan.planner import (
        apply_changes,
        detect_devices,
        fits,
        model_config,
        train_shape,
    )
    try:
        m = ModelShape.from_config(model_config(r))
    except ValueError:  # an architecture the plan does not know: only the recipe's own size
        return {r.train.micro_batch: 0}
    free = detect_devices(r.train.device)[0].free
    out = {}
    mb = 1
    while mb <= max(8, 4 * r.train.micro_batch):
        peak = estimate(m, train_shape(apply_changes(r, {"train.micro_batch": mb}))).peak
        if not fits(peak, free, r.plan.memory_margin):
            break
        out[mb] = peak
        mb *= 2
    return out


def _profile(job: Any, data: Any, steps: int) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if job.device.type == "cuda" else [])
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # kineto's start/stop lines
    try:
        with profile(activities=activities) as prof:
            timed(job, data, steps)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    key = "self_device_time_total" if job.device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total = sum(getattr(e, key) for e in events) or 1
    top = sorted(events, key=lambda e: -getattr(e, key))[:8]
    return [{"name": e.key, "share": getattr(e, key) / total, "calls": e.count,
             "seconds": getattr(e, key) / 1e6 / steps} for e in top]


def ddp_experiment(r: Recipe, world: int, budget: float) -> dict[str, Any]:
    """N processes on this machine, gloo over loopback, the recipe's model under DDP."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = scratch_dir("doctor-ddp-") / "result.json"
    try:
        mp.start_processes(_ddp_worker, args=(world, port, r.to_dict(), budget, str(out)), nprocs=world,
                           start_method="spawn")
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def _ddp_worker(rank: int, world: int, port: int, recipe: dict, budget: float, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ember.ckpt.state import seed_all
    from ember.recipe import build_recipe
    from ember.train.loss import causal_lm_loss
    from ember.train.model import load_model, trainable_parameters
    r = build_recipe(recipe, "the doctor's DDP worker")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        seed_all(r.train.seed)
        model = DDP(load_model(r.model, r.method, r.train.activation_checkpointing).model)
        params = trainable_parameters(model)
        opt = torch.optim.AdamW(params, lr=r.optimizer.lr)
        vocab = model.module.get_input_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (r.train.micro_batch, r.data.seq_len),
                            generator=torch.Generator().manual_seed(rank))

        accum = r.train.grad_accum

        def step(sync: bool) -> float:
            """Seconds per micro-batch of one optimizer step: gradient accumulation synchronises on
            the last micro-batch only (no_sync before it); sync=False never synchronises."""
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(accum):
                if sync and i == accum - 1:
                    causal_lm_loss(model, ids, r.train.loss_chunk).backward()
                else:
                    with model.no_sync():
                        causal_lm_loss(model, ids, r.train.loss_chunk).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return (time.perf_counter() - t0) / accum
        step(True)
        one = step(True)
        agreed = torch.tensor([_steps_for(budget / 3, one, 3, 20)])
        dist.broadcast(agreed, src=0)  # every rank must run the same collectives
        n = int(agreed)
        synced = statistics.median(step(True) for _ in range(n))
        unsynced = statistics.median(step(False) for _ in range(n))
        flat = torch.zeros(sum(p.numel() for p in params))
        times = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - t0)
        allreduce = statistics.median(times)
        if rank == 0:
            exposed = max(0.0, synced - unsynced)
            Path(out).write_text(json.dumps({
                "ddp_world": world, "ddp_backend": "gloo", "ddp_sync_seconds": synced,
                "ddp_nosync_seconds": unsynced, "ddp_allreduce_seconds": allreduce,
                "ddp_overlap": max(0.0, 1 - exposed / allreduce) if allreduce > 0 else 0.0}))
    finally:
        dist.destroy_process_group()
