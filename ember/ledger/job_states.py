"""The job state machine, local and remote. This module is the only one allowed to change a job's
state: a test checks that no other module calls ember.ledger.job_rows.set_state or .remove, or
ember.ledger.remote_rows.set_state. Both kinds of job are rows of the ledger, in two tables kept
for the ledgers that hold them: `jobs` (the local service's; their backend is this machine) and
`remote_jobs` (their `backend` column names the engine: slurm, ...). Both move only through `move`.

Local jobs (ember.sched.job_queue calls `move` and `remove`, for the scheduling pass in
ember.sched.dispatch and the hand's verbs in ember.sched.job_control):

    queued ──admitted──> starting ──attempt registered──> running
    running <──soft pause / lifted──> soft-paused
    starting | running | soft-paused ──SIGTERM (preempt, hard pause, cancel)──> preempting
    preempting ──exited──> queued      preempted: checkpointed at a step boundary, exit 75
    preempting ──exited──> cancelled   when the job was being cancelled
    queued ──cancel──> cancelled
    queued ──its run folder refused at its start──> failed   (the folder now resolves outside
                                                           [service] allowed: a link put there, or
                                                           the owner narrowed the list)
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
scheduler never moves them; only a hand's requeue or purge does.

Remote jobs (ember.remote.submit and ember.remote.tracking call `move`), driven by what the
backend says (ember.remote.backends: Slurm's squeue, scontrol and sacct, and the outcome the job
wrote itself):

    staging ──submitted (sbatch)──> pending ──its allocation starts──> running
    running ──requeued (scontrol requeue, an allocation's end with budget left, a preemption)──> requeued
    requeued ──the next allocation starts──> running
    pending | running | requeued ──ended──> completed   max_steps reached
                                          | stopped     its own limits reached: checkpointed and stopped
                                          | failed      an error, a node failure, the backend's time
                                                        limit without a checkpoint, ...
                                          | cancelled   ember remote cancel (scancel)
    staging ──copying, the arrival check or the submission failed──> failed
    stopped | cancelled | failed ──ember remote continue, allowed by the gate again──> staging
                                   (new limits, submitted again in the job's folder; its run
                                   resumes from its newest checkpoint)

completed, stopped, failed and cancelled have ended (REMOTE_FINAL: the backend runs nothing of
the job); only completed is for ever, the others end until `ember remote continue`.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from ember.errors import EmberError
from ember.ledger import job_rows, remote_rows
from ember.ledger.job_rows import JobRow
from ember.ledger.remote_rows import RemoteJobRow


class JobState(StrEnum):
    """Every state a job takes; the values are stored in the ledger, so they never change."""
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SOFT_PAUSED = "soft-paused"
    PREEMPTING = "preempting"
    STAGING = "staging"
    PENDING = "pending"
    REQUEUED = "requeued"
    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = JobState
LOCAL_FINAL = (S.COMPLETED, S.FAILED, S.CANCELLED)  # ended: no process; only a hand requeues or purges them
LIVE = (S.STARTING, S.RUNNING, S.SOFT_PAUSED, S.PREEMPTING)  # a process exists (or should)
REMOTE_FINAL = (S.COMPLETED, S.STOPPED, S.FAILED, S.CANCELLED)
CONTINUABLE = (S.STOPPED, S.CANCELLED, S.FAILED)  # ended until `ember remote continue`


@dataclass(frozen=True)
class Machine:
    """One table's states and the transitions between them (declared in the module docstring)."""
    noun: str                                           # how errors name its jobs
    transitions: dict[JobState, tuple[JobState, ...]]
    final: tuple[JobState, ...]

    @property
    def states(self) -> tuple[JobState, ...]:
        return tuple(self.transitions)

    def allowed(self, src: str, dst: str) -> bool:
        """Whether a job may go from `src` to `dst` (staying is always allowed)."""
        return dst == src or dst in self.transitions[JobState(src)]


LOCAL = Machine("job", {
    S.QUEUED: (S.STARTING, S.CANCELLED, S.FAILED),
    S.STARTING: (S.RUNNING, S.PREEMPTING, S.COMPLETED, S.FAILED, S.QUEUED),
    S.RUNNING: (S.SOFT_PAUSED, S.PREEMPTING, S.COMPLETED, S.FAILED, S.QUEUED),
    S.SOFT_PAUSED: (S.RUNNING, S.PREEMPTING, S.COMPLETED, S.FAILED, S.QUEUED),
    S.PREEMPTING: (S.QUEUED, S.CANCELLED, S.COMPLETED, S.FAILED),
    S.COMPLETED: (), S.FAILED: (S.QUEUED,), S.CANCELLED: (S.QUEUED,),  # queued: requeued by hand
}, LOCAL_FINAL)
REMOTE = Machine("remote job", {
    S.STAGING: (S.PENDING, S.FAILED),
    S.PENDING: (S.RUNNING, S.REQUEUED, *REMOTE_FINAL),  # a poll may miss a short state
    S.RUNNING: (S.REQUEUED, *REMOTE_FINAL),
    S.REQUEUED: (S.RUNNING, *REMOTE_FINAL),
    S.COMPLETED: (), S.STOPPED: (S.STAGING,), S.FAILED: (S.STAGING,), S.CANCELLED: (S.STAGING,),
}, REMOTE_FINAL)

Row = TypeVar("Row", JobRow, RemoteJobRow)


def machine_of(job: JobRow | RemoteJobRow) -> Machine:
    """The state machine of `job`'s table."""
    return REMOTE if isinstance(job, RemoteJobRow) else LOCAL


def move(con: sqlite3.Connection, job: Row, dst: str, why: str, **fields: Any) -> Row | None:
    """Move `job` to `dst` (a transition its machine allows, else EmberError), setting `fields`,
    if it is still in the state it was read in; the new row, or None when another change got
    there first (the caller re-reads and decides again)."""
    machine = machine_of(job)
    if not machine.allowed(job.state, dst):
        raise EmberError(f"{machine.noun} {job.name}: cannot go from {job.state} to {dst}")
    # Each table's set_state is called by name: the one-writer test finds its callers that way.
    if machine is REMOTE:
        moved = remote_rows.set_state(con, job.id, job.state, JobState(dst), why, fields)
        return remote_rows.get(con, job.id) if moved else None
    moved = job_rows.set_state(con, job.id, job.state, JobState(dst), why, fields)
    return job_rows.get(con, job.id) if moved else None


def remove(con: sqlite3.Connection, job: JobRow, why: str) -> bool:
    """Purge a finished local job's row if it is still in the state it was read in; False when
    another change got there first (a requeue)."""
    if job.state not in LOCAL_FINAL:
        raise EmberError(f"job {job.name} is {job.state}: only a finished job (completed, failed, "
                         f"cancelled) is purged")
    return job_rows.remove(con, job.id, job.state, why)
