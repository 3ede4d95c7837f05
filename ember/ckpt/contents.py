"""What one checkpoint holds, under a few fixed file names:

    model.safetensors   trainable weights (all of them for full fine-tuning, the adapters for LoRA)
    optimizer.pt        optimizer state_dict
    train_state.pt      RunState, scheduler and grad-scaler state
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ember.ckpt.state import RunState

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "train_state.pt"


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters by name; tied weights appear once (named_parameters dedups them)."""
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class Snapshot:
    """Host-memory copies of everything a checkpoint holds, taken between two steps."""
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    extra: dict[str, Any]


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


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
             state: RunState, copy: bool, buffers: dict[str, torch.Tensor] | None = None) -> Snapshot:
    """Capture the training state. The caller must not reuse `buffers` while a persist of the
    previous snapshot is in flight (the writer's wait() comes first)."""
    buffers = {} if buffers is None else buffers
    snap = Snapshot(_to_host(trainable_state(model), copy, buffers, "w"),
                    _to_host(optimizer.state_dict(), copy, buffers, "o"),
                    _to_host({"run_state": state.to_dict(), "scheduler": scheduler.state_dict(),
                              "scaler": scaler.state_dict()}, copy, buffers, "x"))
    if any(t.is_pinned() for t in snap.weights.values()):
        torch.accelerator.synchronize()  # the non-blocking copies must land before a writer reads them
    return snap


def write_snapshot(folder: Path, snap: Snapshot) -> None:
    """Write the checkpoint files into `folder` (the store fsyncs and checksums them)."""
    save_file(snap.weights, folder / MODEL_FILE)
    torch.save(snap.optimizer, folder / OPTIMIZER_FILE)
    torch.save(snap.extra, folder / STATE_FILE)


def read_files(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: Any, scaler: Any) -> RunState:
    """Load a verified checkpoint into the live objects; return its RunState."""
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
    optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True))
    extra_state = torch.load(folder / STATE_FILE, weights_only=True)
    scheduler.load_state_dict(extra_state["scheduler"])
    scaler.load_state_dict(extra_state["scaler"])
    return RunState.from_dict(extra_state["run_state"])
