"""The objects one training step touches, built one way for a run (ember.train.job) and for a
measurement (the doctor's calibration and DDP experiment), so both take the same step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ember.ckpt.state import RunState
from ember.recipe import INT8_STATE_MIN_ELEMENTS, OptimizerConfig, Recipe
from ember.train.breakdown import StepTimer
from ember.train.compiled import Compiler, Eager
from ember.train.dropout import DropoutKeys
from ember.train.model import trainable_parameters
from ember.train.quantize import bitsandbytes
from ember.train.schedule import ScaledSchedule
from ember.world import World


@dataclass
class StepParts:
    recipe: Recipe
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    state: RunState
    timer: StepTimer
    world: World = field(default_factory=World)  # one process: a measurement never spans ranks
    dropout: DropoutKeys = field(default_factory=DropoutKeys)  # unused: a measurement keeps nn.Dropout
    compiler: Compiler | Eager = field(default_factory=Eager)  # the step's loss, compiled or not


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The one optimizer ember trains with: AdamW over the trainable parameters, its moments in
    fp32 or (state_dtype 'int8') in bitsandbytes' blockwise 8 bits."""
    params = trainable_parameters(model)
    if cfg.state_dtype == "int8":
        # Plain tensors in its state_dict (uint8 codes, fp32 block scales and code maps), so the
        # checkpoint stores them as any other; its CPU update is plain torch and C, no compile.
        return _bitsandbytes().optim.AdamW8bit(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                               weight_decay=cfg.weight_decay,
                                               min_8bit_size=INT8_STATE_MIN_ELEMENTS)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, weight_decay=cfg.weight_decay)


_STATE_KEY = {"fp32": "exp_avg", "int8": "state1"}  # a key each kind's per-parameter state always has


def _bitsandbytes() -> Any:
    return bitsandbytes("[optimizer] state_dtype = 'int8'", "set state_dtype = 'fp32'")


def check_state(optimizer: torch.optim.Optimizer, state_dtype: str) -> None:
    """Raise ValueError when loaded optimizer state is of the other kind (a checkpoint taken with
    the other [optimizer] state_dtype): either optimizer would fail on it at its next step."""
    want = _STATE_KEY[state_dtype]
    for state in optimizer.state.values():
        if want not in state:
            other = next(k for k in _STATE_KEY if k != state_dtype)
            raise ValueError(f"the checkpoint holds AdamW moments in {other}, the recipe's [optimizer] "
                             f"state_dtype is '{state_dtype}'")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors as its state_dict (and so a checkpoint) holds them."""
    def count(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(count(v) for v in x.values()) if isinstance(x, dict) else 0
    return sum(count(s) for s in optimizer.state_dict()["state"].values())


def build_parts(recipe: Recipe, device: torch.device, model: torch.nn.Module) -> StepParts:
    """Optimizer, learning-rate schedule, loss scaler, a fresh RunState and the step timer."""
    optimizer = build_optimizer(model, recipe.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ScaledSchedule(recipe.schedule, recipe.train.max_steps))
    scaler = torch.amp.GradScaler(device.type, enabled=recipe.precision.mode == "fp16")
    return StepParts(recipe, device, model, optimizer, scheduler, scaler,
                     RunState(recipe_digest=recipe.digest()), StepTimer(device))

