"""Checkpoints of a distributed run, through torch.distributed.checkpoint (DCP), committed under
the store's protocol (ember.ckpt.store): one checkpoint, whatever the world size.

    .metadata          DCP's index of every tensor and object (written by rank 0)
    __R_0.distcp       rank R's shards (DDP's replicated tensors are written once, by rank 0)

Under fixed keys: `model` and `optim` as torch.distributed.checkpoint.state_dict gives them (by
parameter name, the same for a plain, DDP and FSDP model: so a checkpoint saved by N ranks loads
into M ranks and into another strategy; DCP reshards), and `rank{R}`: rank R's RunState (its
RNG streams), scheduler and grad-scaler state, as bytes. `model` holds the trained parameters
alone (LoRA: the adapters), as a one-process checkpoint does: `trained_state`. The stages of a
pipeline-parallel run hold different parameters, so their optimizers' param_groups differ: they
save `optim` flattened (torch's flatten_optimizer_state_dict: the hyperparameters under each
parameter's name, as torchtitan saves every run), and a load reads the form the metadata holds.

A one-process run's checkpoint (model.safetensors, optimizer.safetensors, train_state.pt: see
ember.ckpt.contents) loads into a distributed run too: `read_full` hands the full tensors to
set_state_dict, which shards them.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ember.ckpt.contents import MODEL_FILE, STATE_FILE, read_optimizer
from ember.ckpt.state import RunState
from ember.parallel.pp import pipeline_of
from ember.world import World, lost_peer

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

# torch.distributed.checkpoint (DTensor, sympy: 0.4 s) is imported where a sharded checkpoint is
# written or read, not by every run that imports this module.

METADATA = ".metadata"


def is_sharded(folder: Path) -> bool:
    return (folder / METADATA).is_file()


def _extra(state: RunState, scheduler: Any, scaler: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save({"run_state": state.to_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict()}, buf)
    buf.seek(0)
    return buf


@contextlib.contextmanager
def own_errors() -> Iterator[None]:
    """Around a DCP save or load: DCP reports each rank's failure inside a CheckpointException, a
    BaseException that no handler of a checkpoint's errors takes (a full disk, a tensor of
    another shape: a traceback). Raised instead: the first failure itself, as a one-process
    checkpoint raises it, unless a rank was lost (ember.world.lost_peer: the launcher reads that)."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except CheckpointException as e:
        failures = [exc for exc, _ in e.failures.values()]
        if not failures or lost_peer(e) or any(lost_peer(f) for f in failures):
            raise
        raise failures[0] from None


def trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, flat: bool = False) -> tuple[dict, dict]:
    """The model's trained parameters and the optimizer's state, by parameter name. DCP's
    ignore_frozen_params drops a frozen parameter under its first name only: a frozen weight tied
    under a second one (LoRA on a model whose head shares the embeddings: SmolLM2's 28M-parameter
    lm_head) stayed in every checkpoint. Kept here: the names of parameters that train."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    options = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=flat)
    msd, osd = get_state_dict(model, optimizer, options=options)
    trained = _trained(model)
    return {k: v for k, v in msd.items() if k in trained}, osd


def _trained(model: torch.nn.Module) -> set[str]:
    """The names of the parameters that train, as state dicts name them (no DDP "module.")."""
    return {n.removeprefix("module.") for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, msd: dict, osd: dict,
          options: StateDictOptions) -> None:
    """set_state_dict, refusing a model state that leaves out a parameter that trains."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    result = set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=options)
    missing = sorted(_trained(model) & {k.removeprefix("module.") for k in result.missing_keys})
    if missing:
        raise KeyError(f"the checkpoint holds no {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))


def write_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                  scaler: Any, state: RunState, world: World) -> None:
    """Every rank writes its part into `folder` (a collective). DCP's writer fsyncs each file it
    writes (sync_files), before the store checksums them."""
    import torch.distributed.checkpoint as dcp
    msd, osd = trained_state(model, optimizer, flat=pipeline_of(model) is not None)
    sd = {"model": msd, "optim": osd, f"rank{world.rank}": _extra(state, scheduler, scaler)}
    with own_errors():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(folder, sync_files=True, single_file_per_rank=True))


def own_files(folder: Path, world: World) -> list[Path]:
    """The files of `folder` this rank wrote (rank 0 also the metadata)."""
    mine = [p for p in folder.iterdir() if p.name.startswith(f"__{world.rank}_")]
    return mine + ([folder / METADATA] if world.main and (folder / METADATA).exists() else [])


def read_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 scaler: Any, world: World) -> tuple[RunState, bool]:
    """Load a DCP checkpoint into the live objects at any world size (DCP reshards); return the
    RunState and whether it is this rank's own (False: saved by fewer ranks, so this rank starts
    from rank 0's RNG streams)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    names = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    saved = {k.partition(".")[0] for k in names if k.startswith("rank")}
    key = f"rank{world.rank}" if f"rank{world.rank}" in saved else "rank0"
    flat = not any(k.startswith("optim.param_groups.0.") for k in names)  # saved by a pipeline's stages
    msd, osd = trained_state(model, optimizer, flat)  # what to read: older checkpoints hold more, never less
    sd = {"model": msd, "optim": osd, key: io.BytesIO()}
    with own_errors():
        dcp.load(sd, storage_reader=dcp.FileSystemReader(folder))
    # The frozen weights are the model's own (LoRA's base) and not in the checkpoint, which a strict
    # load_state_dict calls missing; `_load` checks instead that every trained one was there.
    options = StateDictOptions(ignore_frozen_params=True, strict=False, flatten_optimizer_state_dict=flat)
    _load(model, optimizer, sd["model"], sd["optim"], options)
    sd[key].seek(0)
    extra = torch.load(sd[key], weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    scaler.load_state_dict(extra["scaler"])
    return RunState.from_dict(extra["run_state"]), key == f"rank{world.rank}"


def read_model(folder: Path, model: torch.nn.Module) -> None:
    """Load a DCP checkpoint's trainable weights alone into a whole model in one process (no
    process group: `ember export`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    trainable = StateDictOptions(ignore_frozen_params=True)  # LoRA: the adapters, as a one-process run
    sd = {"model": get_model_state_dict(model, options=trainable)}
    with warnings.catch_warnings():  # DCP says it loads in one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with own_errors():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(folder))
    set_model_state_dict(model, sd["model"], options=trainable)


def read_full(folder: Path, model: torch.nn.Module, names: list[str], optimizer: torch.optim.Optimizer,
              scheduler: Any, scaler: Any) -> RunState:
    """Load a one-process checkpoint into a distributed model: every rank reads the full
    tensors and set_state_dict keeps its own shard. `names`: the trainable parameters' names
    in the optimizer's order (the optimizer file keys its state by that position)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    weights = load_file(folder / MODEL_FILE)
    osd = read_optimizer(folder)
    held = 1 + max([*osd["state"], *(i for g in osd["param_groups"] for i in g["params"])], default=-1)
    if held > len(names):  # a recipe changed to train fewer parameters than the checkpoint's
        raise ValueError(f"{folder.name}: its optimizer state holds {held} parameters; this model trains {len(names)}")
    by_name = {"state": {names[i]: s for i, s in osd["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
    _load(model, optimizer, weights, by_name, StateDictOptions(full_state_dict=True, ignore_frozen_params=True,
                                                               strict=False))
    extra = torch.load(folder / STATE_FILE, weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    scaler.load_state_dict(extra["scaler"])
    return RunState.from_dict(extra["run_state"])
