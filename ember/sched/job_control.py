"""The hand's verbs on the service's queue, what `ember submit`, `pause`, `resume`, `cancel`,
`requeue` and `queue purge` reach through the API (ember.web.api calls `service.control`):

    submit   plan the recipe (in a child), refuse what can never fit, queue the rest
    pause    soft: the job stops after its micro-batch in progress and keeps its process; hard (or a
             queued job): it checkpoints, exits and stays queued, held, until resumed
    resume   lift a hand's pause or hold (or an interruption's)
    cancel   at once when queued; a live job checkpoints and exits first
    requeue  a failed or cancelled job queued again, to resume its run folder's last checkpoint
    purge    finished jobs' rows, logs and control folders removed (never their run folders)

Each is a transition of the queue (ember.sched.job_queue, through the state machine), for a live
job its preemption (SIGTERM: ember.sched.dispatch.Dispatcher.preempt), and a scheduling pass
(`Dispatcher.tick`) so the change takes effect now, not at the next tick. A verb holds the lock
the service's scheduler thread ticks under, so the two never interleave. A soft pause and a
resume are answered once the job's process acted on them (`settled`).

Refused, changing nothing (the class says the meaning; the CLI and the API map it): any verb on
a job that does not exist (NotFound); pause, resume and cancel of a finished job, and a pause of
one being cancelled (Conflict); a
requeue of anything but a failed or cancelled job, or one that cannot resume (JobQueue.requeue);
a purge naming an unfinished job (Conflict) or asking for an unfinished state or a negative age
(BadInput); at submit a bad name, priority or missing recipe (BadInput), a path outside the
owner's allowed folders (Refused), a name or run folder taken (Conflict), a plan no device here
can ever hold (EmberError). A resume of a job nobody paused or held changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ember.errors import BadInput, Conflict, EmberError
from ember.events import Events
from ember.ledger.job_rows import JobRow
from ember.ledger.job_states import LIVE, LOCAL_FINAL as FINAL
from ember.paths import check_job_name, default_run_folder
from ember.runfolder import unusable
from ember.sched.dispatch import Dispatcher
from ember.sched.job_processes import JobProcesses
from ember.sched.job_queue import JobQueue
from ember.sched.owner_watch import OwnerWatch

YIELD_BOUND_SECONDS = 2.0     # a planned micro-batch longer than this is reported at submit: pauses wait one
SETTLE_SECONDS = 30.0   # a soft pause or resume is answered once the job's process took it, or after this


class JobControl:
    """The verbs above, on the queue, the job processes and the dispatcher of one service."""

    def __init__(self, jobs: JobQueue, processes: JobProcesses, dispatch: Dispatcher, watch: OwnerWatch,
                 lock: threading.RLock, events: Events):
        self.jobs, self.processes, self.dispatch, self.watch = jobs, processes, dispatch, watch
        self.lock = lock        # the service's: its scheduler thread ticks under it
        self.events = events

    def submit(self, recipe: str, name: str | None, priority: int, out: str | None,
               overrides: list[str]) -> JobRow:
        """Plan the recipe (in a child: no torch here), refuse what can never fit, queue the rest."""
        if name is not None:
            check_job_name(name)
        recipe_path = self.watch.allowed(recipe, "recipe")
        chosen = self.watch.allowed(out, "run folder") if out else None  # refused before the plan, too
        if chosen is not None and (problem := unusable(chosen)) is not None:
            raise BadInput(f"run folder {chosen}: {problem}; choose a new folder")
        if not recipe_path.is_file():
            raise BadInput(f"recipe {recipe_path}: no such file")
        if not -1000 <= priority <= 1000:
            raise BadInput(f"priority {priority}: must be between -1000 and 1000")
        request = self.jobs.request(recipe_path, overrides)
        room = max(self.dispatch.capacity(d) for d in self.dispatch.scheduler.devices)
        if request["memory"] > room:
            raise EmberError(f"{recipe_path}: can never fit here: its plan needs "
                             f"{request['memory'] / 2**30:.2f} GiB per device (with margin) and the "
                             f"largest device offers {room / 2**30:.2f} GiB; `ember plan` says: "
                             f"{request['verdict']} ({'; '.join(request['reasons'])})")
        with self.lock:
            name = self.jobs.name_for(name, recipe_path)
            folder = chosen or default_run_folder(name)
            job = self.jobs.add(name, recipe_path, folder, overrides, priority, request)
        self.events.info(f"job {job.id} {job.name}: queued (priority {priority}, "
                         f"{request['memory'] / 2**20:.0f} MiB per device)")
        step = request.get("step_seconds")
        micro = step / request.get("recipe", {}).get("train", {}).get("grad_accum", 1) if step else None
        if micro and micro > YIELD_BOUND_SECONDS:
            self.events.warn(f"job {job.name}: its plan predicts {micro:.1f} s per micro-batch; training "
                             f"steps aside for inference and the owner between micro-batches, so a pause can "
                             f"take that long: a smaller train.micro_batch (and more train.grad_accum) shortens it")
        return job

    def find(self, ref: str) -> JobRow:
        """The job named or numbered `ref` (NotFound otherwise)."""
        return self.jobs.find(ref)

    def pause(self, ref: str, hard: bool) -> JobRow:
        """Soft: stop after the micro-batch in progress, keep the process. Hard: checkpoint and exit,
        and stay queued until resumed."""
        with self.lock:
            job = self.find(ref)
            if job.state in FINAL:
                raise Conflict(f"job {job.name} is {job.state}: nothing to pause")
            if job.hold == "cancel":  # a pause would replace the cancel with a hold
                raise Conflict(f"job {job.name} is being cancelled (it checkpoints and exits): nothing to pause")
            if job.state == "queued" or hard:
                if job.state in LIVE:
                    self.dispatch.preempt(job, "paused by hand (hard)", hold="user")
                else:
                    job = self.jobs.move(job, "queued", "held by hand", hold="user") or job
            else:
                self.jobs.move(job, job.state, "soft pause by hand", pause="user")
            self.dispatch.tick()
        # A hard pause is answered at once (preempting: it checkpoints at its next step, then exits).
        return self.settled(ref, lambda j: j.state not in ("starting", "running") or j.pause != "user")

    def resume(self, ref: str) -> JobRow:
        """Lift a hand's pause or hold (or an interruption's); answered once it trains again or
        something else keeps it paused."""
        with self.lock:
            job = self.find(ref)
            if job.state in FINAL:
                again = f"; `ember requeue {job.name}` queues it again" if job.state != "completed" else ""
                raise Conflict(f"job {job.name} is {job.state}: nothing to resume{again}")
            if job.hold in ("user", "interrupted") or job.pause == "user":
                self.jobs.move(job, job.state, "resumed by hand", hold=None if job.hold != "cancel" else "cancel",
                               pause=None)
            self.dispatch.tick()
        # Settled when it trains again, or when something else (the owner's rules, inference) keeps it paused.
        return self.settled(ref, lambda j: j.state != "soft-paused" or self.processes.requested(j) is not None)

    def cancel(self, ref: str) -> JobRow:
        """Cancel a job: at once when queued; a live one checkpoints and exits first."""
        with self.lock:
            job = self.find(ref)
            if job.state in FINAL:
                raise Conflict(f"job {job.name} is already {job.state}")
            if job.state == "queued":
                self.jobs.move(job, "cancelled", "cancelled by hand")
            elif job.state == "preempting":
                self.jobs.move(job, "preempting", "cancelled by hand", hold="cancel")
            else:
                self.dispatch.preempt(job, "cancelled by hand", hold="cancel")
            return self.find(ref)

    def settled(self, ref: str, done: Callable[[JobRow], bool], timeout: float = SETTLE_SECONDS) -> JobRow:
        """The job once `done(job)`: its process acknowledged a soft pause or a resume (at a step
        boundary); as it is after `timeout` (a long step) otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                self.dispatch.tick()
                job = self.find(ref)
            if done(job) or time.monotonic() >= deadline:
                return job
            time.sleep(0.05)

    def requeue(self, ref: str) -> JobRow:
        """Queue a failed or cancelled job again: the same run, resumed from its run folder's last
        checkpoint (from the start if it never trained)."""
        with self.lock:
            # The recipe and the run folder are checked again: the owner may have narrowed
            # [service] allowed since, or a link may have been put in the folder's place.
            job = self.find(ref)
            self.dispatch.check_folder(job)
            job = self.jobs.requeue(job, lambda path: self.watch.allowed(path, "recipe"))
        self.events.info(f"job {job.name}: requeued by hand ({job.state})")
        return job

    def purge(self, refs: list[str], states: list[str] | None, older_than: float | None,
              dry_run: bool) -> list[JobRow]:
        """Remove finished jobs from the queue: their rows, logs and control folders, never their
        run folders or the ledger's runs. `refs`: those jobs (each must be finished), else every
        finished one; `states` and `older_than` (seconds since it ended) narrow the choice. The
        jobs removed (a dry run: those it would remove)."""
        with self.lock:
            chosen = self.jobs.finished(refs, states, older_than)
            if dry_run:
                return chosen
            gone = [j for j in chosen if self.jobs.remove(j)]
            for job in gone:  # the service's own files about the job; its run folder is not touched
                self.processes.remove_files(job)
        if gone:
            self.events.info(f"purged {len(gone)} finished job(s): {', '.join(j.name for j in gone)}")
        return gone
