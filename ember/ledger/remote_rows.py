"""Remote jobs in the ledger: their rows and transitions, the month's spend per target, and a
remote run's accounting copied into this ledger. Only SQL lives here; which state may follow
which, and who may change it, is ember.ledger.job_states."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_TABLES = ("attempts", "events", "checkpoints", "step_phases", "summaries")  # rows keyed by run_id


@dataclass
class RemoteJobRow:
    id: int
    name: str
    target: str
    backend_id: str | None       # the id its backend gave it (Slurm's job id); None before it was submitted
    state: str                   # a JobState of ember.ledger.job_states' REMOTE machine
    submitted: float
    updated: float
    audit_id: int
    audit_hash: str
    host: str                    # where the backend's client runs ('' this machine, else an SSH host)
    ssh_options: list[str]       # options for ssh to reach it (the target's)
    python: str                  # the Python with ember there
    recipe: str
    out: str                     # the local run folder the results come back to
    remote_dir: str              # the job's folder on the cluster (staged data, its run folder)
    limits: dict[str, Any]
    prediction: dict[str, Any]
    run_id: str | None = None
    cost: float | None = None    # as of the last results brought back
    detail: str | None = None    # the last thing that happened to it
    backend: str = "slurm"       # the kind of its target when submitted (ember.remote.backends)


@contextmanager
def transaction(con: sqlite3.Connection) -> Iterator[None]:
    """One write transaction (the ledger's connections are in autocommit mode)."""
    con.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def _row(r: sqlite3.Row) -> RemoteJobRow:
    d = dict(r)
    for k in ("limits", "prediction", "ssh_options"):
        d[k] = json.loads(d[k])
    return RemoteJobRow(**d)


def insert(con: sqlite3.Connection, job: dict[str, Any], state: str) -> RemoteJobRow:
    """A new job: `job` has RemoteJobRow's fields from name to prediction, and its backend."""
    now = time.time()
    row = {**job, "state": state, "submitted": now, "updated": now,
           **{k: json.dumps(job[k]) for k in ("limits", "prediction", "ssh_options")}}
    with transaction(con):
        cur = con.execute(f"INSERT INTO remote_jobs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                          tuple(row.values()))
        con.execute("INSERT INTO remote_transitions VALUES (?, ?, NULL, ?, 'staging')", (cur.lastrowid, now, state))
    return get(con, cur.lastrowid)


def get(con: sqlite3.Connection, job_id: int) -> RemoteJobRow | None:
    r = con.execute("SELECT * FROM remote_jobs WHERE id = ?", (job_id,)).fetchone()
    return _row(r) if r else None


def find(con: sqlite3.Connection, ref: str, target: str | None = None) -> list[RemoteJobRow]:
    """Jobs whose backend id or name is `ref` (on `target`, when given)."""
    sql = "SELECT * FROM remote_jobs WHERE (backend_id = ? OR name = ?)" + (" AND target = ?" if target else "")
    return [_row(r) for r in con.execute(sql + " ORDER BY id", (ref, ref, target) if target else (ref, ref))]


def all_jobs(con: sqlite3.Connection) -> list[RemoteJobRow]:
    return [_row(r) for r in con.execute("SELECT * FROM remote_jobs ORDER BY id")]


def set_state(con: sqlite3.Connection, job_id: int, src: str, dst: str, why: str, fields: dict[str, Any]) -> bool:
    """Compare-and-set: move from `src` to `dst` (and set `fields`) only if still in `src`."""
    now = time.time()
    fields = {k: json.dumps(v) if k in ("limits", "prediction", "ssh_options") else v for k, v in fields.items()}
    sets = ", ".join(f"{k} = ?" for k in fields)
    with transaction(con):
        cur = con.execute(f"UPDATE remote_jobs SET state = ?, updated = ?{', ' + sets if sets else ''} "
                          "WHERE id = ? AND state = ?", (dst, now, *fields.values(), job_id, src))
        if cur.rowcount and dst != src:
            con.execute("INSERT INTO remote_transitions VALUES (?, ?, ?, ?, ?)", (job_id, now, src, dst, why))
    return bool(cur.rowcount)


def transitions(con: sqlite3.Connection, job_id: int) -> list[tuple[float, str | None, str, str]]:
    return [tuple(r) for r in con.execute("SELECT time, from_state, to_state, why FROM remote_transitions "
                                          "WHERE job_id = ? ORDER BY time, rowid", (job_id,))]


def month_spend(con: sqlite3.Connection, target: str, since: float, final: tuple[str, ...]) -> float:
    """What jobs submitted to `target` since `since`, or continued since then (staged again under
    new limits, which the gate let go against this month's cap), commit: a job in a `final` state
    its cost as brought back, any other its cost limit (it may still spend that much) and,
    continued, what it had spent before."""
    total = 0.0
    for r in con.execute("SELECT state, cost, limits FROM remote_jobs WHERE target = ? AND (submitted >= ? OR id IN "
                         "(SELECT job_id FROM remote_transitions WHERE to_state = 'staging' AND time >= ?))",
                         (target, since, since)):
        if r["state"] in final:
            total += r["cost"] or 0.0
        else:
            limits = json.loads(r["limits"])
            total += (limits.get("max_cost") or 0.0) + limits.get("spent_before", 0.0)
    return total


def import_run(con: sqlite3.Connection, src: sqlite3.Connection, run_id: str, local_path: Path) -> bool:
    """Copy run `run_id`'s rows from the remote job's ledger `src` into `con` (its attempts,
    events, checkpoints, step phases, summary), the run registered at `local_path`. Replaces what
    an earlier copy brought, in one transaction, so it can run at every status poll. False when
    `src` does not hold the run yet: a poll can land after the run wrote its record and before its
    ledger has tables (`ember remote status --wait` died of "no such table: runs" there)."""
    if src.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone() is None:
        return False
    run = src.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if run is None:
        return False
    with transaction(con):
        d = dict(run) | {"path": str(local_path.resolve())}
        con.execute(f"INSERT OR REPLACE INTO runs ({', '.join(d)}) VALUES ({', '.join('?' * len(d))})",
                    tuple(d.values()))
        for table in RUN_TABLES:
            con.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
            for r in src.execute(f"SELECT * FROM {table} WHERE run_id = ?", (run_id,)).fetchall():
                keys = [k for k in r.keys() if not (table == "events" and k == "id")]  # ids are this ledger's
                con.execute(f"INSERT INTO {table} ({', '.join(keys)}) VALUES ({', '.join('?' * len(keys))})",
                            tuple(r[k] for k in keys))
    return True
