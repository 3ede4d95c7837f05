"""The job state machine. This module is the only one allowed to change a job's state (a test
checks that no other module calls ember.ledger.job_rows.set_state); the service calls `move`.

    queued ──admitted──> starting ──attempt registered──> running
    running <──soft pause / lifted──> soft-paused
    starting | running | soft-paused ──SIGTERM (preempt, hard pause, cancel)──> preempting
    preempting ──exited──> queued      preempted: checkpointed at a step boundary, exit 75
    preempting ──exited──> cancelled   when the job was being cancelled
    queued ──cancel──> cancelled
    starting | running | soft-paused | preempting ──exit 0──> completed
    starting | running | soft-paused ──gave up──> failed   (the supervisor restarted crashes with
                                                           backoff, then gave up; or a bad recipe)
    starting | running | soft-paused ──found dead──> queued   (the process died while nobody
                                                           watched, e.g. with the service: it
                                                           resumes from its last checkpoint)
    failed | cancelled ──requeue (by hand)──> queued       (the same run: it resumes from its run
                                                           folder's last checkpoint)
    completed | failed | cancelled ──purge (by hand)──> (row removed; its transitions stay, the
                                                           last to 'purged'; the run folder and the
                                                           ledger's runs, attempts, events stay)

A queued job with a `hold` ("user": ember pause --hard; "yield": ember yield) is not admitted
until the hold is lifted. completed, failed and cancelled are final: no process, and the
scheduler never moves them; only a hand's requeue or purge does. The service calls `remove` to
purge (a test checks that no other module calls ember.ledger.job_rows.remove).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from ember.errors import EmberError
from ember.ledger import job_rows as rows
from ember.ledger.job_rows import JobRow

STATES = ("queued", "starting", "running", "soft-paused", "preempting", "completed", "failed", "cancelled")
FINAL = ("completed", "failed", "cancelled")  # ended: no process; only a hand requeues or purges them
LIVE = ("starting", "running", "soft-paused", "preempting")  # a process exists (or should)
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "queued": ("starting", "cancelled"),
    "starting": ("running", "preempting", "completed", "failed", "queued"),
    "running": ("soft-paused", "preempting", "completed", "failed", "queued"),
    "soft-paused": ("running", "preempting", "completed", "failed", "queued"),
    "preempting": ("queued", "cancelled", "completed", "failed"),
    "completed": (), "failed": ("queued",), "cancelled": ("queued",),  # queued: requeued by hand
}


def allowed(src: str, dst: str) -> bool:
    return dst == src or dst in TRANSITIONS[src]


def move(con: sqlite3.Connection, job: JobRow, dst: str, why: str, **fields: Any) -> JobRow | None:
    """Move `job` to `dst` if it is still in the state it was read in; the new row, or None when
    another change got there first (the caller re-reads and decides again)."""
    if not allowed(job.state, dst):
        raise EmberError(f"job {job.name}: cannot go from {job.state} to {dst}")
    if not rows.set_state(con, job.id, job.state, dst, why, fields):
        return None
    return rows.get(con, job.id)


def remove(con: sqlite3.Connection, job: JobRow, why: str) -> bool:
    """Purge a finished job's row if it is still in the state it was read in; False when another
    change got there first (a requeue)."""
    if job.state not in FINAL:
        raise EmberError(f"job {job.name} is {job.state}: only a finished job (completed, failed, "
                         f"cancelled) is purged")
    return rows.remove(con, job.id, job.state, why)
