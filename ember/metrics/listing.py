"""The ledger's runs as a table: `ember runs` and the dashboard's Runs page and `/api/runs`.
Filtering and sorting live here so the command and the page agree."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ember.errors import EmberError, NotFound
from ember.ledger.database import attempts
from ember.metrics.report import list_runs, pid_alive

SORT_KEYS = ("created", "id", "name", "status", "steps", "progress", "tokens_per_second_per_device", "mfu",
             "goodput", "cost", "p50", "p99", "wall_seconds")


@dataclass
class RunEntry:
    """One row of the runs table."""
    id: str
    name: str | None
    path: str
    created: float
    status: str
    steps: int
    max_steps: int
    progress: float                       # steps / max_steps
    tokens_per_second_per_device: float | None
    mfu: float | None
    goodput: float | None
    wall_seconds: float | None
    cost: float | None
    currency: str | None
    p50: float | None
    p99: float | None


def run_table(con: sqlite3.Connection, status: str | None = None, match: str | None = None,
              sort: str = "created", descending: bool = False) -> list[RunEntry]:
    """Every run in the ledger (see report.list_runs), those of `status` whose id, name or folder
    contain `match` (case-insensitive), sorted by `sort`; a missing figure sorts last either way."""
    if sort not in SORT_KEYS:
        raise EmberError(f"sort {sort!r}: one of {', '.join(SORT_KEYS)}")
    entries = []
    for row, s in list_runs(con):
        entries.append(RunEntry(row["id"], row["name"], row["path"], row["created"], s.status, s.steps, s.max_steps,
                                s.steps / s.max_steps if s.max_steps else 0.0, s.tokens_per_second_per_device,
                                s.mfu, s.goodput, s.wall_seconds, s.cost, s.currency, s.p50, s.p99))
    if status:
        entries = [e for e in entries if e.status == status]
    if match:
        needle = match.lower()
        entries = [e for e in entries if needle in e.id.lower() or needle in (e.name or "").lower()
                   or needle in e.path.lower()]
    present = [e for e in entries if getattr(e, sort) is not None]
    present.sort(key=lambda e: getattr(e, sort), reverse=descending)
    return present + [e for e in entries if getattr(e, sort) is None]


def run_folder(con: sqlite3.Connection, run_id: str) -> Path:
    """The folder of the ledger's run with exactly this id: what a web request may name. No paths
    and no prefixes, so nothing outside the ledger's runs can be reached through it."""
    row = con.execute("SELECT path FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        raise NotFound(f"no run {run_id!r} in the ledger; `ember runs` lists them")
    return Path(row["path"])


def run_live(con: sqlite3.Connection, run_id: str) -> bool:
    """Whether an attempt of the run is still going: no outcome yet and its process alive here."""
    rows = attempts(con, run_id)
    return bool(rows) and rows[-1].outcome is None and pid_alive(rows[-1].pid, rows[-1].host)
