"""The service's library: what `ember serve`'s API (ember.web.api) and commands call.

One `Service` per machine ($EMBER_HOME/serve/serve.lock), composed of parts each tested alone:

    JobQueue      (job_queue.py)      the jobs in the ledger; every state change via ember.ledger.job_states.move
    Scheduler     (scheduler.py)      the decisions: steer a live job, admit, follow, settle an exit
    Dispatcher    (dispatch.py)       one scheduling pass: the decisions carried out
    JobProcesses  (job_processes.py)  the jobs' `ember run` processes, logs and control folders
    OwnerWatch    (owner_watch.py)    owner.toml in force, the machine observed, the holds now
    YieldHold     (yield_hold.py)     `ember yield`, kept across restarts
    Gate          (inference.py)      inference in flight, and its pause latency
    JobControl    (job_control.py)    the hand's verbs: submit, pause, resume, cancel, requeue, purge

Its state lives in the ledger (jobs, transitions), so a service killed at any moment finds every
job again at its next start (`recover`): a job whose process still runs is adopted; one whose
process died is queued again and resumes from its last checkpoint. A job's run folder is locked
by its own process (ember.lock), so no job ever runs twice at once, even across a service restart.

`tick()` runs every TICK_SECONDS on the scheduler thread (`run`), and after each hand's change:
reap exited jobs, read the machine and the owner's rules, ask jobs to soft-pause or go on,
preempt (hard holds, priorities), admit (ember.sched.dispatch carries out ember.sched.scheduler's
decisions). Every verb holds one lock, so the API's threads and the scheduler's never interleave.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from pathlib import Path

from ember.errors import Conflict, Unavailable
from ember.events import Events
from ember.ledger.database import default_path
from ember.ledger.job_rows import JobRow
from ember.paths import home
from ember.sched import owner_rules as owner
from ember.sched.inference import Gate, adapter_elsewhere
from ember.sched.job_control import JobControl
from ember.sched.job_processes import JobProcesses
from ember.sched.job_queue import JobQueue
from ember.sched.dispatch import Dispatcher
from ember.sched.job_view import Inference, JobView, last_step, run_goodput, why_waiting
from ember.ledger.job_states import LOCAL_FINAL as FINAL
from ember.sched.owner_watch import OwnerWatch
from ember.hardware import Machine, detect
from ember.sched.scheduler import Scheduler
from ember.sched.yield_hold import YieldHold

TICK_SECONDS = 0.1

__all__ = ["JobView", "Service"]


class Service:
    """The queue, the scheduler and the job processes of one machine, behind one lock; the hand's
    verbs are `control`'s."""

    def __init__(self, rules: owner.OwnerRules, devices: str | None, events: Events,
                 ledger: Path | None = None):
        self.events = events
        self.home = home()
        self.dir = self.home.serve
        self.ledger_path = ledger or default_path()
        self.jobs = JobQueue(self.ledger_path)
        self.con = self.jobs.con
        self.lock = threading.RLock()
        self.machine: Machine = detect(devices)
        self.scheduler = Scheduler(self.machine.devices)
        self.processes = JobProcesses(self.home, self.ledger_path)
        self.watch = OwnerWatch(rules, events)
        self.yielding = YieldHold(self.dir, events)
        self.gate = Gate(rules.inference.device, rules.inference.idle_gap_seconds)
        self.dispatch = Dispatcher(self.jobs, self.scheduler, self.processes, self.watch, self.yielding,
                                   self.gate, events)
        self.control = JobControl(self.jobs, self.processes, self.dispatch, self.watch, self.lock, events)
        self.stopping = threading.Event()

    @property
    def rules(self) -> owner.OwnerRules:
        """The owner's rules in force (read again when owner.toml changes)."""
        return self.watch.rules

    @property
    def rules_status(self) -> owner.RulesStatus:
        """What the service made of owner.toml: its error, or changes waiting for a restart."""
        return self.watch.status

    @property
    def yield_until(self) -> float | None:
        """When the owner's `ember yield` ends (math.inf: when released); None: no yield."""
        return self.yielding.until

    def ctl(self, job: JobRow) -> Path:
        """The job's soft-pause control folder (ember.sched.job_processes)."""
        return self.processes.ctl(job)

    def log_path(self, job: JobRow) -> Path:
        """Where the job's output goes (`ember logs`)."""
        return self.processes.log_path(job)

    def yield_devices(self, seconds: float | None, timeout: float = 600.0) -> dict:
        """Hold all training for `seconds` (None: until released) and return once every job's
        process is gone from the devices (checkpointed and exited), with how long that took. The
        jobs are told at once (SIGTERM, in this call's scheduling pass): each stops between two
        micro-batches (ember.train.between), saves its last completed step and exits."""
        t0 = time.time()
        with self.lock:
            self.yielding.set(math.inf if seconds is None else t0 + seconds)
            self.tick()
        while time.time() - t0 < timeout:
            with self.lock:
                self.dispatch.reap()  # an exited job is off the devices now, not at the next tick
                live = self.jobs.live()
                if not live:
                    return {"freed_after_seconds": time.time() - t0, "until": self.yield_until}
                until = self.yielding.until
                if until is None or time.time() >= until:  # ended (or released) before they left: they train on
                    raise Conflict(f"the yield ended ({'released' if until is None else 'its time was up'}) "
                                   f"{time.time() - t0:.1f} s after it began, before every job had left the devices "
                                   f"({', '.join(j.name for j in live)} still on them, and training again): "
                                   f"ask for a yield long enough for a job to checkpoint and exit")
            time.sleep(0.01)
        raise Unavailable(f"jobs still on the devices after {timeout:.0f} s: {', '.join(j.name for j in live)}; "
                          f"the yield holds: ask again to wait more")

    def release_yield(self) -> None:
        """End the owner's `ember yield`: jobs may start again at once."""
        with self.lock:
            self.yielding.set(None)
            self.tick()

    def logs(self, ref: str, offset: int) -> tuple[bytes, int]:
        """Up to 1 MiB of the job's output from `offset`, and the offset after it."""
        return self.processes.logs(self.jobs.find(ref), offset)

    def queue(self) -> list[JobView]:
        """Every job the queue keeps, as `ember queue` shows it."""
        with self.lock:
            return [self.view(j) for j in self.jobs.jobs()]

    def view(self, j: JobRow) -> JobView:
        """The job as `ember queue` shows it, with why it does not train now."""
        by = [f"{h.rule}: {h.detail}" for h in self.holds_on(j)]
        requested = self.processes.requested(j) if j.state == "soft-paused" else None
        gap = self.gate.gap()
        inference = Inference(self.gate.device, gap.seconds, gap.rule)
        waiting = why_waiting(j, by, requested, inference, self.scheduler.waiting.get(j.id))
        return JobView(j.id, j.name, j.state, j.priority, j.devices, last_step(Path(j.out)),
                       j.request.get("max_steps", 0), j.hold, j.pause, j.preemptions, j.cause, j.out,
                       run_goodput(self.con, j.out), by, waiting, str(self.log_path(j)), self.jobs.run_of(j))

    def holds_on(self, job: JobRow) -> list[owner.Hold]:
        """The owner's rules and yield that hold `job` now."""
        shown = self.yielding.shown()
        return self.scheduler.holds_on(job, self.watch.holds + ([shown] if shown else []))

    def explain(self) -> list[dict]:
        """Which rule holds each unfinished job right now."""
        with self.lock:
            self.observe(force=True)
            return [{"job": v.name, "state": v.state, "held_by": v.held_by, "hold": v.hold, "pause": v.pause,
                     "waiting": v.waiting} for v in map(self.view, self.jobs.jobs()) if v.state not in FINAL]

    def tick(self) -> None:
        """One pass of the scheduler (ember.sched.dispatch). Callers hold self.lock."""
        self.dispatch.tick()

    def observe(self, force: bool = False) -> None:
        """Read the owner's rules (if changed) and the machine, at most every OBSERVE_SECONDS."""
        self.dispatch.observe(force)

    def recover(self) -> None:
        """At start: adopt live jobs whose process still runs; queue again those that died."""
        with self.lock:
            self.dispatch.recover()

    def owner_status(self) -> dict:
        """owner.toml as the service applies it: the error or the changes waiting for a restart,
        said in words (notes), and the rules in force."""
        with self.lock:
            return self.watch.report()

    # ---- inference ----------------------------------------------------------------------------

    def inference_begin(self) -> None:
        """A request arrives for the inference device: jobs there soft-pause now, not at the next tick."""
        with self.lock:
            on_device = self.dispatch.on_inference_device()
            self.gate.begin()
            for job in on_device:
                if self.processes.requested(job) is None:
                    self.processes.ask(job, "inference", self.rules.inference.pause_lease_seconds)

    def inference_end(self) -> None:
        """A request's last byte was sent."""
        self.gate.end()

    def inference_roots(self) -> list[Path]:
        """The run folders whose adapters inference serves: [inference] runs and the jobs' own."""
        return [Path(r) for r in self.rules.inference.runs] + [self.home.runs]

    def adapter_elsewhere(self, model: object) -> str | None:
        """Why a /v1 request for `model` cannot go to the upstream engine (ember.sched.inference)."""
        return adapter_elsewhere(self.rules.inference.upstream, self.inference_roots(), model)

    # ---- the scheduler thread -----------------------------------------------------------------

    def run(self) -> None:
        """The scheduler thread's loop."""
        while not self.stopping.is_set():
            try:
                with self.lock:
                    self.tick()
            except (sqlite3.OperationalError, OSError) as e:  # a busy ledger, a full disk: retry
                self.events.warn(f"scheduler: {e}; retrying")
            self.stopping.wait(TICK_SECONDS)

    def shutdown(self, timeout: float) -> None:
        """Stop scheduling; preempt every job (checkpoint, exit 75) and wait for them, bounded."""
        self.stopping.set()
        with self.lock:
            for job in self.jobs.live():
                if job.state != "preempting":
                    self.dispatch.preempt(job, "the service is stopping", hold=None)
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                live = [j for j in self.jobs.live() if self.processes.alive(j)]
            if not live:
                break
            time.sleep(0.05)
        with self.lock:
            self.dispatch.reap()
