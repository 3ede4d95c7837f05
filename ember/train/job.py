"""Assemble everything a training run needs, and restore it from the newest valid checkpoint."""

from __future__ import annotations

import dataclasses
import os
import socket
import sqlite3
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ember.ckpt.policy import auto_of, cadence
from ember.ckpt.state import DataCursor, RunState, seed_all
from ember.ckpt.store import CheckpointStore
from ember.ckpt.writer import CheckpointWriter
from ember.device import configure_determinism, pick_device
from ember.launchspec import LaunchSpec
from ember.errors import EmberError
from ember.events import Event, Events
from ember.hardware import name_of
from ember.jsonl import read_jsonl
from ember.ledger import database as ledger_store
from ember.ledger.history import mtbf_seconds
from ember.ledger.manifest import build_manifest
from ember.ledger.database import Ledger, NullLedger
from ember.ledger.goodput import EventKind
from ember.metrics.flops import architecture_of, flops_per_token
from ember.metrics.peaks import select_peak
from ember.models import check_against_model, config_fields, reading
from ember.proc import process_start_time
from ember.recipe import DataFormat, Recipe
from ember.train.breakdown import StepTimer
from ember.train.compiled import Compiler, Eager, build as build_compiler
from ember.train.dropout import DropoutKeys, install as install_dropout
from ember.data.sources import data_file_hashes
from ember.data.loader import (PackedBatches, data_fingerprint, eval_tokens, resolve_packing,
                              store_info, tokenize)
from ember.train.model import ModelBundle, load_model
from ember.train.sharding import check_distributed, parallelize, tp_degree
from ember.train.parts import build_parts
from ember.train.resume import restore
from ember.runfolder import RunDir
from ember.data.truncation import learning
from ember.world import World, join


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
    events: Events
    ledger: Ledger | NullLedger
    started: float  # process start: the attempt's wall-clock begins here, imports included
    writer: CheckpointWriter
    snapshot_buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # reused host memory
    mtbf_seconds: float = 0.0  # expected time between interruptions, for EveryAuto (ember.ckpt.policy)
    timer: StepTimer | None = None  # the always-on step breakdown (ember.train.breakdown)
    phase_totals: dict[str, float] = field(default_factory=dict)  # this attempt's, per phase
    world: World = field(default_factory=World)  # the ranks (one, by default)
    wrapped: torch.nn.Module | None = None  # the model under DDP / FSDP, when distributed
    dropout: DropoutKeys = field(default_factory=DropoutKeys)  # which rows LoRA's dropout masks are for
    compiler: Compiler | Eager = field(default_factory=Eager)  # [train] compile (ember.train.compiled)

    @property
    def model(self) -> torch.nn.Module:
        """The model the step trains (the DDP wrapper, when there is one)."""
        return self.wrapped if self.wrapped is not None else self.bundle.model

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
        return PackedBatches(self.tokens_path, d.seq_len, t.micro_batch, t.seed, self.state.cursor,
                             *resolve_packing(d, self.tokens_path))


