"""The service's jobs in the ledger: rows and their transitions. Only SQL lives here; which state
may follow which, and who may change it, is ember.ledger.job_states."""

from __future__ import annotations

import functools
import json
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

JSON_FIELDS = ("overrides", "devices", "request")


@dataclass(frozen=True)
class JobRow:
    id: int
    name: str
    recipe: str
    out: str
    overrides: list[str]
    priority: int
    state: str                       # a JobState of ember.ledger.job_states' LOCAL machine
    submitted: float                 # when it joined the queue: submitted, or requeued by hand
    updated: float
    request: dict[str, Any]
    hold: str | None = None          # why it may not start: "user" (held by hand), "interrupted", "cancel"
    started: float | None = None
    pid: int | None = None
    pid_start: str | None = None     # the process's start time (/proc), so a reused PID is not it
    devices: list[int] = field(default_factory=list)
    cause: str | None = None         # why it failed, or the last thing that happened to it
    preemptions: int = 0
    pause: str | None = None         # soft pause asked of it: "inference", "owner", "user"


# Rows already made, by their raw values: the service reads every queued and live job ten times
# a second, and decoding each one's request (its whole resolved recipe, ~2 KB of JSON) was most
# of a tick's CPU with many jobs queued (bench/queue_tick.py). A row whose values are the same
# makes the same JobRow, so nothing here goes stale; the JobRows are shared, and never changed.
ROWS_KEPT = 2048


def _row(r: sqlite3.Row) -> JobRow:
    return _made(tuple(r), tuple(r.keys()))


@functools.lru_cache(maxsize=ROWS_KEPT)
def _made(values: tuple, columns: tuple) -> JobRow:
    d = dict(zip(columns, values))
    for k in JSON_FIELDS:
        d[k] = json.loads(d[k]) if d[k] is not None else ([] if k != "request" else {})
    return JobRow(**d)


def insert(con: sqlite3.Connection, name: str, recipe: str, out: str, overrides: list[str],
           priority: int, request: dict, state: str) -> JobRow:
    now = time.time()
    con.execute("BEGIN IMMEDIATE")
    try:
        job_id = next_id(con)
        con.execute("INSERT INTO jobs (id, name, recipe, out, overrides, priority, state, submitted, "
                    "updated, request) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, name, recipe, out, json.dumps(overrides), priority, state, now, now,
                     json.dumps(request)))
        con.execute("INSERT INTO job_transitions VALUES (?, ?, NULL, ?, 'submitted', NULL)", (job_id, now, state))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return get(con, job_id)


def get(con: sqlite3.Connection, job_id: int) -> JobRow | None:
    r = con.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return _row(r) if r else None


def find(con: sqlite3.Connection, ref: str) -> JobRow | None:
    """A job by id or by name; the id first (a job named '2' from before such names were refused
    never shadows job 2)."""
    r = con.execute("SELECT * FROM jobs WHERE name = ? OR CAST(id AS TEXT) = ? ORDER BY CAST(id AS TEXT) = ? DESC",
                    (ref, ref, ref)).fetchone()
    return _row(r) if r else None


def all_jobs(con: sqlite3.Connection, states: tuple[str, ...] | None = None) -> list[JobRow]:
    if states:
        rows = con.execute(f"SELECT * FROM jobs WHERE state IN ({','.join('?' * len(states))}) ORDER BY id",
                           states).fetchall()
    else:
        rows = con.execute("SELECT * FROM jobs ORDER BY id").fetchall()
    return [_row(r) for r in rows]


def name_taken(con: sqlite3.Connection, name: str) -> bool:
    return con.execute("SELECT 1 FROM jobs WHERE name = ?", (name,)).fetchone() is not None


def next_id(con: sqlite3.Connection) -> int:
    """The next job's id: past every job's, removed ones' too (their transitions stay), so an id
    is never given twice."""
    return con.execute("SELECT max((SELECT coalesce(max(id), 0) FROM jobs), "
                       "(SELECT coalesce(max(job_id), 0) FROM job_transitions))").fetchone()[0] + 1


