"""What one checkpoint holds, under a few fixed file names:

    model.safetensors   trainable weights (all of them for full fine-tuning, the adapters for LoRA)
    optimizer.pt        optimizer state_dict
    train_state.pt      RunState, scheduler and grad-scaler state
"""

from __future__ import annotations

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


def write_files(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Any, scaler: Any, state: RunState) -> None:
    """Write the checkpoint files into `folder` (the store fsyncs and checksums them)."""
    save_file({k: v.cpu() for k, v in trainable_state(model).items()}, folder / MODEL_FILE)
    torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)
    torch.save({"run_state": state.to_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict()}, folder / STATE_FILE)


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
