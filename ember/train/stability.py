"""Numerical guards: judge each step's loss and gradient norm before its update is applied.

    empty      no learned token in the step's rows (its loss is 0/0): never applied
    nonfinite  NaN/Inf loss, or NaN/Inf gradient norm outside fp16 loss scaling: never applied
    spike      loss above median + k * MAD of the recent window: [guard] spike_action decides
               (warn: apply it; skip: do not apply it; rollback: back to the last checkpoint,
               skip the step's batches on the replay, scale the learning rate)
    ok         apply it

Pure: the window lives in RunState, so a replay judges every step exactly as before.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ember.recipe import GuardConfig


@dataclass(frozen=True)
class Verdict:
    kind: str            # "ok" | "empty" | "nonfinite" | "spike"
    threshold: float | None = None


def judge(loss: float, grad_norm: float, tokens: int, window: list[float], cfg: GuardConfig,
          scaler_handles_inf: bool) -> Verdict:
    """The verdict on a step of `tokens` learned tokens (see the module docstring)."""
    if tokens == 0:
        return Verdict("empty")
    if not math.isfinite(loss) or (not math.isfinite(grad_norm) and not scaler_handles_inf):
        return Verdict("nonfinite")
    if cfg.spike_action == "off" or len(window) < cfg.spike_min_steps:
        return Verdict("ok")
    median = statistics.median(window)
    mad = statistics.median(abs(x - median) for x in window)
    threshold = median + cfg.spike_k * max(mad, 1e-3 * abs(median), 1e-8)
    return Verdict("spike", threshold) if loss > threshold else Verdict("ok", threshold)


def push(window: list[float], loss: float, size: int) -> list[float]:
    """The window after a step whose loss was accepted."""
    return (window + [loss])[-size:]