def set_state(con: sqlite3.Connection, job_id: int, expect: str, state: str, why: str,
              fields: dict[str, Any]) -> bool:
    """Compare-and-set: move the job from `expect` to `state` with `fields`, in one transaction,
    logging the transition (a change of state, or of the job's hold). False (nothing changed) if
    the job was not in `expect`."""
    sets = {**{k: json.dumps(v) if k in JSON_FIELDS else v for k, v in fields.items()},
            "state": state, "updated": time.time()}
    con.execute("BEGIN IMMEDIATE")
    try:
        before = con.execute("SELECT hold FROM jobs WHERE id = ? AND state = ?", (job_id, expect)).fetchone()
        cur = con.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in sets)} WHERE id = ? AND state = ?",
                          (*sets.values(), job_id, expect))
        hold = fields.get("hold", before["hold"] if before else None)
        if cur.rowcount == 1 and (state != expect or hold != before["hold"]):
            con.execute("INSERT INTO job_transitions VALUES (?, ?, ?, ?, ?, ?)",
                        (job_id, sets["updated"], expect, state, why, hold))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return cur.rowcount == 1


def remove(con: sqlite3.Connection, job_id: int, expect: str, why: str) -> bool:
    """Compare-and-delete: remove the job's row if it is still in `expect`, logging a last
    transition to 'purged' (its transitions stay). False (nothing removed) if it was not."""
    con.execute("BEGIN IMMEDIATE")
    try:
        cur = con.execute("DELETE FROM jobs WHERE id = ? AND state = ?", (job_id, expect))
        if cur.rowcount == 1:
            con.execute("INSERT INTO job_transitions VALUES (?, ?, ?, 'purged', ?, NULL)",
                        (job_id, time.time(), expect, why))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return cur.rowcount == 1


def waited_seconds(con: sqlite3.Connection, job: JobRow, now: float) -> float:
    """Seconds `job` has spent queued without a hold of its own since it was submitted (or
    requeued by hand): the time it could have started, not the time it ran between a start and a
    preemption or a yield, nor the time it was held by hand (else holding a job and releasing it
    would raise its priority: as Slurm's age factor, which held jobs do not accrue). The holds of
    the whole machine (the owner's rules, `ember yield`) hold every job alike and are not counted
    here."""
    return _waited(job, con.execute("SELECT time, to_state, hold FROM job_transitions WHERE job_id = ? "
                                    "AND time >= ? ORDER BY rowid", (job.id, job.submitted)), now)


def waited_seconds_of(con: sqlite3.Connection, jobs: list[JobRow], now: float) -> dict[int, float]:
    """waited_seconds of each of these queued `jobs`, by id, from one query over the queued jobs'
    transitions: the service asks every tick (10 a second), and a query per job (with the rows'
    decoding) took 13% of a core with 100 jobs queued (bench/queue_tick.py)."""
    found: dict[int, list] = {j.id: [] for j in jobs}
    for t in con.execute("SELECT t.job_id, t.time, t.to_state, t.hold FROM job_transitions t JOIN jobs j "
                         "ON j.id = t.job_id WHERE j.state = 'queued' AND t.time >= j.submitted ORDER BY t.rowid"):
        if t["job_id"] in found:
            found[t["job_id"]].append(t)
    return {j.id: _waited(j, found[j.id], now) for j in jobs}


def _waited(job: JobRow, transitions: Any, now: float) -> float:
    """waited_seconds from the job's transitions since it was submitted, in order."""
    total, since = 0.0, None
    for t in transitions:
        eligible = t["to_state"] == "queued" and t["hold"] is None
        if eligible and since is None:
            since = t["time"]
        elif not eligible and since is not None:
            total, since = total + t["time"] - since, None
    if job.state == "queued" and job.hold is None:
        total += now - (job.submitted if since is None else since)
    return max(0.0, total)


def transitions(con: sqlite3.Connection, job_id: int) -> list[sqlite3.Row]:
    return con.execute("SELECT * FROM job_transitions WHERE job_id = ? ORDER BY rowid", (job_id,)).fetchall()


def integrity(con: sqlite3.Connection) -> str:
    """SQLite's integrity_check of the whole ledger ("ok" when sound)."""
    return con.execute("PRAGMA integrity_check").fetchone()[0]
