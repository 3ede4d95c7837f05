"""Ops a real micro-batch step of builtin:tiny dispatches, counted (ember.metrics.peaks.count_ops):
what the plan's counts of 4-bit calls (ember.plan.dequant) and recomputed ops (ember.plan.recompute)
are checked against."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ember.metrics.peaks import count_ops
from ember.recipe import Recipe, load_recipe
from tests.helpers import write_recipe


def second_step_ops(folder: Path, method: dict, ac: bool, which: Callable[[str], bool] = lambda _: True
                    ) -> tuple[int, Recipe]:
    """Ops `which` accepts in builtin:tiny's second micro-batch step (its update included: the
    optimizer state exists from the first) under `method`, 1 x 16 tokens, and its recipe."""
    from ember.doctor.measure import build_for_measurement, measured_step
    r = load_recipe(write_recipe(folder, data={"seq_len": 16}, method=method,
                                 train={"micro_batch": 1, "grad_accum": 1, "activation_checkpointing": ac}))
    bundle, device = build_for_measurement(r)
    step = measured_step(bundle.model, torch.randint(0, 200, (1, 16)), device, "fp32", 0, r)
    step()
    return count_ops(step, which), r
