"""Following a remote job after its submission: its state refreshed from what its backend says
(ember.remote.backends), waited for, cancelled, its output read, and its results brought back. The
state changes go through ember.ledger.job_states (its module docstring declares the remote
machine); nothing here speaks an engine's own commands.

Every status poll that finds the job has run brings its run folder (less checkpoints: the newest
one once it ended) and its ledger rows back, so `ember report` and `ember compare` read a remote
run like a local one.
"""

from __future__ import annotations

import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import Conflict, EmberError
from ember.events import Events
from ember.ledger import database as ledger_store
from ember.ledger import job_states
from ember.ledger import remote_rows as rows
from ember.ledger.job_states import REMOTE, REMOTE_FINAL, JobState
from ember.ledger.remote_rows import RemoteJobRow
from ember.metrics.report import build_report
from ember.remote.backend import RemoteBackend
from ember.remote.backends import backend_for
from ember.runfolder import is_run_folder, read_record

POLL = 2.0


def move(con: sqlite3.Connection, job: RemoteJobRow, dst: str, why: str, **fields: Any) -> RemoteJobRow:
    """Move `job` to `dst` through the state machine; Conflict when another ember changed it first."""
    moved = job_states.move(con, job, dst, why, **fields)
    if moved is None:
        raise Conflict(f"remote job {job.name}: changed by another ember meanwhile; ask again")
    return moved


def backend_of(job: RemoteJobRow) -> RemoteBackend:
    """The backend the job was submitted to, reached as it was then."""
    return backend_for(job.backend, job.host, job.ssh_options)


@dataclass
class JobStatus:
    job: RemoteJobRow
    seen: Any                  # the backend's own record of the job as last observed (None: not asked)
    steps: int                 # optimizer steps brought back so far
    max_steps: int | None
    transitions: list[tuple[float, str | None, str, str]]


def find_job(con: sqlite3.Connection, ref: str, target: str | None) -> RemoteJobRow:
    found = rows.find(con, ref, target)
    if not found:
        raise EmberError(f"{ref}: no remote job with this job id (its backend's, e.g. Slurm's) or name in the ledger"
                         + (f" for target '{target}'" if target else "") + "; `ember remote status` lists them")
    if len(found) > 1:
        raise EmberError(f"{ref}: several remote jobs ({', '.join(j.target for j in found)}); add --target")
    return found[0]


def refresh(con: sqlite3.Connection, job: RemoteJobRow, events: Events, fetch: bool = True) -> JobStatus:
    """Ask the job's backend, bring back what the job wrote (always with `fetch`, else when its
    state changed), and move the job to the state that follows."""
    if job.state in REMOTE_FINAL or job.backend_id is None:
        return status(con, job, None)
    backend = backend_of(job)
    seen = backend.status(job)
    fields: dict[str, Any] = {"detail": seen.why}
    if seen.state != JobState.PENDING and (fetch or seen.state != job.state):
        fields.update(bring_back(con, backend, job, final=seen.state in REMOTE_FINAL, events=events))
    if REMOTE.allowed(job.state, seen.state):
        job = move(con, job, seen.state, seen.why, **fields)
    else:
        events.warn(f"remote job {job.name}: {backend.title} says {seen.state} after {job.state}; kept {job.state}")
    return status(con, job, seen.seen)


def status(con: sqlite3.Connection, job: RemoteJobRow, seen: Any) -> JobStatus:
    out = Path(job.out)
    steps = 0
    if (out / "metrics.jsonl").is_file():
        steps = sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip())
    max_steps = None
    if is_run_folder(out):
        max_steps = read_record(out)["recipe"]["train"]["max_steps"]
    return JobStatus(job, seen, steps, max_steps, rows.transitions(con, job.id))


def bring_back(con: sqlite3.Connection, backend: RemoteBackend, job: RemoteJobRow, final: bool,
               events: Events) -> dict[str, Any]:
    """Copy the job's run folder (the newest checkpoint only once it ended) and its ledger rows
    here; the run id and the cost so far, for the job's row."""
    out = Path(job.out)
    with tempfile.TemporaryDirectory(prefix="ember-sync-") as tmp:
        if not backend.fetch(job, out, Path(tmp) / "ledger.db", final):
            return {}  # the run has not written its record yet
        run_id = read_record(out)["id"]
        src = sqlite3.connect(Path(tmp) / "ledger.db")
        src.row_factory = sqlite3.Row
        try:
            rows.import_run(con, src, run_id, out)
        finally:
            src.close()
    report = build_report(out, con)
    cost = report.cost.total if report.cost else None
    events.info(f"brought back {report.run.steps} steps of {job.name} into {out}")
    return {"run_id": run_id, "cost": cost}


def wait(con: sqlite3.Connection, job: RemoteJobRow, timeout: float, events: Events) -> JobStatus:
    """Refresh until the job reaches a final state, or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        st = refresh(con, job, events, fetch=False)
        if st.job.state in REMOTE_FINAL or time.monotonic() >= deadline:
            return st
        job = st.job
        time.sleep(POLL)


def cancel(con: sqlite3.Connection, job: RemoteJobRow, timeout: float, events: Events) -> JobStatus:
    """Ask the job's backend to end it (its run checkpoints first), wait until it has, bring back
    its results."""
    if job.state in REMOTE_FINAL:
        raise EmberError(f"remote job {job.name} is already {job.state}")
    backend = backend_of(job)
    if job.backend_id is None:
        raise EmberError(f"remote job {job.name} was never submitted to {backend.title}")
    backend.cancel(job, events)
    return wait(con, job, timeout, events)


def logs(job: RemoteJobRow, offset: int) -> bytes:
    """The job's output (every allocation's, appended) from byte `offset`."""
    return backend_of(job).logs(job, offset) if job.backend_id is not None else b""


def job_status(ledger: Path | None, ref: str | None, target: str | None, until_done: bool, timeout: float,
               events: Events) -> list[JobStatus]:
    """`ember remote status`: one job refreshed (or waited for), or every job, the unfinished refreshed."""
    con = ledger_store.connect(ledger)
    try:
        if ref is not None:
            job = find_job(con, ref, target)
            return [wait(con, job, timeout, events) if until_done else refresh(con, job, events)]
        return [refresh(con, j, events, fetch=False) for j in rows.all_jobs(con)
                if target is None or j.target == target]
    finally:
        con.close()


def job_logs(ledger: Path | None, ref: str, target: str | None, offset: int) -> tuple[bytes, bool]:
    """The job's output from `offset`, and whether the job has ended (as of the ledger)."""
    con = ledger_store.connect(ledger)
    try:
        job = find_job(con, ref, target)
        if job.state not in REMOTE_FINAL:
            job = refresh(con, job, Events(), fetch=False).job
    finally:
        con.close()
    return logs(job, offset), job.state in REMOTE_FINAL


def cancel_job(ledger: Path | None, ref: str, target: str | None, timeout: float, events: Events) -> JobStatus:
    """`ember remote cancel`."""
    con = ledger_store.connect(ledger)
    try:
        return cancel(con, find_job(con, ref, target), timeout, events)
    finally:
        con.close()
