"""How often to checkpoint: Young's and Daly's first-order optimum. Pure arithmetic, used by
the training loop (checkpoint.every_seconds = "auto") and by `ember plan`.

With a checkpoint costing δ seconds of training time and interruptions arriving on average
every M seconds, checkpointing every τ seconds wastes about δ/τ of the time on checkpoints
and, per interruption, half an interval of lost work plus the restart R. Young (1974):
τ = √(2δM). Daly (2006) refines it for δ not small against M:

    τ = √(2δM) · [1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ    for δ < 2M,   else τ = M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def young(delta: float, mtbf: float) -> float:
    """Young's interval τ = √(2δM)."""
    return math.sqrt(2 * delta * mtbf)


def daly(delta: float, mtbf: float) -> float:
    """Daly's higher-order interval (the module docstring's formula)."""
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


@dataclass(frozen=True)
class Interval:
    seconds: float  # Daly's τ
    young_seconds: float
    delta: float
    mtbf: float
    restart: float
    checkpoint_share: float  # δ / (τ + δ): time spent checkpointing
    lost_share: float  # ((τ + δ) / 2 + R) / M: expected recomputation and restart per unit time


def recommend(delta: float, mtbf: float, restart: float = 0.0) -> Interval:
    """Daly's interval with the time it spends checkpointing and expects to lose."""
    tau = max(daly(delta, mtbf), 1e-3)
    return Interval(tau, young(delta, mtbf), delta, mtbf, restart, delta / (tau + delta),
                    min(1.0, ((tau + delta) / 2 + restart) / mtbf))
