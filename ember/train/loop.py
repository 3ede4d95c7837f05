"""The training loop: one screen for `train()`, one for `train_step()`."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.markup import escape

from ember import faults
from ember.ckpt import contents
from ember.ckpt.store import MANIFEST, CheckpointStore
from ember.device import autocast
from ember.errors import EXIT_INTERRUPTED, EXIT_OK, EmberError
from ember.metrics.report import build_report, compact, summary_line
from ember.plan.interval import daly
from ember.train import stability
from ember.train.data import make_loader
from ember.train.job import Job
from ember.train.loss import causal_lm_loss
from ember.train.model import save_final, trainable_parameters
from ember.train.progress import ProgressDisplay
from ember.train.rundir import MetricsLog
from ember.train.signals import StopRequest


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    batches: list[int]          # micro-batch ordinals in the data stream
    next_k: int                 # loader index after the last micro-batch used
    verdict: str                # "ok", "nonfinite", "spike" (see ember.train.stability)
    applied: bool               # whether the optimizer update was applied
    phases: dict[str, float]    # seconds per part of the step (ember.train.breakdown)


class Data:
    """The loader from the state's cursor, skipping the state's skip list; rebuilt on rollback."""

    def __init__(self, job: Job):
        r, self.job = job.recipe, job
        self.first_step = job.state.step
        self.batches = job.batches()
        count = (r.train.max_steps - self.first_step) * r.train.grad_accum
        self.iter = iter(make_loader(self.batches, count, r.data.workers, pin=job.device.type != "cpu",
                                     skip=set(job.state.skip_batches)))

    def close(self) -> None:
        del self.iter  # shuts down loader workers


def train(job: Job) -> int:
    """Run optimizer steps until max_steps or a stop request; checkpoint; return the exit code."""
    r, state = job.recipe, job.state
    data = Data(job)
    metrics = MetricsLog(job.run.metrics_path)
    stop = StopRequest().install()
    display = ProgressDisplay(r.train.max_steps, state.step, job.console)
    last_save_time = time.monotonic()
    ck = r.checkpoint
    interval = 0.0 if ck.every_seconds == "auto" else ck.every_seconds  # auto: set by the first save
    attempt_tokens, attempt_seconds, blocked = 0, 0.0, 0.0
    job.model.train()
    job.ledger.event("startup", job.started, time.time(), step=state.step)
    try:
        while state.step < r.train.max_steps and not stop.requested:
            t0 = time.perf_counter()
            result = train_step(job, data)
            seconds = time.perf_counter() - t0
            if result.verdict == "spike" and r.guard.spike_action == "rollback":
                metrics, data = rollback(job, metrics, data, result)  # the step is not counted
                state = job.state
                continue
            state.step += 1
            state.tokens_seen += result.tokens
            state.cursor = data.batches.cursor_after(result.next_k)
            state.train_seconds += seconds
            attempt_tokens, attempt_seconds = attempt_tokens + result.tokens, attempt_seconds + seconds
            # The checkpoint blocked the training thread before this step: it is this step's part.
            result.phases["checkpoint"], blocked = blocked, 0.0
            metrics.append({"step": state.step, "loss": result.loss, "lr": result.lr,
                            "grad_norm": result.grad_norm, "tokens": result.tokens,
                            "tokens_seen": state.tokens_seen, "step_seconds": round(seconds, 6),
                            "data_wait_seconds": round(result.phases["data"], 6),
                            "phases": {k: round(v, 6) for k, v in result.phases.items()},
                            "attempt": job.run.attempt, "time": time.time(),
                            **({} if result.applied else {"skipped": result.verdict})})
            job.phase_totals = {k: job.phase_totals.get(k, 0.0) + v for k, v in result.phases.items()}
            guard(job, result)
            display.update(state.step, result.loss, attempt_tokens / attempt_seconds)
            due = ((ck.every_steps and state.step % ck.every_steps == 0)
                   or (interval and time.monotonic() - last_save_time >= interval)
                   or state.step == r.train.max_steps or stop.requested)
            if due:
                blocked = save_checkpoint(job, metrics, result.loss)
                job.ledger.phases(job.phase_totals, state.step)
                last_save_time = time.monotonic()
                if ck.every_seconds == "auto":  # δ = what this checkpoint cost the training thread
                    interval = daly(max(blocked, 1e-3), job.mtbf_seconds)
    finally:
        display.close()
        stop.restore()
        metrics.close()
        data.close()
        t0 = time.time()
        try:
            job.writer.wait()  # a pending persist completes before the process goes, on every path
        except EmberError as e:
            failed_save(job, str(e))  # within the loss budget: say so and go on; else stop
        job.ledger.event("checkpoint", t0, time.time(), step=state.step, detail={"flush": True})
        record_persisted(job)
    job.ledger.phases(job.phase_totals, state.step)
    if stop.requested:
        job.ledger.finish("interrupted", stop.signal_name)
        newest = CheckpointStore.newest_step(job.store.root)
        job.console.print(f"{stop.signal_name}: newest committed checkpoint is step {newest} (stopped "
                          f"at step {state.step}); run the same command to resume")
        return EXIT_INTERRUPTED
    t0 = time.time()
    final = job.run.write_final(lambda folder: save_final(job.bundle, folder, r.method))
    job.ledger.event("final_save", t0, time.time(), step=state.step)
    job.ledger.finish("completed")
    summarize(job, final, attempt_tokens, attempt_seconds)
    return EXIT_OK


def train_step(job: Job, data: Data) -> StepResult:
    """One optimizer step: grad_accum micro-batches of forward and backward, clip, judge, update."""
    r, model, opt, state = job.recipe, job.model, job.optimizer, job.state
    loss_sum, tokens, ordinals = 0.0, 0, []
    timer = job.timer
    timer.begin()
    for _ in range(r.train.grad_accum):
        ordinal, batch = next(data.iter)  # blocks while the input pipeline is behind: data wait
        timer.wait("data")
        batch = batch.to(job.device, non_blocking=True)
        timer.lap("h2d")
        with autocast(job.device, r.precision.mode):
            loss = causal_lm_loss(model, batch, r.train.loss_chunk) * faults.loss_factor(ordinal)
        timer.lap("forward")
        # Every sequence has seq_len tokens, so the mean of micro-batch means is the step's mean.
        job.scaler.scale(loss / r.train.grad_accum).backward()
        timer.lap("backward")
        faults.point("train.micro_batch")
        loss_sum += loss.item()  # sync point on accelerators; the loss is logged every step
        tokens += batch.numel()
        ordinals.append(ordinal)
    job.scaler.unscale_(opt)  # no-op unless fp16: clip and measure true gradients
    params = trainable_parameters(model)
    if r.optimizer.grad_clip > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, r.optimizer.grad_clip))
    else:
        grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
    loss_value = loss_sum / r.train.grad_accum
    verdict = stability.judge(loss_value, grad_norm, state.loss_window, r.guard,
                              scaler_handles_inf=job.scaler.is_enabled())
    applied = verdict.kind == "ok" or (verdict.kind == "spike" and r.guard.spike_action == "warn")
    lr = job.scheduler.get_last_lr()[0]
    if applied:
        job.scaler.step(opt)  # skips the update if fp16 gradients overflowed
    job.scaler.update()
    if verdict.kind != "spike" or r.guard.spike_action != "rollback":
        job.scheduler.step()  # a rolled-back step is not a step: the schedule does not advance
    opt.zero_grad(set_to_none=True)
    timer.lap("optimizer")
    phases = timer.end()
    return StepResult(loss_value, grad_norm, lr, tokens, ordinals,
                      ordinals[-1] - data.batches.first_ordinal + 1, verdict.kind, applied, phases)


def guard(job: Job, result: StepResult) -> None:
    """Record a bad step, keep the loss window, and stop after too many bad steps in a row."""
    state, g = job.state, job.recipe.guard
    if result.verdict == "ok" or (result.verdict == "spike" and g.spike_action == "warn"):
        state.loss_window = stability.push(state.loss_window, result.loss, g.spike_window)
    if result.verdict == "ok":
        state.bad_streak = 0
        return
    state.bad_streak += 1
    state.bad_steps.append({"step": state.step, "why": result.verdict, "loss": result.loss,
                                "batches": result.batches, "applied": result.applied})
    job.console.print(f"[yellow]step {state.step}: {result.verdict} (loss {result.loss:.4g}, grad norm "
                      f"{result.grad_norm:.4g}); {'applied' if result.applied else 'update skipped'}; "
                      f"batches {result.batches}[/yellow]", highlight=False)
    if state.bad_streak >= g.max_bad_steps:
        bad = state.bad_steps[-state.bad_streak:]
        raise EmberError(f"{state.bad_streak} bad steps in a row ([guard] max_bad_steps = "
                         f"{g.max_bad_steps}): " + "; ".join(
                             f"step {b['step']} {b['why']} loss {b['loss']:.4g} batches {b['batches']}"
                             for b in bad) + "; lower [optimizer] lr, check those batches, or "
                         "resume from an earlier checkpoint")


def rollback(job: Job, metrics: MetricsLog, data: Data, result: StepResult) -> tuple[MetricsLog, Data]:
    """Back to the newest committed checkpoint; never train on this step's batches; scale the lr."""
    state, g = job.state, job.recipe.guard
    job.writer.wait()
    record_persisted(job)
    keep = {"skip_batches": sorted(set(state.skip_batches) | set(result.batches)),
            "bad_steps": state.bad_steps + [{"step": state.step + 1, "why": "spike",
                                                     "loss": result.loss, "batches": result.batches,
                                                     "applied": False, "rollback": True}],
            "lr_scale": state.lr_scale * g.rollback_lr_factor, "bad_streak": state.bad_streak + 1}
    if keep["bad_streak"] >= g.max_bad_steps:
        raise EmberError(f"{keep['bad_streak']} bad steps in a row ([guard] max_bad_steps); the last: "
                         f"a loss spike {result.loss:.4g} at step {state.step + 1}, batches {result.batches}")
    data.close()
    metrics.close()
    ckpt = job.store.load_latest(job.console.print)
    if ckpt is None:
        raise EmberError(f"loss spike at step {state.step + 1} (batches {result.batches}) and no "
                         f"checkpoint to roll back to; use [guard] spike_action = 'skip' or checkpoint sooner")
    job.state = contents.read_files(ckpt.path, job.model, job.optimizer, job.scheduler, job.scaler)
    for key, value in keep.items():
        setattr(job.state, key, value)
    job.state.restore_rng(job.device)
    job.apply_lr_scale()
    lost = job.run.rewind_metrics(job.state.step)
    job.console.print(f"[yellow]loss spike at step {state.step + 1} ({result.loss:.4g}): rolled back to "
                      f"step {job.state.step}, {lost} steps to recompute, batches {result.batches} skipped, "
                      f"learning rate x{job.state.lr_scale:g}[/yellow]", highlight=False)
    return MetricsLog(job.run.metrics_path), Data(job)


