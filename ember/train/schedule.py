"""Learning-rate schedules as pure functions of the step."""

from __future__ import annotations

import math

from ember.recipe import ScheduleConfig


def lr_factor(step: int, cfg: ScheduleConfig, max_steps: int) -> float:
    """Multiplier of the peak learning rate for the update made at `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return 1.0
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.min_lr_ratio
    if cfg.kind == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ScaledSchedule:
    """LambdaLR's multiplier: the schedule's factor times a scale that rollbacks lower.

    Plain attributes only: LambdaLR saves a callable object's __dict__ in its state_dict, which
    must load with torch.load(weights_only=True)."""

    def __init__(self, cfg: ScheduleConfig, max_steps: int):
        self.kind, self.warmup_steps, self.min_lr_ratio = cfg.kind, cfg.warmup_steps, cfg.min_lr_ratio
        self.max_steps, self.scale = max_steps, 1.0

    def __call__(self, step: int) -> float:
        cfg = ScheduleConfig(kind=self.kind, warmup_steps=self.warmup_steps, min_lr_ratio=self.min_lr_ratio)
        return lr_factor(step, cfg, self.max_steps) * self.scale