def prepare(recipe: Recipe, out: Path, allow_change: bool, events: Events,
            recipe_file: Path | None = None, ledger_path: Path | None | bool = None,
            from_scratch: bool = False, launch: LaunchSpec | None = None) -> Job:
    """Open the run folder, build model, data and optimizer, and resume if a checkpoint exists.

    `ledger_path`: None for the default ledger, a path, or False for no accounting.
    `from_scratch`: when no committed checkpoint verifies, set them aside and start at step 0.
    `launch`: what the launcher decided (ember.launchspec): the service's job and its devices."""
    started = process_start_time()
    device, world, events = join_world(recipe, out, events)
    # Rank 0 owns the run folder; the others read it once rank 0 has opened (or created) it.
    run = RunDir.open(out, recipe, allow_change, events) if world.main else None
    world.barrier()
    if run is None:
        run = RunDir.read(out)
    run.attempt = world.broadcast(run.attempt)
    threads = configure_determinism(recipe.train.deterministic, rank_threads(recipe, world)
                                    or run.record.get("threads") or recipe.train.threads, device)
    seed_all(recipe.train.seed)  # before the model: random init and LoRA init draw from it, alike on every rank
    with reading(recipe.model.path):  # a .gguf file's first run converts it as the config is read: one parse
        check_against_model(recipe.data.seq_len, recipe.method, config_fields(recipe.model.path, events))
        events.stage("loading the model", model=recipe.model.path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers/peft deprecation chatter
            bundle = load_model(recipe.model, recipe.method, recipe.train.activation_checkpointing, events)
    dropout = install_dropout(bundle.model, recipe.train.seed)  # LoRA's masks by sample, not by rank
    bundle.model.to(device)
    if world.distributed:  # each rank its own stream for other dropout (saved per rank in the checkpoint)
        seed_all(recipe.train.seed + world.rank)
    fingerprint = data_fingerprint(recipe.data.files, bundle.tokenizer)
    if world.main:
        # The manifest (git state of two folders, the package list) is built only when recorded:
        # a resume over unchanged data keeps the first attempt's, as it always did.
        _record_inputs(run, bundle, fingerprint, threads,
                       lambda: run_manifest(recipe, recipe_file, device, threads, world, fingerprint),
                       allow_change, events)
        run.record["performance"] = performance(bundle, recipe, device, threads, world.size)
        run.save_record()
        tokens_path = tokenize(recipe.data, bundle.tokenizer, fingerprint, events, recipe.eval)
        run.record["data"] = data_notes(recipe, tokens_path, events)
        run.save_record()
    world.barrier()  # the tokens are cached once, by rank 0
    if not world.main:
        tokens_path = tokenize(recipe.data, bundle.tokenizer, fingerprint, events, recipe.eval)

    p = build_parts(recipe, device, parallelize(bundle.model, recipe, world, device))
    store = CheckpointStore(run.ckpt_dir, recipe.checkpoint.keep_last)
    if world.main:
        store.sweep()
    ledger = open_ledger(ledger_path, run, recipe, events) if world.main else NullLedger()
    # A distributed checkpoint is a collective (DCP): it is taken in the training thread.
    writer = CheckpointWriter(store, background=recipe.checkpoint.async_ and not world.distributed,
                              nice=recipe.checkpoint.persist_nice)
    job = Job(recipe, run, device, bundle, p.optimizer, p.scheduler, p.scaler, store, p.state, tokens_path,
              events, ledger, started, writer, mtbf_seconds=checkpoint_mtbf(recipe, ledger, events),
              timer=p.timer, world=world, wrapped=p.model, dropout=dropout,
              compiler=build_compiler(recipe.train.compile))
    t0 = time.time()
    resumed = restore(job, from_scratch)
    start_attempt(job, resumed, t0, launch)
    return job


def join_world(recipe: Recipe, out: Path, events: Events) -> tuple[torch.device, World, Events]:
    """This process's device, its place among the ranks (one, unless launched as several), and
    the events it speaks through (ember.train.job.rank_events)."""
    device = pick_device(recipe.train.device)
    world = join(device, recipe.distributed.timeout_seconds)
    if not world.distributed:
        return device, world, events
    check_distributed(recipe, world.size, f"--out {out}")
    if device.type != "cpu":  # one accelerator per rank on its node
        device = torch.device(device.type, world.local_rank)
    tp = tp_degree(recipe, world.size)  # the ranks of a tensor-parallel group read the same data
    world = dataclasses.replace(world, dp_rank=world.rank // tp, dp_size=world.size // tp)
    return device, world, rank_events(events, world)


def run_manifest(recipe: Recipe, recipe_file: Path | None, device: torch.device, threads: int, world: World,
                 fingerprint: str) -> dict[str, Any]:
    """What this attempt runs on and with (ember.ledger.manifest), its data and its ranks."""
    manifest = build_manifest(recipe_file or Path("."), device, threads, recipe.train.seed,
                              recipe.train.deterministic)
    manifest["data_fingerprint"] = fingerprint
    manifest["world"] = {"ranks": world.size, "strategy": recipe.distributed.strategy,
                         "backend": world.backend} if world.distributed else None
    return manifest


def checkpoint_mtbf(recipe: Recipe, ledger: Ledger | NullLedger, events: Events) -> float:
    """Expected seconds between interruptions when [checkpoint] every_seconds = "auto" (from the
    recipe, else the ledger's history of this machine, else 24 h; said once); else 0."""
    auto = auto_of(cadence(recipe.checkpoint))
    if auto is None:
        return 0.0
    mtbf, source = mtbf_seconds(auto.interruption_hours, getattr(ledger, "con", None), socket.gethostname())
    events.info(f"checkpoint interval: Young/Daly from each checkpoint's measured cost and "
                f"{mtbf / 3600:.3g} h between interruptions ({source})")
    return mtbf


def start_attempt(job: Job, resumed: bool, restored_at: float, launch: LaunchSpec | None = None) -> None:
    """Rank 0 rewinds metrics.jsonl to the state's step and records the attempt's start (run.json,
    the ledger, with the service's job and devices from `launch`; `restored_at`: when the restore
    began); every rank says where training starts."""
    run, world, recipe, step = job.run, job.world, job.recipe, job.state.step
    resumed_from = step if resumed else None
    if world.main:
        lost = run.rewind_metrics(step)
        names = launch.device_names if launch is not None else None
        job.ledger.call(ledger_store.start_attempt, run.attempt, job.started, socket.gethostname(), os.getpid(),
                        ",".join(names) if names else device_label(job.device, world.size), resumed_from,
                        launch.job if launch is not None else None)
        if resumed:
            job.ledger.event(EventKind.RESTORE, restored_at, time.time(), step=step)
        run.start_attempt({"resumed_from_step": resumed_from, "lost_steps": lost,
                           "setup_seconds": round(time.time() - job.started, 3),
                           **({"ranks": world.size, "strategy": recipe.distributed.strategy}
                              if world.distributed else {})})
    job.events.stage(f"training from step {step}" + (f" (attempt {run.attempt})" if resumed else "")
                     + (f" on {world.size} ranks ({recipe.distributed.strategy}, {world.backend})"
                        if world.distributed else ""),
                     step=step, attempt=run.attempt)


def data_notes(recipe: Recipe, tokens_path: Path, events: Events) -> dict[str, Any]:
    """What the data became (format, packing, counts, long records, the tokens learned after
    the cut and the packing), for run.json; said once. Refuses a training split with no learned
    token left, and a held-out split with none to evaluate; warns when many records lose all of
    theirs (ember.data.truncation)."""
    info = store_info(tokens_path)
    packing, rule = resolve_packing(recipe.data, tokens_path)
    d = recipe.data
    train = learning(tokens_path, d.seq_len, packing, rule)
    try:
        notes = PackedBatches(tokens_path, d.seq_len, recipe.train.micro_batch, 0, DataCursor(), packing, rule).notes
    except EmberError:  # no row at all: every record dropped (say so), or too little data (the loop says so)
        if train.dropped:
            raise EmberError(train.refusal()) from None
        return {**info, "packing": packing, "long_records": rule, "packing_notes": {}}
    if (refused := train.refusal()) is not None:
        raise EmberError(refused)
    held = learning(eval_path, d.seq_len, packing, rule) if (eval_path := eval_tokens(tokens_path)) else None
    if held is not None and (refused := held.eval_refusal()) is not None:
        raise EmberError(refused)
    how = "detected" if d.format == DataFormat.AUTO else "[data] format"
    if mixed := [Path(f).name for f, fmt in info.get("files", {}).items() if fmt != info.get("format")]:
        how += f"; the completion records of {', '.join(mixed)} as one-turn conversations"
    said = (f"data: {info.get('format', 'text')} records ({how}), {train.records} for training "
            f"({train.summary()}), packing {packing}")
    if held is not None:
        said += f"; {held.records} held out for evaluation ({held.learned:,} tokens learned)"
    if notes.get("longer_than_seq_len"):
        said += f"; {notes['longer_than_seq_len']} longer than seq_len {d.seq_len}: " + {
            "split": "split into pieces", "truncate": "end cut", "keep_answer": "prompt's beginning cut",
            "drop": "left out"}[rule]
    events.info(said)
    warnings = [w for w in [train.warning()] if w]
    for w in warnings:
        events.warn(w)
    return {**info, "packing": packing, "long_records": rule, "packing_notes": notes,
            "learning": train.to_dict(), **({"eval_learning": held.to_dict()} if held else {}),
            "warnings": warnings}


def rank_threads(recipe: Recipe, world: World) -> int:
    """CPU threads of one rank: the recipe's, or this machine's cores shared among the ranks on
    it (all cores to each would oversubscribe them N times); 0 for a one-process run (its own
    rule: the recipe's, or the count the run first recorded)."""
    if not world.distributed:
        return 0
    on_this_node = int(os.environ.get("LOCAL_WORLD_SIZE", world.size))
    return recipe.train.threads or max(1, (os.cpu_count() or 1) // on_this_node)


def rank_events(events: Events, world: World) -> Events:
    """Rank 0 speaks for the run; another rank says only its warnings, under its name."""
    if world.main:
        return events
    sink = events.sink

    def warnings_only(e: Event) -> None:
        if e.kind == "warning" and sink is not None:
            sink(dataclasses.replace(e, message=f"rank {world.rank}: {e.message}"))
    return Events(warnings_only)


def open_ledger(path: Path | None | bool, run: RunDir, recipe: Recipe, events: Events) -> Ledger | NullLedger:
    """Register the run and close the attempts that died without saying; a no-op if disabled.
    A ledger that cannot be opened costs the run its accounting, never the run."""
    if path is False:
        return NullLedger()
    con = ledger_store.connect_or_warn(path or None, events.warn)
    if con is None:
        return NullLedger()
    last_seen: dict[int, float] = {}
    for name in ("metrics.jsonl", "metrics.lost.jsonl"):
        for r in read_jsonl(run.path / name):
            last_seen[r["attempt"]] = max(last_seen.get(r["attempt"], 0.0), r["time"])
    try:
        ledger_store.register_run(con, run.record["id"], run.path, run.path.name, recipe.digest(),
                                  run.record.get("manifest", {}), recipe.train.max_steps)
        ledger_store.close_dead_attempts(con, run.record["id"], last_seen)
    except sqlite3.OperationalError as e:  # busy past the timeout: train anyway, say so
        events.warn(f"ledger busy or unwritable ({e}); this attempt runs without accounting")
        return NullLedger()
    return Ledger(con, run.record["id"], run.attempt, events.warn)


def performance(bundle: ModelBundle, recipe: Recipe, device: torch.device, threads: int,
                devices: int = 1) -> dict[str, Any]:
    """FLOPs per token and the peak to divide by: what MFU needs, recorded once per attempt."""
    flops = flops_per_token(architecture_of(bundle.model, recipe.data.seq_len))
    name = name_of(device)
    peak = select_peak(recipe.cost.peak_tflops, device.type, name, recipe.precision.mode, threads)
    return {"flops_per_token": flops.total, "flops_formula": flops.formula, "peak_flops": peak.flops,
            "peak_source": peak.source, "device_name": name, "devices": devices}


def remeasure_peak(job: Job, share: float) -> bool:
    """The attempt achieved `share` (above 1) of a CPU peak measured at its start, on a machine
    busy then: measure the peak again (the higher is kept), record it as the run's and say so.
    False, doing nothing, where the peak is no measurement (the recipe's, the table's)."""
    perf = job.run.record.get("performance") or {}
    if job.device.type != "cpu" or not str(perf.get("peak_source", "")).startswith("measured"):
        return False
    old = perf["peak_flops"]
    r = job.recipe
    peak = select_peak(r.cost.peak_tflops, "cpu", "cpu", r.precision.mode, job.run.record.get("threads", 0),
                       again=True)
    perf.update(peak_flops=peak.flops, peak_source=peak.source)
    job.run.save_record()
    job.events.warn(f"MFU came out at {share:.1%} of the CPU peak measured at start-up ({old / 1e12:.4g} "
                    f"TFLOP/s), which cannot be true: that measurement was low (a busy machine, or a matmul slower "
                    f"at its size than the run's). Measured again now: "
                    f"{peak.flops / 1e12:.4g} TFLOP/s, the run's peak from here on")
    return True


def device_label(device: torch.device, devices: int = 1) -> str:
    return f"{name_of(device)} x{devices}"


def _record_inputs(run: RunDir, bundle: ModelBundle, fingerprint: str, threads: int,
                   manifest: Callable[[], dict[str, Any]], allow_change: bool, events: Events) -> None:
    """Record model and data identity, and the manifest (`manifest()`, built only then), when
    the run begins or its data changed; refuse a resume over changed data."""
    old = run.record.get("data_fingerprint")
    # [eval] files are the held-out losses' data (the best checkpoint, [eval] patience): hashed
    # beside the fingerprint (a run that began before they were recorded takes them as they are).
    evals = data_file_hashes(run.record["recipe"].get("eval", {}).get("files", []))
    old_evals = run.record.setdefault("eval_files", evals)
    if old is not None and (old != fingerprint or old_evals != evals):
        if not allow_change and run.has_checkpoints():
            edited = sorted(f for f in old_evals.keys() | evals.keys() if old_evals.get(f) != evals.get(f))
            what = (f"fingerprint {old[:12]} -> {fingerprint[:12]}" if old != fingerprint else
                    f"[eval] files: {', '.join(edited)}")
            raise EmberError(f"--out {run.path}: the data or tokenizer changed since this run began "
                             f"({what}); restore them, use another --out, or pass --allow-recipe-change")
        events.warn("continuing over changed data (recorded in run.json)")
        run.record["recipe_changes"].append({"time": time.time(), "data_fingerprint": [old, fingerprint],
                                             **({"eval_files": [old_evals, evals]} if old_evals != evals else {})})
        run.record["eval_files"] = evals
    if old != fingerprint or "manifest" not in run.record:
        run.record.update(data_fingerprint=fingerprint, model=bundle.source, threads=threads,
                          manifest=manifest(), data_files=data_file_hashes(run.record["recipe"]["data"]["files"]))
