"""The scheduler's decisions, over plain data: no processes, no files, no ledger. The service
(ember.sched.service) reads the jobs, the machine and the owner's rules, asks here what to do,
and does it (ember.sched.job_processes, ember.ledger.job_states.move).

    steer(job, holds, now, ...)      -> Steering    a live job: go on, soft-pause, preempt, kill
    admit(queued, live, holds, ...)  -> Decision    which queued jobs start where, whom to preempt
    follow(job, step_time, ...)      -> Move | None a live job's progress: starting -> running,
                                                    running <-> soft-paused by its acknowledgements
    ended(job, code, ...)            -> Move        an exited job: completed, queued, cancelled, failed

Rules: hard holds preempt (SIGTERM: stop between micro-batches, checkpoint, exit 75); soft holds,
a hand's pause and inference on the job's device ask for a soft pause, which becomes hard after
[pause] hard_after_minutes (never for inference: its pause is a lease); a job that has not exited
PREEMPT_KILL_SECONDS after SIGTERM is killed. Admission is ember.sched.admission's one function,
on the devices no hold blocks, with the room ember.sched.owner_rules allows (`capacity`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ember.errors import EXIT_INTERRUPTED
from ember.ledger.job_rows import JobRow
from ember.sched import admission, owner_rules as owner
from ember.ledger.job_states import LIVE
from ember.hardware import Device

PREEMPT_KILL_SECONDS = 300.0  # a job that has not exited this long after SIGTERM is killed


class Act(StrEnum):
    WAIT = "wait"        # preempting: let it checkpoint and exit
    KILL = "kill"        # preempting for too long: SIGKILL its process tree
    PREEMPT = "preempt"  # SIGTERM: stop between micro-batches (ember.train.between), checkpoint, exit
    PAUSE = "pause"      # ask for a soft pause (ember.control), with `reason`
    GO = "go"            # no pause asked: lift any request


@dataclass(frozen=True)
class Steering:
    """What to do with one live job now."""
    act: Act
    why: str = ""              # PREEMPT: the transition's reason
    hold: str | None = None    # PREEMPT: the hold it keeps once queued ("user": held by hand)
    reason: str | None = None  # PAUSE: "user", "owner" or "inference"


@dataclass(frozen=True)
class Move:
    """A state change for ember.ledger.job_states.move: the target, the reason and the fields set with it."""
    dst: str
    why: str
    fields: dict[str, Any] = field(default_factory=dict)


def accelerated(devices: tuple[Device, ...]) -> bool:
    """Whether the machine has devices other than host RAM (holds for accelerators only apply)."""
    return any(d.kind != "cpu" for d in devices)


def capacity(device: Device, rules: owner.OwnerRules, observation: owner.Observation | None) -> int:
    """Bytes jobs may plan to use on `device` now: a share of host RAM by the owner's rules, or
    an accelerator's memory less what other processes use."""
    if device.kind == "cpu":
        share = owner.ram_share(rules, observation) if observation else rules.memory.max_share_idle
        return int(device.total * share)
    return device.total - device.foreign


