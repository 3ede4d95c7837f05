"""Ops a real micro-batch step of builtin:tiny dispatches, counted: what the plan's counts of
4-bit calls (ember.plan.dequant) and recomputed ops (ember.plan.recompute) are checked against."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ember.recipe import Recipe, load_recipe
from tests.helpers import write_recipe


class Counted(TorchDispatchMode):
    """Every op dispatched whose name `which` accepts, counted."""

    def __init__(self, which: Callable[[str], bool]):
        super().__init__()
        self.which, self.n = which, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += bool(self.which(str(func)))
        return func(*args, **(kwargs or {}))


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
    counted = Counted(which)
    with counted:
        step()
    return counted.n, r
