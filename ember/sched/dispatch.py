"""One pass of the service's scheduler, carried out: the decisions of ember.sched.scheduler
applied to the jobs (ember.sched.job_queue) and their processes (ember.sched.job_processes).
The service calls `tick` every TICK_SECONDS on its scheduler thread, and after each hand's
change, always under its lock:

    reap      exited jobs: completed, queued again (preempted), cancelled or failed, with the
              cause; the others followed (starting -> running, running <-> soft-paused)
    observe   the owner's rules (read again when owner.toml changes) and the machine
    steer     each live job: go on, soft-pause, preempt, or kill one that ignores SIGTERM
    admit     start what fits; preempt lower priorities for higher ones

`recover` runs once when the service starts: live jobs whose process still runs are adopted;
the others are queued again (they resume from their last checkpoint) or settled.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ember.errors import EmberError
from ember.events import Events
from ember.ledger.job_rows import JobRow
from ember.sched import owner_rules as owner
from ember.sched.inference import Gate
from ember.sched.job_processes import JobProcesses
from ember.sched.job_queue import JobQueue
from ember.sched.job_view import completed, failure_cause, last_outcome, last_step_time
from ember.ledger.job_states import LIVE
from ember.paths import default_run_folder, home
from ember.sched.owner_watch import OwnerWatch
from ember.hardware import Device
from ember.sched.scheduler import (PREEMPT_KILL_SECONDS, Act, Move, Scheduler, Steering, capacity, ended, follow,
                                   recovered)
from ember.sched.yield_hold import YieldHold


class Dispatcher:
    """Carries out the scheduler's decisions; callers hold the service's lock."""

    def __init__(self, jobs: JobQueue, scheduler: Scheduler, processes: JobProcesses, watch: OwnerWatch,
                 yielding: YieldHold, gate: Gate, events: Events):
        self.jobs, self.scheduler, self.processes = jobs, scheduler, processes
        self.watch, self.yielding, self.gate, self.events = watch, yielding, gate, events

    def recover(self) -> None:
        """At start: adopt live jobs whose process still runs; queue again those that died."""
        for job in self.jobs.live():
            if self.processes.alive(job):
                self.events.info(f"job {job.name}: process {job.pid} still runs; adopted")
                continue
            self.processes.settle(job)
            self._apply(job, recovered(job, completed(Path(job.out))))

    def tick(self) -> None:
        """One pass of the scheduler (see the module docstring)."""
        now = time.time()
        self.reap()
        self.observe()
        holds = list(self.watch.holds)
        if (hold := self.yielding.hold(now)) is not None:
            holds.append(hold)
        inference_on = self.gate.device if self.gate.busy(now) else None
        for job in self.jobs.live():
            try:
                self._steer(job, self.scheduler.steer(job, holds, now, self.watch.rules.pause.hard_after_minutes,
                                                      inference_on))
            except OSError as e:  # one job's folder trouble never stops the others' scheduling
                self.events.warn(f"job {job.name}: {e}")
        self.admit(holds, now)

    def reap(self) -> None:
        """Jobs whose process ended: completed, queued again (preempted) or failed, with the cause;
        the others' progress followed."""
        for job in self.jobs.live():
            code = self.processes.exit_code(job)
            if code is None:
                self._follow(job)
                continue
            self.processes.reaped(job)
            self.scheduler.forget(job.id)
            out = Path(job.out)
            move = ended(job, code, completed(out), last_outcome(self.jobs.con, out),
                         lambda: failure_cause(self.jobs.con, out, self.processes.log_path(job), code))
            self._apply(job, move)
            if move.dst == "failed":
                self.events.warn(f"job {job.name} failed: {move.why}")

    def _follow(self, job: JobRow) -> None:
        """starting -> running once the job logged a step; running <-> soft-paused by its acks."""
        ack, asked = self.processes.acknowledged(job), self.processes.requested(job)
        self.gate.observe(ack)  # its newest pause, if for inference: a pause-latency sample once
        move = follow(job, last_step_time(Path(job.out)), ack, asked)
        if move is not None:
            self._apply(job, move)

    def _apply(self, job: JobRow, move: Move) -> None:
        """The scheduler's move, through the state machine (lost to a newer change: nothing)."""
        self.jobs.move(job, move.dst, move.why, **move.fields)

    def _steer(self, job: JobRow, s: Steering) -> None:
        """Carry out the scheduler's word on a live job."""
        if s.act == Act.KILL and self.processes.kill(job):
            self.events.warn(f"job {job.name}: no exit {PREEMPT_KILL_SECONDS:.0f} s after SIGTERM; "
                             f"killed (it resumes from its last committed checkpoint)")
        elif s.act == Act.PREEMPT:
            self.preempt(job, s.why, s.hold)
        elif s.act == Act.PAUSE:
            self.processes.ask(job, s.reason, self.watch.rules.inference.pause_lease_seconds
                               if s.reason == "inference" else None)
        elif s.act == Act.GO:
            self.processes.ask(job, None, None)

    def preempt(self, job: JobRow, why: str, hold: str | None) -> None:
        """SIGTERM: the job stops between micro-batches, checkpoints its last step and exits 75."""
        self.processes.terminate(job)
        self.jobs.move(job, "preempting", why, cause=why, **({"hold": hold} if hold else {}))
        self.events.info(f"job {job.name}: preempting ({why})")

    def capacity(self, device: Device) -> int:
        """Bytes jobs may plan to use on `device` now."""
        return capacity(device, self.watch.rules, self.watch.observation)

    def admit(self, holds: list[owner.Hold], now: float) -> None:
        """Start what fits (ember.sched.admission); preempt lower priorities for higher ones."""
        capacities = {d.index: self.capacity(d) for d in self.scheduler.devices}
        queued = self.jobs.queued()
        waited = self.jobs.waited_all(queued, now)  # ageing: time it could have started, not time run
        decision = self.scheduler.admit(queued, self.jobs.live(), holds, capacities, now, waited)
        for victim in decision.preempt:
            job = self.jobs.get(victim)
            if job.state in LIVE and job.state != "preempting":
                self.preempt(job, "preempted by a job of higher priority", hold=None)
        for job_id, devices in decision.start.items():
            self.start(self.jobs.get(job_id), devices)

    def check_folder(self, job: JobRow) -> None:
        """Refused when the job's run folder resolves outside [service] allowed now (the owner
        narrowed the list, or a link was put in its place since it was submitted); a folder in
        $EMBER_HOME/runs (the default, ember's own) must still resolve inside it."""
        if Path(job.out).parent == home().runs.resolve():
            default_run_folder(Path(job.out).name)
        else:
            self.watch.allowed(job.out, "run folder")

    def start(self, job: JobRow, devices: tuple[int, ...]) -> None:
        """Start the job's process on `devices` and mark it starting; a job whose run folder is
        refused now fails with the reason instead (it would write outside the allowed folders)."""
        try:
            self.check_folder(job)
        except EmberError as e:
            self.jobs.move(job, "failed", "its run folder was refused at its start", cause=str(e))
            self.events.warn(f"job {job.name}: not started: {e}")
            return
        on = tuple(d for d in self.scheduler.devices if d.index in devices)
        p = self.processes.start(job, on)
        self.jobs.move(job, "starting", f"admitted on device(s) {list(devices)}", pid=p.pid,
                       pid_start=p.start, devices=list(devices), started=time.time(), cause=None)
        self.events.info(f"job {job.name}: started on device(s) {list(devices)} (PID {p.pid})")

    def observe(self, force: bool = False) -> None:
        """Read the owner's rules (if changed) and the machine, at most every OBSERVE_SECONDS."""
        if self.watch.observe(lambda: {os.getpid()} | {j.pid for j in self.jobs.live() if j.pid}, force):
            self.gate.idle_gap = self.watch.rules.inference.idle_gap_seconds

    def on_inference_device(self) -> list[JobRow]:
        """The jobs with a process on the inference device."""
        return [j for j in self.jobs.jobs(("running", "starting", "soft-paused")) if self.gate.device in j.devices]
