"""The remote job state machine, and bringing a job's results back. This module is the only one
allowed to change a remote job's state (ember.ledger.remote_rows.set_state); it is driven by what
Slurm says (ember.remote.slurm) and by the outcome the job wrote itself (ember.remote.allocation).

    staging ──sbatch──> pending ──its allocation starts──> running
    running ──requeued (scontrol requeue, an allocation's end with budget left, a preemption)──> requeued
    requeued ──the next allocation starts──> running
    pending | running | requeued ──ended──> completed   max_steps reached
                                          | stopped     its own limits reached: checkpointed and stopped
                                          | failed      an error, a node failure, Slurm's time limit
                                                        without a checkpoint, ...
                                          | cancelled   ember remote cancel (scancel)
    staging ──copying, the arrival check or sbatch failed──> failed
    stopped | cancelled | failed ──ember remote continue, allowed by the gate again──> staging
                                   (ember.remote.submit: new limits, a new sbatch in the job's folder;
                                   its run resumes from its newest checkpoint)

completed, stopped, failed and cancelled have ended (FINAL: Slurm runs nothing of the job); only
completed is for ever, the others end until `ember remote continue`. Every status poll that finds
the job has run brings its run folder (less checkpoints: the newest one once it ended) and its
ledger rows back, so `ember report` and `ember compare` read a remote run like a local one.
"""

from __future__ import annotations

import json
import re
import shlex
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.runfolder import is_run_folder, read_record
from ember.events import Events
from ember.ledger import remote_rows as rows
from ember.ledger import database as ledger_store
from ember.ledger.remote_rows import RemoteJobRow
from ember.metrics.report import build_report
from ember.remote import slurm
from ember.remote.script import OUTCOME_FILE, run_folder
from ember.remote.shell import Shell
from ember.remote.slurm import SlurmJob

STATES = ("staging", "pending", "running", "requeued", "completed", "stopped", "failed", "cancelled")
FINAL = ("completed", "stopped", "failed", "cancelled")
CONTINUABLE = ("stopped", "cancelled", "failed")
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "staging": ("pending", "failed"),
    "pending": ("running", "requeued", *FINAL),   # a poll may miss a short state
    "running": ("requeued", *FINAL),
    "requeued": ("running", *FINAL),
    "completed": (), "stopped": ("staging",), "failed": ("staging",), "cancelled": ("staging",),
}
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD")
BACKUP = "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(d := sqlite3.connect(sys.argv[2])); d.close()"
POLL = 2.0


def allowed(src: str, dst: str) -> bool:
    return dst == src or dst in TRANSITIONS[src]


def move(con: sqlite3.Connection, job: RemoteJobRow, dst: str, why: str, **fields: Any) -> RemoteJobRow:
    """Move `job` to `dst` (a transition the machine above allows), setting `fields`."""
    if not allowed(job.state, dst):
        raise EmberError(f"remote job {job.name}: cannot go from {job.state} to {dst}")
    if not rows.set_state(con, job.id, job.state, dst, why, fields):
        raise EmberError(f"remote job {job.name}: changed by another ember meanwhile; ask again")
    return rows.get(con, job.id)


def state_from(seen: SlurmJob | None, outcome: dict | None, current: str) -> tuple[str, str]:
    """The state Slurm's view and the job's own outcome put the job in, and why (pure)."""
    if seen is None:
        return current, "Slurm does not know the job (yet)"
    said = f"Slurm: {seen.state}" + (f" ({seen.reason})" if seen.reason and seen.reason != "None" else "")
    if seen.state in QUEUED:
        again = seen.restarts > 0 or current in ("running", "requeued")
        return ("requeued" if again else "pending"), said + (f", requeued {seen.restarts}x" if seen.restarts else "")
    if seen.active:
        return "running", said
    told = (outcome or {}).get("outcome")
    detail = (outcome or {}).get("detail", "")
    if seen.state == "CANCELLED":
        return "cancelled", said
    if seen.state == "COMPLETED":
        if told == "completed":
            return "completed", detail or said
        if told == "limit":
            return "stopped", detail or said
        return "failed", detail or f"{said}, but the job did not say how it ended"
    return "failed", f"{said}, exit {seen.exit_code}" + (f"; {detail}" if detail else "")


@dataclass
class JobStatus:
    job: RemoteJobRow
    slurm: SlurmJob | None
    steps: int                 # optimizer steps brought back so far
    max_steps: int | None
    transitions: list[tuple[float, str | None, str, str]]


def find_job(con: sqlite3.Connection, ref: str, target: str | None) -> RemoteJobRow:
    found = rows.find(con, ref, target)
    if not found:
        raise EmberError(f"{ref}: no remote job with this Slurm job id or name in the ledger"
                         + (f" for target '{target}'" if target else "") + "; `ember remote status` lists them")
    if len(found) > 1:
        raise EmberError(f"{ref}: several remote jobs ({', '.join(j.target for j in found)}); add --target")
    return found[0]


