"""What the ledger knows about this machine: its attempts, for how often runs on it are
interrupted (the arithmetic is ledger/mtbf.py's), and how fast its checkpoints are. Read by the
training loop (every_seconds = "auto"), `ember plan` and `ember doctor`."""

from __future__ import annotations

import sqlite3

from ember.ledger.mtbf import AttemptTime, Mtbf, mtbf


def attempt_times(con: sqlite3.Connection | None, host: str) -> list[AttemptTime]:
    """Every attempt on `host` in the ledger: its seconds (to its end, else its last sign of life) and outcome."""
    if con is None:
        return []
    rows = con.execute("SELECT start, COALESCE(end, last_seen, start), outcome FROM attempts "
                       "WHERE host = ?", (host,)).fetchall()
    return [AttemptTime(end - start, outcome) for start, end, outcome in rows]


def mtbf_seconds(setting_hours: float, con: sqlite3.Connection | None, host: str) -> Mtbf:
    """M for a recipe on `host`: its setting, else the ledger's history of `host`, else a default."""
    return mtbf(setting_hours, attempt_times(con, host), host)


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
