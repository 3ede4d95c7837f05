"""What the ledger knows about this machine: how often runs on it are interrupted, and how fast
its checkpoints are. Read by the training loop (every_seconds = "auto") and by `ember plan`.

Only attempts that died without saying ("killed": SIGKILL, the OOM killer, a power cut) count as
interruptions: a stop on request checkpoints first and loses nothing, and an error ("failed",
"crashed") says nothing about the machine."""

from __future__ import annotations

import sqlite3

DEFAULT_MTBF_HOURS = 24.0
INTERRUPTIONS = ("killed",)


def mtbf_from_ledger(con: sqlite3.Connection | None, host: str) -> tuple[float, str] | None:
    """Mean seconds between interruptions on `host`: attempt time over attempts that were
    interrupted. None without one interruption on record."""
    if con is None:
        return None
    rows = con.execute("SELECT start, COALESCE(end, last_seen, start), outcome FROM attempts "
                       "WHERE host = ?", (host,)).fetchall()
    seconds = sum(max(0.0, end - start) for start, end, _ in rows)
    failures = sum(1 for _, _, outcome in rows if outcome in INTERRUPTIONS)
    if failures == 0:
        return None
    return seconds / failures, (f"{failures} interruption{'' if failures == 1 else 's'} in "
                                f"{seconds / 3600:.1f} h of attempts on {host}")


def mtbf_seconds(setting_hours: float, con: sqlite3.Connection | None, host: str) -> tuple[float, str]:
    """M for a recipe: its setting, else the ledger's history of this machine, else a default."""
    if setting_hours > 0:
        return setting_hours * 3600, "[checkpoint] interruption_hours"
    found = mtbf_from_ledger(con, host)
    if found is not None and found[0] > 0:
        return found
    return DEFAULT_MTBF_HOURS * 3600, f"default {DEFAULT_MTBF_HOURS:g} h (no interruption on record)"


def checkpoint_rates(con: sqlite3.Connection | None, host: str) -> tuple[float, float, int] | None:
    """Median snapshot and durable-save bytes per second of this machine's checkpoints over 1 MB
    (the newest 50), and how many; None when the ledger has none."""
    if con is None:
        return None
    rows = con.execute(
        "SELECT c.bytes, c.blocked_seconds, c.durable_seconds FROM checkpoints c JOIN attempts a "
        "ON a.run_id = c.run_id AND a.attempt = c.attempt WHERE a.host = ? AND c.bytes > 1e6 "
        "ORDER BY c.created DESC LIMIT 50", (host,)).fetchall()
    if not rows:
        return None
    snap = sorted(b / max(s, 1e-6) for b, s, _ in rows)[len(rows) // 2]
    durable = sorted(b / max(d, 1e-6) for b, _, d in rows)[len(rows) // 2]
    return snap, durable, len(rows)