def refresh(con: sqlite3.Connection, job: RemoteJobRow, events: Events, fetch: bool = True) -> JobStatus:
    """Ask Slurm, bring back what the job wrote (always with `fetch`, else when its state
    changed), and move the job to the state that follows."""
    if job.state in FINAL or job.slurm_id is None:
        return status(con, job, None)
    shell = Shell(job.host, job.ssh_options)
    seen = slurm.observe(shell, job.slurm_id)
    outcome = None
    if seen is not None and not seen.active:
        text = shell.read(f"{job.remote_dir}/{OUTCOME_FILE}")
        outcome = json.loads(text) if text.strip() else None
    state, why = state_from(seen, outcome, job.state)
    fields: dict[str, Any] = {"detail": why}
    if state != "pending" and (fetch or state != job.state):
        fields.update(bring_back(con, shell, job, final=state in FINAL, events=events))
    if allowed(job.state, state):
        job = move(con, job, state, why, **fields)
    else:
        events.warn(f"remote job {job.name}: Slurm says {state} after {job.state}; kept {job.state}")
    return status(con, job, seen)


def status(con: sqlite3.Connection, job: RemoteJobRow, seen: SlurmJob | None) -> JobStatus:
    out = Path(job.out)
    steps = 0
    if (out / "metrics.jsonl").is_file():
        steps = sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip())
    max_steps = None
    if is_run_folder(out):
        max_steps = read_record(out)["recipe"]["train"]["max_steps"]
    return JobStatus(job, seen, steps, max_steps, rows.transitions(con, job.id))


def bring_back(con: sqlite3.Connection, shell: Shell, job: RemoteJobRow, final: bool,
               events: Events) -> dict[str, Any]:
    """Copy the job's run folder (the newest checkpoint only once it ended) and its ledger rows
    here; the run id and the cost so far, for the job's row."""
    remote_run = run_folder(job.remote_dir, job.name)
    if not shell.read(f"{remote_run}/run.json").strip():
        return {}  # the run has not written its record yet
    out = Path(job.out)
    shell.get(remote_run, out, exclude=("./checkpoints", "./.lock"))
    if final:
        names = shell.text(["sh", "-c", f"ls {shlex.quote(remote_run + '/checkpoints')} 2>/dev/null || true"]).split()
        steps = sorted((int(m.group(1)), n) for n in names if (m := re.fullmatch(r"step-(\d+)", n)))
        if steps:
            newest = steps[-1][1]
            shell.get(f"{remote_run}/checkpoints/{newest}", out / "checkpoints" / newest)
    run_id = read_record(out)["id"]
    snapshot = f"{job.remote_dir}/.sync"
    shell.run(["sh", "-c", f"mkdir -p {shlex.quote(snapshot)} && rm -f {shlex.quote(snapshot + '/ledger.db')}"])
    shell.run([job.python, "-c", BACKUP, f"{job.remote_dir}/ledger.db", f"{snapshot}/ledger.db"])
    with tempfile.TemporaryDirectory(prefix="ember-sync-") as tmp:
        shell.get(snapshot, Path(tmp))
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
        if st.job.state in FINAL or time.monotonic() >= deadline:
            return st
        job = st.job
        time.sleep(POLL)


def cancel(con: sqlite3.Connection, job: RemoteJobRow, timeout: float, events: Events) -> JobStatus:
    """scancel the job (its run checkpoints on Slurm's TERM, within KillWait), wait until Slurm
    has ended it, bring back its results."""
    if job.state in FINAL:
        raise EmberError(f"remote job {job.name} is already {job.state}")
    if job.slurm_id is None:
        raise EmberError(f"remote job {job.name} was never submitted to Slurm")
    shell = Shell(job.host, job.ssh_options)
    slurm.scancel(shell, job.slurm_id)
    events.info(f"scancel {job.slurm_id}: the run checkpoints and stops")
    return wait(con, job, timeout, events)


def logs(job: RemoteJobRow, offset: int) -> bytes:
    """The job's output (every allocation's, appended) from byte `offset`."""
    if job.slurm_id is None:
        return b""
    return Shell(job.host, job.ssh_options).read(f"{job.remote_dir}/slurm-{job.slurm_id}.out", offset)


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
        if job.state not in FINAL:
            job = refresh(con, job, Events(), fetch=False).job
    finally:
        con.close()
    return logs(job, offset), job.state in FINAL


def cancel_job(ledger: Path | None, ref: str, target: str | None, timeout: float, events: Events) -> JobStatus:
    """`ember remote cancel`."""
    con = ledger_store.connect(ledger)
    try:
        return cancel(con, find_job(con, ref, target), timeout, events)
    finally:
        con.close()