def save_checkpoint(job: Job, metrics: MetricsLog, loss: float) -> float:
    """Snapshot the state (blocking) and hand it to the writer, which makes it durable; return
    the seconds the training thread was blocked.

    The metrics up to this step are fsynced first, so the loss history is durable before any
    checkpoint that covers it commits."""
    t0 = time.time()
    try:
        job.writer.wait()  # one persist in flight at most: a due checkpoint waits (checkpoint time)
    except EmberError as e:  # the previous persist failed: nothing partial was committed
        failed_save(job, str(e))
    record_persisted(job)
    if (short := disk_shortfall(job)) is not None:
        failed_save(job, short)
        return time.time() - t0
    metrics.sync()
    job.state.capture_rng(job.device)
    s = job.state
    snap = contents.snapshot(job.model, job.optimizer, job.scheduler, job.scaler, s,
                             copy=job.writer.background, buffers=job.snapshot_buffers)
    faults.point("ckpt.snapshot_taken")
    t1 = time.time()
    job.writer.submit(s.step, snap, meta={"step": s.step, "tokens_seen": s.tokens_seen, "loss": loss,
                                          "recipe_digest": s.recipe_digest,
                                          "attempt": job.run.attempt}, blocked=t1 - t0)
    t2 = time.time()  # synchronous checkpoints were persisted inside submit()
    job.ledger.event("checkpoint", t0, t2, step=s.step, detail={"background": job.writer.background})
    return t2 - t0


