"""How often to checkpoint: Young's and Daly's first-order optimum.

With a checkpoint costing δ seconds of training time and interruptions arriving on average
every M seconds, checkpointing every τ seconds wastes about δ/τ of the time on checkpoints
and, per interruption, half an interval of lost work plus the restart R. Young (1974):
τ = √(2δM). Daly (2006) refines it for δ not small against M:

    τ = √(2δM) · [1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ    for δ < 2M,   else τ = M.
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass

DEFAULT_MTBF_HOURS = 24.0


def young(delta: float, mtbf: float) -> float:
    return math.sqrt(2 * delta * mtbf)


def daly(delta: float, mtbf: float) -> float:
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
    tau = max(daly(delta, mtbf), 1e-3)
    return Interval(tau, young(delta, mtbf), delta, mtbf, restart, delta / (tau + delta),
                    min(1.0, ((tau + delta) / 2 + restart) / mtbf))


def mtbf_from_ledger(con: sqlite3.Connection | None, host: str) -> tuple[float, str] | None:
    """Mean seconds between interruptions on `host`: attempt time over attempts that were killed
    or crashed (not completed, not stopped on request). None without one interruption on record."""
    if con is None:
        return None
    rows = con.execute("SELECT start, COALESCE(end, last_seen, start), outcome FROM attempts "
                       "WHERE host = ?", (host,)).fetchall()
    hours = sum(max(0.0, end - start) for start, end, _ in rows)
    failures = sum(1 for _, _, outcome in rows if outcome in ("crashed", "killed"))
    if failures == 0:
        return None
    return hours / failures, f"{failures} interruptions in {hours / 3600:.1f} h of attempts on {host}"


def mtbf_seconds(setting_hours: float, con: sqlite3.Connection | None, host: str) -> tuple[float, str]:
    """M for the recipe: its setting, else the ledger's history of this machine, else a default."""
    if setting_hours > 0:
        return setting_hours * 3600, "[checkpoint] interruption_hours"
    found = mtbf_from_ledger(con, host)
    if found is not None and found[0] > 0:
        return found
    return DEFAULT_MTBF_HOURS * 3600, f"default {DEFAULT_MTBF_HOURS:g} h (no interruption on record)"
