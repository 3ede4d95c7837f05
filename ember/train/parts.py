"""The objects one training step touches, built one way for a run (ember.train.job) and for a
measurement (the doctor's calibration and DDP experiment), so both take the same step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.ckpt.state import RunState
from ember.recipe import OptimizerConfig, Recipe
from ember.train.breakdown import StepTimer
from ember.train.compiled import Compiler, Eager
from ember.train.dropout import DropoutKeys
from ember.train.model import trainable_parameters
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


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """The one optimizer ember trains with: AdamW over the trainable parameters."""
    return torch.optim.AdamW(trainable_parameters(model), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_parts(recipe: Recipe, device: torch.device, model: torch.nn.Module) -> StepParts:
    """Optimizer, learning-rate schedule, loss scaler, a fresh RunState and the step timer."""
    optimizer = build_optimizer(model, recipe.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ScaledSchedule(recipe.schedule, recipe.train.max_steps))
    scaler = torch.amp.GradScaler(device.type, enabled=recipe.precision.mode == "fp16")
    return StepParts(recipe, device, model, optimizer, scheduler, scaler,
                     RunState(recipe_digest=recipe.digest()), StepTimer(device))