def disk_shortfall(job: Job) -> str | None:
    """Why the next checkpoint would not fit (its size taken from the newest one), or None."""
    committed = job.store.committed()
    if not committed:
        return None
    expected = sum(p.stat().st_size for p in committed[-1][1].iterdir())
    free = shutil.disk_usage(job.store.root).free
    if free >= expected * 1.1:  # a margin for the manifest and the file system's own blocks
        return None
    return (f"checkpoint at step {job.state.step} not started: {free / 1e6:.1f} MB free on "
            f"{job.store.root}, the last checkpoint took {expected / 1e6:.1f} MB")


def failed_save(job: Job, why: str) -> None:
    """Keep training if the last committed checkpoint is within the loss budget; else stop."""
    committed = job.store.committed()
    budget = job.recipe.checkpoint.loss_budget_seconds
    age = time.time() - (committed[-1][1] / MANIFEST).stat().st_mtime if committed else float("inf")
    last = f"{committed[-1][1].name}, {age:.0f} s old" if committed else "none"
    if age <= budget:
        job.console.print(f"[yellow]warning:[/yellow] {escape(why)}; training on: the last committed "
                          f"checkpoint ({last}) is within \\[checkpoint] loss_budget_seconds = {budget:g}",
                          highlight=False)
        return
    raise EmberError(f"{why}; stopping: the last committed checkpoint ({last}) is beyond [checkpoint] "
                     f"loss_budget_seconds = {budget:g}. Free disk space and run the same command to "
                     f"resume from it")


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
