"""The training loop: one screen for `train()`, one for `train_step()`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from rich.console import Console

from ember import faults
from ember.ckpt import contents
from ember.device import autocast
from ember.errors import EXIT_INTERRUPTED, EXIT_OK
from ember.train.data import make_loader
from ember.train.job import Job
from ember.train.model import save_final, trainable_parameters
from ember.train.progress import ProgressDisplay
from ember.metrics.report import build_report, compact, summary_line
from ember.train.rundir import MetricsLog
from ember.train.signals import StopRequest


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    data_wait_seconds: float


def train(job: Job) -> int:
    """Run optimizer steps until max_steps or a stop request; checkpoint; return the exit code."""
    r, state = job.recipe, job.state
    first_step = state.step
    batches = job.batches()
    loader = make_loader(batches, (r.train.max_steps - first_step) * r.train.grad_accum, r.data.workers,
                         pin=job.device.type != "cpu")
    data = iter(loader)
    metrics = MetricsLog(job.run.metrics_path)
    stop = StopRequest().install()
    display = ProgressDisplay(r.train.max_steps, state.step, job.console)
    last_save_time = time.monotonic()
    attempt_tokens, attempt_seconds = 0, 0.0
    job.model.train()
    job.ledger.event("startup", job.started, time.time(), step=state.step)
    try:
        while state.step < r.train.max_steps and not stop.requested:
            t0 = time.perf_counter()
            result = train_step(job, data)
            seconds = time.perf_counter() - t0
            state.step += 1
            state.tokens_seen += result.tokens
            state.cursor = batches.cursor_after((state.step - first_step) * r.train.grad_accum)
            state.train_seconds += seconds
            attempt_tokens, attempt_seconds = attempt_tokens + result.tokens, attempt_seconds + seconds
            metrics.append({"step": state.step, "loss": result.loss, "lr": result.lr,
                            "grad_norm": result.grad_norm, "tokens": result.tokens,
                            "tokens_seen": state.tokens_seen, "step_seconds": round(seconds, 6),
                            "data_wait_seconds": round(result.data_wait_seconds, 6),
                            "attempt": job.run.attempt, "time": time.time()})
            display.update(state.step, result.loss, attempt_tokens / attempt_seconds)
            ck = r.checkpoint
            due = ((ck.every_steps and state.step % ck.every_steps == 0)
                   or (ck.every_seconds and time.monotonic() - last_save_time >= ck.every_seconds)
                   or state.step == r.train.max_steps or stop.requested)
            if due:
                save_checkpoint(job, metrics, result.loss)
                last_save_time = time.monotonic()
    finally:
        t0 = time.time()
        job.writer.wait()  # a pending persist completes before the process goes, on every path
        job.ledger.event("checkpoint", t0, time.time(), step=state.step, detail={"flush": True})
        record_persisted(job)
        display.close()
        stop.restore()
        metrics.close()
        del data  # shuts down loader workers
    if stop.requested:
        job.ledger.finish("interrupted", stop.signal_name)
        job.console.print(f"{stop.signal_name}: checkpoint at step {state.step} committed; run the "
                          f"same command to resume")
        return EXIT_INTERRUPTED
    t0 = time.time()
    final = job.run.write_final(lambda folder: save_final(job.bundle, folder, r.method))
    job.ledger.event("final_save", t0, time.time(), step=state.step)
    job.ledger.finish("completed")
    summarize(job, final, attempt_tokens, attempt_seconds)
    return EXIT_OK


def train_step(job: Job, data: Iterator[torch.Tensor]) -> StepResult:
    """One optimizer step: grad_accum micro-batches of forward and backward, clip, update."""
    r, model, opt = job.recipe, job.model, job.optimizer
    data_wait, loss_sum, tokens = 0.0, 0.0, 0
    for _ in range(r.train.grad_accum):
        t0 = time.perf_counter()
        batch = next(data)  # blocks while the input pipeline is behind: counted as data wait
        data_wait += time.perf_counter() - t0
        batch = batch.to(job.device, non_blocking=True)
        with autocast(job.device, r.precision.mode):
            loss = model(input_ids=batch, labels=batch).loss
        # Every sequence has seq_len tokens, so the mean of micro-batch means is the step's mean.
        job.scaler.scale(loss / r.train.grad_accum).backward()
        faults.point("train.micro_batch")
        loss_sum += loss.item()  # sync point on accelerators; the loss is logged every step
        tokens += batch.numel()
    job.scaler.unscale_(opt)  # no-op unless fp16: clip and measure true gradients
    params = trainable_parameters(model)
    if r.optimizer.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, r.optimizer.grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    lr = job.scheduler.get_last_lr()[0]
    job.scaler.step(opt)  # skips the update if fp16 gradients overflowed
    job.scaler.update()
    job.scheduler.step()
    opt.zero_grad(set_to_none=True)
    return StepResult(loss=loss_sum / r.train.grad_accum, grad_norm=float(grad_norm), lr=lr,
                      tokens=tokens, data_wait_seconds=data_wait)


def save_checkpoint(job: Job, metrics: MetricsLog, loss: float) -> None:
    """Snapshot the state (blocking) and hand it to the writer, which makes it durable.

    The metrics up to this step are fsynced first, so the loss history is durable before any
    checkpoint that covers it commits."""
    t0 = time.time()
    job.writer.wait()  # one persist in flight at most: a due checkpoint waits (checkpoint time)
    record_persisted(job)
    metrics.sync()
    job.state.capture_rng(job.device)
    s = job.state
    snap = contents.snapshot(job.model, job.optimizer, job.scheduler, job.scaler, s,
                             copy=job.writer.background, buffers=job.snapshot_buffers)
    t1 = time.time()
    job.writer.submit(s.step, snap, meta={"step": s.step, "tokens_seen": s.tokens_seen, "loss": loss,
                                          "recipe_digest": s.recipe_digest,
                                          "attempt": job.run.attempt}, blocked=t1 - t0)
    job.ledger.event("checkpoint", t0, time.time(), step=s.step,
                     detail={"background": job.writer.background})


def record_persisted(job: Job) -> None:
    """Ledger rows for the persists that finished: bytes, seconds blocked, seconds to durable."""
    for p in job.writer.completed():
        ck = p.checkpoint
        job.ledger.checkpoint(ck.step, str(ck.path), sum(f["bytes"] for f in ck.manifest["files"].values()),
                              blocked=p.blocked, durable=p.durable - p.submitted + p.blocked)


def summarize(job: Job, final: object, tokens: int, seconds: float) -> None:
    """Print the run's outcome and figures; store them in the ledger for `ember runs`."""
    out = Console(soft_wrap=True, quiet=job.console.quiet)
    committed = job.store.committed()
    rate = f"{tokens / seconds:,.0f} tokens/s in this attempt" if seconds else "no steps in this attempt"
    report = build_report(job.run.path, getattr(job.ledger, "con", None))
    loss = report["loss"]
    out.print(f"completed {job.state.step} steps; loss {loss['first']:.4f} -> {loss['last']:.4f}; {rate}")
    out.print(summary_line(report))
    out.print(f"checkpoints: {', '.join(p.name for _, p in committed)} in {job.store.root}\n"
              f"final weights: {final}")
    job.ledger.summary(compact(report))
