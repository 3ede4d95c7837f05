"""Checkpoints from the loop's side: the snapshot and hand-over to the writer (one process) or
the collective DCP save (several ranks), the disk check before it, the loss budget when a save
fails, and the ledger rows of each durable commit."""

from __future__ import annotations

import shutil
import time

from ember import faults
from ember.ckpt import contents
from ember.ckpt.sharded import own_files, write_sharded
from ember.ckpt.store import MANIFEST
from ember.errors import EmberError
from ember.ledger.goodput import EventKind
from ember.train.job import Job
from ember.runfolder import MetricsLog


def save_checkpoint(job: Job, metrics: MetricsLog, loss: float) -> float:
    """Snapshot the state (blocking) and hand it to the writer, which makes it durable; return
    the seconds the training thread was blocked.

    The metrics up to this step are fsynced first, so the loss history is durable before any
    checkpoint that covers it commits."""
    if job.world.distributed:
        return save_sharded(job, metrics, loss)
    t0 = time.time()
    try:
        job.writer.wait()  # one persist in flight at most: a due checkpoint waits (checkpoint time)
    except EmberError as e:  # the previous persist failed: nothing partial was committed
        failed_save(job, str(e), space=getattr(e, "disk_full", False))
    record_persisted(job)
    if (short := disk_shortfall(job)) is not None:
        failed_save(job, short, space=True)
        return time.time() - t0
    metrics.sync()
    job.state.capture_rng(job.device)
    s = job.state
    snap = contents.snapshot(job.model, job.optimizer, job.scheduler, job.scaler, s,
                             copy=job.writer.background, buffers=job.snapshot_buffers)
    faults.point("ckpt.snapshot_taken")
    t1 = time.time()
    job.writer.submit(s.step, snap, meta={"step": s.step, "tokens_seen": s.tokens_seen, "loss": loss,
                                          "recipe_digest": s.recipe_digest, "attempt": job.run.attempt,
                                          "best_step": best_step(job)}, blocked=t1 - t0)
    t2 = time.time()  # synchronous checkpoints were persisted inside submit()
    job.ledger.event(EventKind.CHECKPOINT, t0, t2, step=s.step, detail={"background": job.writer.background})
    return t2 - t0


def save_sharded(job: Job, metrics: MetricsLog, loss: float) -> float:
    """Every rank writes its shards (DCP), rank 0 commits them under the store's protocol; a
    collective, taken in the training thread. Returns the seconds it took."""
    t0, s, world = time.time(), job.state, job.world
    short = world.broadcast(disk_shortfall(job) if world.main else None)
    if short is not None:
        failed_save(job, short, space=True)
        return time.time() - t0
    metrics.sync()
    s.capture_rng(job.device)  # this rank's streams, saved under its own key
    meta = {"step": s.step, "tokens_seen": s.tokens_seen, "loss": loss, "recipe_digest": s.recipe_digest,
            "attempt": job.run.attempt, "ranks": world.size, "strategy": job.recipe.distributed.strategy,
            "best_step": best_step(job)}
    ck = job.store.save_collective(
        s.step, lambda folder: write_sharded(folder, job.model, job.optimizer, job.scheduler, job.scaler, s, world),
        lambda folder: own_files(folder, world), meta, world)
    t1 = time.time()
    job.ledger.event(EventKind.CHECKPOINT, t0, t1, step=s.step, detail={"background": False, "ranks": world.size})
    if ck is not None:  # rank 0
        size = sum(f["bytes"] for f in ck.manifest["files"].values())
        job.ledger.checkpoint(ck.step, str(ck.path), size, blocked=t1 - t0, durable=t1 - t0)
        job.events.emit("checkpoint", f"checkpoint {ck.path.name} committed ({size / 1e6:.1f} MB from "
                        f"{world.size} ranks, {t1 - t0:.2f} s)", step=ck.step, path=str(ck.path), bytes=size,
                        blocked_seconds=t1 - t0, durable_seconds=t1 - t0)
    return t1 - t0


def best_step(job: Job) -> int | None:
    """The step of the lowest held-out loss so far, which retention keeps ([checkpoint] keep_best);
    None when there is none to keep. Recorded in the manifest: durable with the commit."""
    s = job.state
    return s.best_step if job.recipe.checkpoint.keep_best and s.best_eval_loss is not None else None


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


def failed_save(job: Job, why: str, space: bool) -> None:
    """Keep training if the last committed checkpoint is within the loss budget; else stop.
    `space`: the cause is free space (the advice says to free some)."""
    committed = job.store.committed()
    budget = job.recipe.checkpoint.loss_budget_seconds
    age = time.time() - (committed[-1][1] / MANIFEST).stat().st_mtime if committed else float("inf")
    last = f"{committed[-1][1].name}, {age:.0f} s old" if committed else "none"
    if age <= budget:
        job.events.warn(f"{why}; training on: the last committed checkpoint ({last}) is within "
                        f"[checkpoint] loss_budget_seconds = {budget:g}")
        return
    advice = ". Free disk space and run the same command to resume from it" if space else ""
    raise EmberError(f"{why}; stopping: the last committed checkpoint ({last}) is beyond [checkpoint] "
                     f"loss_budget_seconds = {budget:g}{advice}")


def record_persisted(job: Job) -> None:
    """Ledger rows for the persists that finished: bytes, seconds blocked, seconds to durable;
    and a warning for each retired checkpoint that could not be deleted."""
    for error in job.store.deletion_errors():
        job.events.warn(f"{job.store.root}: could not delete {error}. Every committed checkpoint is "
                        f"intact, so training goes on; the deletion is tried again at the next "
                        f"checkpoint and start (delete it by hand if it stays)")
    for p in job.writer.completed():
        ck = p.checkpoint
        size = sum(f["bytes"] for f in ck.manifest["files"].values())
        durable = p.to_durable
        job.ledger.checkpoint(ck.step, str(ck.path), size, blocked=p.blocked, durable=durable)
        job.events.emit("checkpoint", f"checkpoint {ck.path.name} committed ({size / 1e6:.1f} MB, training "
                        f"blocked {p.blocked:.2f} s, durable after {durable:.2f} s)", step=ck.step,
                        path=str(ck.path), bytes=size, blocked_seconds=p.blocked, durable_seconds=durable)


def settle_saves(job: Job) -> None:
    """Wait for a pending persist before the process goes, on every path (a failed one within
    the loss budget is a warning); its ledger rows. The wait is checkpoint time."""
    t0 = time.time()
    try:
        job.writer.wait()
    except EmberError as e:
        failed_save(job, str(e), space=getattr(e, "disk_full", False))  # within the budget: go on
    job.ledger.event(EventKind.CHECKPOINT, t0, time.time(), step=job.state.step, detail={"flush": True})
    record_persisted(job)
