"""Assemble everything a training run needs, and restore it from the newest valid checkpoint."""

from __future__ import annotations

import functools
import os
import socket
import sqlite3
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from ember import faults
from ember.ckpt import contents
from ember.ckpt.state import RunState, seed_all
from ember.ckpt.store import CheckpointStore
from ember.ckpt.writer import CheckpointWriter
from ember.device import configure_determinism, pick_device
from ember.errors import EmberError
from ember.jsonl import read_jsonl
from ember.ledger import store as ledger_store
from ember.ledger.manifest import build_manifest
from ember.ledger.store import Ledger, NullLedger
from ember.metrics.flops import architecture_of, flops_per_token
from ember.metrics.peaks import Peak, device_name, lookup_peak, measured_cpu_peak
from ember.plan.interval import mtbf_seconds
from ember.proc import process_start_time
from ember.recipe import Recipe
from ember.train.breakdown import StepTimer
from ember.train.data import PackedBatches, data_fingerprint, tokenize
from ember.train.model import ModelBundle, load_model, trainable_parameters
from ember.train.rundir import RunDir
from ember.train.schedule import ScaledSchedule


@dataclass
class Job:
    recipe: Recipe
    run: RunDir
    device: torch.device
    bundle: ModelBundle
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    store: CheckpointStore
    state: RunState
    tokens_path: Path
    console: Console
    ledger: Ledger | NullLedger
    started: float  # process start: the attempt's wall-clock begins here, imports included
    writer: CheckpointWriter
    snapshot_buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # reused host memory
    mtbf_seconds: float = 0.0  # expected time between interruptions, for every_seconds = "auto"
    timer: StepTimer | None = None  # the always-on step breakdown
    phase_totals: dict[str, float] = field(default_factory=dict)  # this attempt's, per phase

    @property
    def model(self) -> torch.nn.Module:
        return self.bundle.model

    def apply_lr_scale(self) -> None:
        """Make the optimizer's learning rates reflect RunState.lr_scale (after a rollback)."""
        schedule = self.scheduler.lr_lambdas[0]
        schedule.scale = self.state.lr_scale
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * schedule(self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def batches(self) -> PackedBatches:
        """Micro-batches from the state's data cursor on."""
        d, t = self.recipe.data, self.recipe.train
        return PackedBatches(self.tokens_path, d.seq_len, t.micro_batch, t.seed, self.state.cursor)


def prepare(recipe: Recipe, out: Path, allow_change: bool, console: Console,
            recipe_file: Path | None = None, ledger_path: Path | None | bool = None) -> Job:
    """Open the run folder, build model, data and optimizer, and resume if a checkpoint exists.

    `ledger_path`: None for the default ledger, a path, or False for no accounting."""
    started = process_start_time()
    warn = functools.partial(_warn, console)
    run = RunDir.open(out, recipe, allow_change, warn)
    device = pick_device(recipe.train.device)
    threads = configure_determinism(recipe.train.deterministic,
                                    run.record.get("threads") or recipe.train.threads, device)
    seed_all(recipe.train.seed)  # before the model: random init and LoRA init draw from it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers/peft deprecation chatter
        bundle = load_model(recipe.model, recipe.method, recipe.train.activation_checkpointing)
    if recipe.data.seq_len > bundle.max_positions:
        raise EmberError(f"[data] seq_len = {recipe.data.seq_len}: beyond the model's context of "
                         f"{bundle.max_positions} positions; lower it")
    bundle.model.to(device)
    fingerprint = data_fingerprint(recipe.data.files, bundle.tokenizer)
    manifest = build_manifest(recipe_file or Path("."), device, threads, recipe.train.seed,
                              recipe.train.deterministic)
    manifest["data_fingerprint"] = fingerprint
    _record_inputs(run, bundle, fingerprint, threads, manifest, allow_change, warn)
    run.record["performance"] = performance(bundle, recipe, device, threads)
    run.save_record()
    tokens_path = tokenize(recipe.data, bundle.tokenizer, fingerprint)

    opt = recipe.optimizer
    optimizer = torch.optim.AdamW(trainable_parameters(bundle.model), lr=opt.lr,
                                  betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, ScaledSchedule(recipe.schedule, recipe.train.max_steps))
    scaler = torch.amp.GradScaler(device.type, enabled=recipe.precision.mode == "fp16")
    store = CheckpointStore(run.ckpt_dir, recipe.checkpoint.keep_last)
    store.sweep()
    ledger = open_ledger(ledger_path, run, recipe, warn)
    job = Job(recipe, run, device, bundle, optimizer, scheduler, scaler, store,
              RunState(recipe_digest=recipe.digest()), tokens_path, console, ledger, started,
              CheckpointWriter(store, background=recipe.checkpoint.async_))
    job.timer = StepTimer(device)
    if recipe.checkpoint.every_seconds == "auto":
        job.mtbf_seconds, source = mtbf_seconds(recipe.checkpoint.interruption_hours,
                                                getattr(ledger, "con", None), socket.gethostname())
        console.print(f"checkpoint interval: Young/Daly from each checkpoint's measured cost and "
                      f"{job.mtbf_seconds / 3600:.3g} h between interruptions ({source})", highlight=False)
    t0 = time.time()
    resumed = restore(job, warn)
    lost = run.rewind_metrics(job.state.step)
    resumed_from = job.state.step if resumed else None
    if isinstance(ledger, Ledger):
        ledger.call(ledger_store.start_attempt, run.attempt, started, socket.gethostname(),
                    os.getpid(), device_label(device), resumed_from)
        if resumed:
            ledger.event("restore", t0, time.time(), step=job.state.step)
    run.start_attempt({"resumed_from_step": resumed_from, "lost_steps": lost,
                       "setup_seconds": round(time.time() - started, 3)})
    return job


def open_ledger(path: Path | None | bool, run: RunDir, recipe: Recipe, warn: Any) -> Ledger | NullLedger:
    """Register the run and close the attempts that died without saying; a no-op if disabled."""
    if path is False:
        return NullLedger()
    con = ledger_store.connect(path or None)  # a newer schema or a non-database: refuse, clearly
    last_seen: dict[int, float] = {}
    for name in ("metrics.jsonl", "metrics.lost.jsonl"):
        for r in read_jsonl(run.path / name):
            last_seen[r["attempt"]] = max(last_seen.get(r["attempt"], 0.0), r["time"])
    try:
        ledger_store.register_run(con, run.record["id"], run.path, run.path.name, recipe.digest(),
                                  run.record.get("manifest", {}), recipe.train.max_steps)
        ledger_store.close_dead_attempts(con, run.record["id"], last_seen)
    except sqlite3.OperationalError as e:  # busy past the timeout: train anyway, say so
        warn(f"ledger busy or unwritable ({e}); this attempt runs without accounting")
        return NullLedger()
    return Ledger(con, run.record["id"], run.attempt, warn)


def performance(bundle: ModelBundle, recipe: Recipe, device: torch.device, threads: int) -> dict[str, Any]:
    """FLOPs per token and the peak to divide by: what MFU needs, recorded once per attempt."""
    flops = flops_per_token(architecture_of(bundle.model, recipe.data.seq_len))
    if recipe.cost.peak_tflops:
        peak = Peak(recipe.cost.peak_tflops * 1e12, "recipe [cost] peak_tflops")
    elif device.type == "cpu":
        peak = measured_cpu_peak(threads)
    else:
        peak = lookup_peak(device_name(device), recipe.precision.mode)
    return {"flops_per_token": flops.total, "flops_formula": flops.formula, "peak_flops": peak.flops,
            "peak_source": peak.source, "device_name": device_name(device), "devices": 1}


def device_label(device: torch.device) -> str:
    return f"{device_name(device)} x1"


def restore(job: Job, warn: Any) -> bool:
    """Load the newest checkpoint that verifies; else capture a fresh run's RNG. True if resumed."""
    while (ckpt := job.store.load_latest(warn)) is not None:
        try:
            job.state = contents.read_files(ckpt.path, job.model, job.optimizer, job.scheduler,
                                            job.scaler)
        except (ValueError, RuntimeError, KeyError) as e:
            job.store.quarantine(ckpt.path, "corrupt")
            warn(f"checkpoint {ckpt.path.name} verifies but does not load ({e}); trying an older one")
            continue
        job.state.restore_rng(job.device)
        if faults.flag("resume.fresh_optimizer"):  # a non-resumable state, for preflight's test
            job.optimizer.state.clear()
        job.state.recipe_digest = job.recipe.digest()
        job.console.print(f"resuming from {ckpt.path} (step {job.state.step}, "
                          f"attempt {job.run.attempt})")
        return True
    job.state.capture_rng(job.device)
    return False


def _record_inputs(run: RunDir, bundle: ModelBundle, fingerprint: str, threads: int,
                   manifest: dict[str, Any], allow_change: bool, warn: Any) -> None:
    """Record model and data identity once; refuse a resume over changed data."""
    old = run.record.get("data_fingerprint")
    if old is not None and old != fingerprint:
        if not allow_change:
            raise EmberError(f"--out {run.path}: the data or tokenizer changed since this run began "
                             f"(fingerprint {old[:12]} -> {fingerprint[:12]}); restore them, use "
                             f"another --out, or pass --allow-recipe-change")
        warn("continuing over changed data (recorded in run.json)")
        run.record["recipe_changes"].append({"time": time.time(), "data_fingerprint": [old, fingerprint]})
    if old != fingerprint or "manifest" not in run.record:
        run.record.update(data_fingerprint=fingerprint, model=bundle.source, threads=threads,
                          manifest=manifest)


def _warn(console: Console, message: str) -> None:
    console.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False)