class Scheduler:
    """The decisions above, and the two things they remember between ticks: since when each job
    has been asked to soft-pause, and why each queued job waited at the last admission."""

    def __init__(self, devices: tuple[Device, ...]):
        self.devices = devices
        self.soft_since: dict[int, float] = {}   # live job -> when its current soft pause was first asked
        self.waiting: dict[int, str] = {}        # queued job -> why the last admission left it waiting

    def holds_on(self, job: JobRow, holds: list[owner.Hold]) -> list[owner.Hold]:
        """The holds that stop `job` (on its devices; on every device before it is placed)."""
        devices = tuple(job.devices) or tuple(d.index for d in self.devices)
        return [h for h in holds if owner.applies(h, devices, accelerated(self.devices))]

    def steer(self, job: JobRow, holds: list[owner.Hold], now: float, hard_after_minutes: float,
              inference_on: int | None) -> Steering:
        """Hard holds preempt; soft holds, a hand pause and inference ask for a soft pause.
        `inference_on`: the device inference requests hold now (None: inference is idle)."""
        if job.state == "preempting":
            return Steering(Act.KILL if now - job.updated > PREEMPT_KILL_SECONDS else Act.WAIT)
        mine = [h for h in holds if owner.applies(h, tuple(job.devices), accelerated(self.devices))]
        hard = [h for h in mine if h.kind == "hard"]
        if hard:
            return Steering(Act.PREEMPT, f"{hard[0].rule}: {hard[0].detail}")
        soft = [h for h in mine if h.kind == "soft"]
        reason = ("user" if job.pause == "user" else "owner" if soft else
                  "inference" if inference_on is not None and inference_on in job.devices else None)
        if reason is None:
            self.soft_since.pop(job.id, None)
            return Steering(Act.GO)
        since = self.soft_since.setdefault(job.id, now)
        if reason != "inference" and now - since > hard_after_minutes * 60:
            # A hand pause stays held once hard; an owner's rule keeps the job queued while it holds.
            return Steering(Act.PREEMPT, f"soft pause longer than [pause] hard_after_minutes = "
                                         f"{hard_after_minutes:g}", hold="user" if reason == "user" else None)
        return Steering(Act.PAUSE, reason=reason)

    def admit(self, queued: list[JobRow], live: list[JobRow], holds: list[owner.Hold],
              capacities: dict[int, int], now: float, waited: dict[int, float] | None = None) -> admission.Decision:
        """Which of the `queued` jobs start where, and which `live` ones make room
        (ember.sched.admission), on the devices no hold blocks. Only jobs without a hold wait;
        each ages by the seconds it has waited (`waited`, by job: ember.ledger.job_rows.
        waited_seconds), else since it was submitted."""
        waited = waited or {}
        waiting = [j for j in queued if j.state == "queued" and j.hold is None]
        if not waiting:
            self.waiting = {}
            return admission.Decision()
        accel = accelerated(self.devices)
        every = [d.index for d in self.devices]
        blocked = {i for h in holds for i in (h.devices or every) if not (h.accelerators_only and not accel)}
        rooms = [admission.Room(d.index, capacities[d.index]) for d in self.devices if d.index not in blocked]
        running = [admission.Holding(j.id, j.priority, j.started or 0, j.request["memory"], tuple(j.devices))
                   for j in live if j.state in LIVE]
        wants = [admission.Want(j.id, j.priority, now - waited.get(j.id, now - j.submitted), j.request["memory"],
                                j.request.get("count", 1)) for j in waiting]
        decision = admission.decide(wants, running, rooms, now)
        self.waiting = decision.waiting
        return decision

    def forget(self, job_id: int) -> None:
        """The job's process is gone: its soft pause is over."""
        self.soft_since.pop(job_id, None)


def follow(job: JobRow, step_time: float, ack: dict | None, asked: str | None) -> Move | None:
    """starting -> running once the job logged a step after it started (`step_time`: its last
    metrics line's time); running <-> soft-paused once it acknowledged (`ack`) what was asked."""
    if job.state == "starting" and step_time >= (job.started or 0):
        return Move("running", "first step done")
    if job.state not in ("running", "soft-paused") or not ack:
        return None
    if job.state == "running" and asked and ack.get("state") == "paused":
        return Move("soft-paused", f"paused ({asked})")
    if job.state == "soft-paused" and not asked and ack.get("state") == "running":
        return Move("running", "pause lifted")
    return None


def ended(job: JobRow, code: int, completed: bool, last_outcome: str | None,
          failure: Callable[[], str]) -> Move:
    """Where a job goes once its process exited with `code` (-1: an adopted process, whose code
    is not ours to read; `last_outcome`, the ledger's last attempt, says how it ended).
    `failure()` says why it failed, read only when it did."""
    gone = {"pid": None}
    if completed:
        return Move("completed", "finished", {**gone, "cause": None})
    if job.state == "preempting":
        if job.hold == "cancel":
            return Move("cancelled", "cancelled: checkpointed and exited", gone)
        return Move("queued", job.cause or "preempted: checkpointed and exited",
                    {**gone, "preemptions": job.preemptions + 1})
    if code == EXIT_INTERRUPTED or (code == -1 and last_outcome == "interrupted"):
        return Move("queued", "interrupted from outside the service",
                    {**gone, "hold": "interrupted", "cause": "stopped by a signal from outside the service; "
                                                             "`ember resume` queues it again"})
    if code == -1 and last_outcome in (None, "killed"):
        return Move("queued", "died while adopted: resumes from its last checkpoint", gone)
    why = failure()
    return Move("failed", why, {**gone, "cause": why})


def recovered(job: JobRow, completed: bool) -> Move:
    """A live job whose process was found dead when the service started."""
    if job.hold == "cancel":
        return Move("cancelled" if job.state == "preempting" else "queued", "found dead after a service restart",
                    {"pid": None})
    done = completed and job.state != "queued"
    return Move("completed" if done else "queued",
                "found dead after a service restart" + ("" if completed else ": resumes from its last checkpoint"),
                {"pid": None})
