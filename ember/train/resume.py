"""Resume: choose the newest committed checkpoint that verifies (setting damaged ones aside),
load it into the job whichever world size saved it, and restore its RNG streams; a fresh run
captures its RNG instead. With several ranks, rank 0 chooses and every rank loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from ember import faults
from ember.ckpt import contents
from ember.ckpt.sharded import is_sharded, read_full, read_sharded
from ember.ckpt.state import RunState, seed_all
from ember.ckpt.store import CheckpointStore, SetAside
from ember.parallel.pp import pipeline_of
from ember.errors import EmberError
from ember.events import Events
from ember.recipe import Recipe
from ember.runfolder import RunDir
from ember.train.parts import check_state
from ember.train.sharding import unwrapped
from ember.world import World


class Resumable(Protocol):
    """What a resume reads and loads into: a run's Job (ember.train.job) has all of it."""
    recipe: Recipe
    run: RunDir
    device: torch.device
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    store: CheckpointStore
    state: RunState
    events: Events
    world: World

    @property
    def model(self) -> torch.nn.Module: ...


def restore(job: Resumable, from_scratch: bool = False) -> bool:
    """Load the newest checkpoint that verifies; else capture a fresh run's RNG. True if resumed.

    A damaged checkpoint is set aside when an older one verifies. When checkpoints were committed
    and none verifies, nothing is moved and the run stops, unless `from_scratch` says to set them
    all aside and start again at step 0. With several ranks, rank 0 chooses and every rank loads.
    A resume that fails leaves run.json's recipe as it was (a change this attempt recorded is undone)."""
    try:
        return _restore(job, from_scratch)
    except BaseException:
        if job.world.main:
            job.run.undo_changes()
        raise


def _restore(job: Resumable, from_scratch: bool) -> bool:
    choice: tuple[str, str] | None = None  # ("load", folder) or ("error", message)
    if job.world.main:
        try:
            path = choose_checkpoint(job, from_scratch)
            choice = ("load", str(path)) if path is not None else None
        except EmberError as e:
            choice = ("error", str(e))
    choice = job.world.broadcast(choice)
    if choice is not None and choice[0] == "error":
        raise EmberError(choice[1])
    if choice is None:
        job.state.capture_rng(job.device)
        return False
    path = Path(choice[1])
    try:
        own_rng = load_checkpoint(job, path)
        check_state(job.optimizer, job.recipe.optimizer.state_dtype)
    except (ValueError, RuntimeError, KeyError) as e:  # it verifies: it is whole, yet not this model's
        raise EmberError(f"checkpoint {path} is intact but does not load into this run's model and "
                         f"optimizer ({type(e).__name__}: {str(e)[:300]}); was [model] or [method] changed? "
                         f"Restore the recipe, or start a new --out") from None
    if own_rng:
        job.state.restore_rng(job.device)
    else:  # another world size saved it: this rank's dropout stream starts afresh from its seed
        seed_all(job.recipe.train.seed + job.world.rank + 1_000_003 * job.state.step)
        job.state.capture_rng(job.device)
        if job.world.main:
            job.events.warn(f"{path.name} was saved by a different number of ranks: resharded; the RNG "
                            f"streams (dropout) restart from the seed, the data order continues exactly")
    if faults.flag("resume.fresh_optimizer"):  # a non-resumable state, for preflight's test
        job.optimizer.state.clear()
    job.state.recipe_digest = job.recipe.digest()
    job.events.info(f"resuming from {path} (step {job.state.step}, attempt {job.run.attempt})",
                    step=job.state.step)
    return True


def load_checkpoint(job: Resumable, path: Path) -> bool:
    """Load `path` into the job, whichever world size saved it; True if this rank's own RNG
    streams were in it."""
    own_rng = True
    if is_sharded(path):  # saved by several ranks (DCP): loads at any world size
        job.state, own_rng = read_sharded(path, job.model, job.optimizer, job.scheduler, job.scaler, job.world)
    elif job.world.distributed:  # saved by one process: every rank reads the full tensors
        if pipeline_of(job.model) is not None:
            raise EmberError(f"{path}: a checkpoint saved by one process cannot be resumed on pipeline stages "
                             f"yet (its optimizer state is keyed by the whole model's parameter order, which a "
                             f"stage does not hold); resume it in one process or with distributed.strategy = "
                             f"\"ddp\" or \"fsdp\", or start the pipeline run in a new --out folder")
        names = [n for n, p in unwrapped(job.model).named_parameters() if p.requires_grad]
        job.state, own_rng = read_full(path, job.model, names, job.optimizer, job.scheduler, job.scaler), False
    else:
        job.state = contents.read_files(path, job.model, job.optimizer, job.scheduler, job.scaler)
    return own_rng


def choose_checkpoint(job: Resumable, from_scratch: bool) -> Path | None:
    """The newest committed checkpoint that verifies; damaged ones are set aside when one does
    (or when `from_scratch`); raises when checkpoints exist and none verifies."""
    damaged: list[tuple[str, str]] = []  # (checkpoint folder name, why it does not load)
    for _, path in reversed(job.store.committed()):
        try:
            job.store.verify(path)
        except ValueError as e:
            damaged.append((path.name, str(e)))
            continue
        for name, why in damaged:
            moved = job.store.quarantine(job.store.root / name, SetAside.CORRUPT)
            job.events.warn(f"checkpoint {name} is damaged ({why}); moved it to {moved.name} and resumed "
                            f"from {path.name}")
        return path
    if damaged and not from_scratch:
        raise EmberError(f"--out {job.run.path}: none of its {len(damaged)} committed checkpoints "
                         f"verifies:\n" + "\n".join(f"  {name} is damaged: {why}" for name, why in damaged)
                         + "\nnothing was moved or trained. Restore them from a backup, or run again "
                         "with --restart-from-scratch to set them aside (as corrupt-*) and train from step 0")
    for name, _ in damaged:
        job.store.quarantine(job.store.root / name, SetAside.CORRUPT)
    if damaged:
        job.events.warn(f"--restart-from-scratch: set aside {len(damaged)} damaged checkpoints; "
                        f"training from step 0")
    return None
