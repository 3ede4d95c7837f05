"""What one checkpoint holds, under a few fixed file names:

    model.safetensors       trainable weights (all of them for full fine-tuning, the adapters for LoRA)
    optimizer.safetensors   optimizer state_dict: its tensors under stable keys ("state/0/exp_avg"),
                            the rest of its structure (param_groups, ...) as JSON in the metadata
    train_state.pt          RunState, scheduler and grad-scaler state (a few KB; torch.save)

Both safetensors files are written by `ember.ckpt.tensorfile` straight from the snapshot's
tensors (no pickling, no serialized copy), checksummed as they are written. Checkpoints of
format ember-checkpoint/1 hold `optimizer.pt` (torch.save) instead, and still load.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ember.ckpt import tensorfile
from ember.ckpt.state import RunState
from ember.durable import write_image, write_stream

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_FILE_V1 = "optimizer.pt"  # ember-checkpoint/1
STATE_FILE = "train_state.pt"
WEIGHTS_METADATA = {"format": "pt"}


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters by name; tied weights appear once (named_parameters dedups them)."""
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class Snapshot:
    """Host-memory copies of everything a checkpoint holds, taken between two steps. `images`:
    the safetensors files laid out whole in page-aligned buffers (copying snapshots), which the
    persist writes with O_DIRECT; empty for a snapshot that references live tensors."""
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    extra: dict[str, Any]
    images: dict[str, tensorfile.FileImage] = field(default_factory=dict)


def _to_host(x: Any, copy: bool, buffers: dict[str, torch.Tensor], key: str) -> Any:
    """Tensors to host memory. Copies go into buffers kept from the previous snapshot (fresh
    allocations would page-fault gigabytes each time), pinned for accelerator tensors so the
    device-to-host copy is asynchronous. copy=False references live CPU tensors (synchronous
    saves, where training waits anyway)."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and not copy:
            return x.detach()
        buf = buffers.get(key)
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
            buf = buffers[key] = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.device.type != "cpu")
        return buf.copy_(x.detach(), non_blocking=x.device.type != "cpu")
    if isinstance(x, dict):
        return {k: _to_host(v, copy, buffers, f"{key}/{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(v, copy, buffers, f"{key}/{i}") for i, v in enumerate(x))
    return x


def _into_image(name: str, live: dict[str, torch.Tensor], metadata: dict[str, str] | None,
                buffers: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Copy live tensors into the file image kept in `buffers` under `name` (made or remade when
    the tensors' shapes change); return the copies, views into the image."""
    pinned = any(t.device.type != "cpu" for t in live.values())
    img = buffers[name] = tensorfile.image_of(live, metadata, buffers.get(name), pinned)
    for n, t in live.items():
        img.tensors[n].copy_(t.detach(), non_blocking=pinned)
    return img.tensors


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
             state: RunState, copy: bool, buffers: dict[str, Any] | None = None) -> Snapshot:
    """Capture the training state. The caller must not reuse `buffers` while a persist of the
    previous snapshot is in flight (the writer's wait() comes first)."""
    buffers = {} if buffers is None else buffers
    extra = _to_host({"run_state": state.to_dict(), "scheduler": scheduler.state_dict(),
                      "scaler": scaler.state_dict()}, copy, buffers, "x")
    if not copy:
        snap = Snapshot(_to_host(trainable_state(model), False, buffers, "w"),
                        _to_host(optimizer.state_dict(), False, buffers, "o"), extra)
    else:
        weights = _into_image(MODEL_FILE, trainable_state(model), WEIGHTS_METADATA, buffers)
        live, metadata = tensorfile.flatten_tree(optimizer.state_dict())
        copies = _into_image(OPTIMIZER_FILE, live, metadata, buffers)
        snap = Snapshot(weights, tensorfile.unflatten_tree(copies, metadata), extra,
                        {MODEL_FILE: buffers[MODEL_FILE], OPTIMIZER_FILE: buffers[OPTIMIZER_FILE]})
    if any(t.is_pinned() for t in snap.weights.values()):
        torch.accelerator.synchronize()  # the non-blocking copies must land before a writer reads them
    return snap


def write_snapshot(folder: Path, snap: Snapshot) -> dict[str, Any]:
    """Write the checkpoint files into `folder`, each durable and checksummed as it is written;
    return their manifest entries (the store fsyncs the folder and commits)."""
    extra = io.BytesIO()
    torch.save(snap.extra, extra)
    if snap.images:
        files = {name: write_image(folder / name, img.view(), img.size) for name, img in snap.images.items()}
    else:
        files = {MODEL_FILE: write_stream(folder / MODEL_FILE, tensorfile.parts(snap.weights, WEIGHTS_METADATA)),
                 OPTIMIZER_FILE: write_stream(folder / OPTIMIZER_FILE, tensorfile.parts_of_tree(snap.optimizer))}
    files[STATE_FILE] = write_stream(folder / STATE_FILE, [extra.getbuffer()])
    return files


def read_optimizer(folder: Path) -> dict[str, Any]:
    """The optimizer state_dict a checkpoint holds, in either format."""
    if (folder / OPTIMIZER_FILE).is_file():
        return tensorfile.read_tree(folder / OPTIMIZER_FILE)
    return torch.load(folder / OPTIMIZER_FILE_V1, weights_only=True)


def read_weights(folder: Path, model: nn.Module) -> None:
    """Load a verified checkpoint's trainable weights into `model` (built as the run built it)."""
    weights = load_file(folder / MODEL_FILE)
    expected = set(trainable_state(model))
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(f"{folder.name}/{MODEL_FILE} does not match the model: "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in weights.items():
            params[name].copy_(tensor)


def read_files(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: Any, scaler: Any) -> RunState:
    """Load a verified checkpoint into the live objects; return its RunState."""
    read_weights(folder, model)
    optimizer.load_state_dict(read_optimizer(folder))
    extra_state = torch.load(folder / STATE_FILE, weights_only=True)
    scheduler.load_state_dict(extra_state["scheduler"])
    scaler.load_state_dict(extra_state["scaler"])
    return RunState.from_dict(extra_state["run_state"])
