"""Assemble everything a training run needs, and restore it from the newest valid checkpoint."""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from ember.ckpt import contents
from ember.ckpt.state import RunState, seed_all
from ember.ckpt.store import CheckpointStore
from ember.device import configure_determinism, pick_device
from ember.errors import EmberError
from ember.recipe import Recipe
from ember.train.data import PackedBatches, data_fingerprint, tokenize
from ember.train.model import ModelBundle, load_model, trainable_parameters
from ember.train.rundir import RunDir, environment
from ember.train.schedule import lr_factor


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

    @property
    def model(self) -> torch.nn.Module:
        return self.bundle.model

    def batches(self) -> PackedBatches:
        """Micro-batches from the state's data cursor on."""
        d, t = self.recipe.data, self.recipe.train
        return PackedBatches(self.tokens_path, d.seq_len, t.micro_batch, t.seed, self.state.cursor)


def prepare(recipe: Recipe, out: Path, allow_change: bool, console: Console) -> Job:
    """Open the run folder, build model, data and optimizer, and resume if a checkpoint exists."""
    started = time.time()
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
    _record_inputs(run, bundle, fingerprint, threads, allow_change, warn)
    tokens_path = tokenize(recipe.data, bundle.tokenizer, fingerprint)

    opt = recipe.optimizer
    optimizer = torch.optim.AdamW(trainable_parameters(bundle.model), lr=opt.lr,
                                  betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, cfg=recipe.schedule, max_steps=recipe.train.max_steps))
    scaler = torch.amp.GradScaler(device.type, enabled=recipe.precision.mode == "fp16")
    store = CheckpointStore(run.ckpt_dir, recipe.checkpoint.keep_last)
    store.sweep()
    job = Job(recipe, run, device, bundle, optimizer, scheduler, scaler, store,
              RunState(recipe_digest=recipe.digest()), tokens_path, console)
    resumed = restore(job, warn)
    lost = run.rewind_metrics(job.state.step)
    run.start_attempt({"resumed_from_step": job.state.step if resumed else None,
                       "lost_steps": lost, "setup_seconds": round(time.time() - started, 3)})
    return job


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
        job.state.recipe_digest = job.recipe.digest()
        job.console.print(f"resuming from {ckpt.path} (step {job.state.step}, "
                          f"attempt {job.run.attempt})")
        return True
    job.state.capture_rng(job.device)
    return False


def _record_inputs(run: RunDir, bundle: ModelBundle, fingerprint: str, threads: int,
                   allow_change: bool, warn: Any) -> None:
    """Record model and data identity once; refuse a resume over changed data."""
    old = run.record.get("data_fingerprint")
    if old is not None and old != fingerprint:
        if not allow_change:
            raise EmberError(f"--out {run.path}: the data or tokenizer changed since this run began "
                             f"(fingerprint {old[:12]} -> {fingerprint[:12]}); restore them, use "
                             f"another --out, or pass --allow-recipe-change")
        warn("continuing over changed data (recorded in run.json)")
        run.record["recipe_changes"].append({"time": time.time(), "data_fingerprint": [old, fingerprint]})
    if old != fingerprint or "environment" not in run.record:
        run.record.update(data_fingerprint=fingerprint, model=bundle.source, threads=threads,
                          environment=environment())
        run.save_record()


def _warn(console: Console, message: str) -> None:
    console.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False)
