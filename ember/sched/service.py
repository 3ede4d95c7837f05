"""The service's library: what `ember serve`'s API (ember.web.api) and commands call.

One `Service` per machine ($EMBER_HOME/serve/serve.lock). Its state lives in the ledger (jobs,
transitions), so a service killed at any moment finds every job again at its next start
(`recover`): a job whose process still runs is adopted; one whose process died is queued again
and resumes from its last checkpoint. A job's run folder is locked by its own process (ember.lock),
so no job ever runs twice at once, even across a service restart.

`tick()` runs every TICK_SECONDS on the scheduler thread: reap exited jobs, read the machine
and the owner's rules, ask jobs to soft-pause or go on, preempt (hard holds, priorities), admit.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ember import control
from ember.durable import fsync_dir, write_durable
from ember.errors import EXIT_INTERRUPTED, BadInput, Conflict, EmberError, NotFound, Refused, Unavailable
from ember.events import Events
from ember.hardware import Machine, detect
from ember.infer.runs import BASE, lora_run
from ember.ledger import job_rows as rows
from ember.ledger.job_rows import JobRow
from ember.ledger.database import connect, default_path, latest_run_at
from ember.paths import check_name, default_run_folder, home, name_from
from ember.sched import admission, owner_rules as owner, process
from ember.sched.inference import Gate
from ember.ledger.job_states import LIVE, LOCAL_FINAL as FINAL, move, remove
from ember.sched.observe import Observer
from ember.sched.plan_child import plan_json

TICK_SECONDS = 0.1
OBSERVE_SECONDS = 0.5
YIELD_BOUND_SECONDS = 2.0     # a planned step longer than this is reported at submit: pauses wait a step
PREEMPT_KILL_SECONDS = 300.0  # a job that has not exited this long after SIGTERM is killed
SETTLE_SECONDS = 30.0   # a soft pause or resume is answered once the job's process took it, or after this
RESTARTS = 3            # crashes a job's supervisor restarts within an hour before the job fails
YIELD_FILE = "yield.json"    # in the service folder: an `ember yield` in force, kept across restarts


@dataclass
class JobView:
    """A job as `ember queue` shows it."""
    id: int
    name: str
    state: str
    priority: int
    devices: list[int]
    step: int
    max_steps: int
    hold: str | None
    pause: str | None
    preemptions: int
    cause: str | None
    out: str
    goodput: float | None = None
    held_by: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # why it does not train now, in words
    log: str = ""                                      # its output (`ember logs`)
    run: str | None = None  # the ledger's id of the run in `out` (the dashboard's /runs/RUN); None before it trains


class Service:
    def __init__(self, rules: owner.OwnerRules, devices: str | None, events: Events,
                 ledger: Path | None = None):
        self.rules, self.events = rules, events
        self.home = home()
        self.dir = self.home.serve
        self.ledger_path = ledger or default_path()
        self.con = connect(self.ledger_path, shared=True)
        self.lock = threading.RLock()
        self.procs: dict[int, subprocess.Popen] = {}
        self.machine: Machine = detect(devices)
        self.device_spec = devices
        self.observer = Observer()
        self.observation: owner.Observation | None = None
        self.observed_at = 0.0
        self.holds: list[owner.Hold] = []
        self.waiting: dict[int, str] = {}  # queued job -> why the last admission left it waiting
        self.yield_until: float | None = self._load_yield()   # math.inf: until released
        self.soft_since: dict[int, float] = {}
        self.gate = Gate(rules.inference.device, rules.inference.idle_gap_seconds)
        self.stopping = threading.Event()
        self.plans: dict[str, dict] = {}
        self.rules_text = self._rules_bytes()
        self.rules_status = owner.RulesStatus(str(owner.owner_file()), time.time())

    # ---- the API's verbs ------------------------------------------------------------------

    def submit(self, recipe: str, name: str | None, priority: int, out: str | None,
               overrides: list[str]) -> JobRow:
        """Plan the recipe (in a child: no torch here), refuse what can never fit, queue the rest."""
        if name is not None:
            check_name(name)
        recipe_path = self.allowed(recipe, "recipe")
        if not recipe_path.is_file():
            raise BadInput(f"recipe {recipe_path}: no such file")
        if not -1000 <= priority <= 1000:
            raise BadInput(f"priority {priority}: must be between -1000 and 1000")
        request = self.plan(recipe_path, overrides)
        capacity = max(self.capacity(d) for d in self.machine.devices)
        if request["memory"] > capacity:
            raise EmberError(f"{recipe_path}: can never fit here: its plan needs "
                             f"{request['memory'] / 2**30:.2f} GiB per device (with margin) and the "
                             f"largest device offers {capacity / 2**30:.2f} GiB; `ember plan` says: "
                             f"{request['verdict']} ({'; '.join(request['reasons'])})")
        with self.lock:
            name = name or name_from(recipe_path.stem, str(rows.next_id(self.con)))
            if rows.name_taken(self.con, name):
                raise Conflict(f"job name {name!r} is taken; choose another --name")
            folder = self.allowed(out, "run folder") if out else default_run_folder(name)
            busy = [j for j in rows.all_jobs(self.con) if j.out == str(folder) and j.state not in FINAL]
            if busy:
                raise Conflict(f"run folder {folder} belongs to job {busy[0].name} ({busy[0].state}); "
                                 f"cancel it or choose another --out")
            job = rows.insert(self.con, name, str(recipe_path), str(folder), overrides, priority,
                              request, "queued")
        self.events.info(f"job {job.id} {job.name}: queued (priority {priority}, "
                         f"{request['memory'] / 2**20:.0f} MiB per device)")
        step = request.get("step_seconds")
        if step and step > YIELD_BOUND_SECONDS:
            self.events.warn(f"job {job.name}: its plan predicts {step:.1f} s per optimizer step; training "
                             f"steps aside for inference and the owner at step boundaries, so a pause can "
                             f"take that long: fewer micro-batches per step (train.grad_accum) shorten it")
        return job

    def plan(self, recipe: Path, overrides: list[str]) -> dict:
        """The job's request from `ember plan --json`: memory per device with margin, verdict.
        Remembered by the recipe's content and overrides: a recipe submitted again is not re-planned."""
        key = hashlib.sha256(recipe.read_bytes() + json.dumps([str(recipe), overrides]).encode()).hexdigest()
        if key not in self.plans:
            self.plans[key] = self._plan(recipe, overrides)
        return self.plans[key]

    def _plan(self, recipe: Path, overrides: list[str]) -> dict:
        plan = plan_json(recipe, overrides, self.ledger_path)
        step = plan["time"]["step_seconds"]
        return {"memory": int(plan["memory"]["with_margin"]), "count": 1, "verdict": plan["verdict"],
                "reasons": plan["reasons"], "max_steps": plan["recipe"]["max_steps"],
                "step_seconds": step if isinstance(step, (int, float)) and math.isfinite(step) else None}

    def allowed(self, path: str, what: str) -> Path:
        """`path` resolved, if it lies under a folder the owner allowed ([service] allowed)."""
        try:
            p = Path(path).expanduser().resolve()
            p.exists()  # a name or path too long for the file system says so here, not later as a 500
        except (ValueError, RuntimeError, OSError) as e:  # a NUL byte; a loop of links; ENAMETOOLONG
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise BadInput(f"{what} {path[:200]!r}{'...' if len(path) > 200 else ''}: not a usable path "
                           f"({reason})") from None
        roots = [Path(a).expanduser().resolve() for a in self.rules.service.allowed]
        if not any(p.is_relative_to(r) for r in roots):
            raise Refused(f"{what} {p} is outside the folders the owner allowed "
                          f"({', '.join(map(str, roots))}; [service] allowed in owner.toml)")
        return p

    def find(self, ref: str) -> JobRow:
        job = rows.find(self.con, str(ref))
        if job is None:
            raise NotFound(f"no job {ref!r}; `ember queue` lists them")
        return job

    def pause(self, ref: str, hard: bool) -> JobRow:
        """Soft: stop at the next step boundary, keep the process. Hard: checkpoint and exit,
        and stay queued until resumed."""
        with self.lock:
            job = self.find(ref)
            if job.state in FINAL:
                raise Conflict(f"job {job.name} is {job.state}: nothing to pause")
            if job.state == "queued" or hard:
                if job.state in LIVE:
                    self._preempt(job, "paused by hand (hard)", hold="user")
                else:
                    job = move(self.con, job, "queued", "held by hand", hold="user") or job
            else:
                move(self.con, job, job.state, "soft pause by hand", pause="user")
            self.tick()
        # A hard pause is answered at once (preempting: it checkpoints at its next step, then exits).
        return self.settled(ref, lambda j: j.state not in ("starting", "running") or j.pause != "user")

    def resume(self, ref: str) -> JobRow:
        with self.lock:
            job = self.find(ref)
            if job.state in FINAL:
                again = f"; `ember requeue {job.name}` queues it again" if job.state != "completed" else ""
                raise Conflict(f"job {job.name} is {job.state}: nothing to resume{again}")
            if job.hold in ("user", "interrupted") or job.pause == "user":
                move(self.con, job, job.state, "resumed by hand", hold=None if job.hold != "cancel" else "cancel",
                     pause=None)
            self.tick()
        # Settled when it trains again, or when something else (the owner's rules, inference) keeps it paused.
        return self.settled(ref, lambda j: j.state != "soft-paused" or control.requested(self.ctl(j)) is not None)

    def cancel(self, ref: str) -> JobRow:
        with self.lock:
            job = self.find(ref)
            if job.state in FINAL:
                raise Conflict(f"job {job.name} is already {job.state}")
            if job.state == "queued":
                move(self.con, job, "cancelled", "cancelled by hand")
            elif job.state == "preempting":
                move(self.con, job, "preempting", "cancelled by hand", hold="cancel")
            else:
                self._preempt(job, "cancelled by hand", hold="cancel")
            return self.find(ref)

    def settled(self, ref: str, done: Callable[[JobRow], bool], timeout: float = SETTLE_SECONDS) -> JobRow:
        """The job once `done(job)`: its process acknowledged a soft pause or a resume (at a step
        boundary); as it is after `timeout` (a long step) otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                self.tick()
                job = self.find(ref)
            if done(job) or time.monotonic() >= deadline:
                return job
            time.sleep(0.05)

    def requeue(self, ref: str) -> JobRow:
        """Queue a failed or cancelled job again: the same run, resumed from its run folder's last
        checkpoint (from the start if it never trained)."""
        with self.lock:
            job = self.find(ref)
            if job.state not in ("failed", "cancelled"):
                raise Conflict(f"job {job.name} is {job.state}: only a failed or cancelled job is requeued"
                                 + ("" if job.state == "completed" else f"; `ember resume {job.name}` lifts "
                                    f"a pause or hold"))
            # Checked again: the owner may have narrowed [service] allowed since it was submitted.
            folder, recipe = Path(job.out), self.allowed(job.recipe, "recipe")
            run = latest_run_at(self.con, folder)
            if run is not None and not folder.is_dir():
                raise NotFound(f"job {job.name}: its run folder {folder} is gone (the ledger's run {run} "
                                 f"trained there), so there is nothing to resume; submit the recipe again "
                                 f"for a new run: `ember submit {recipe} --name NEW_NAME`")
            if not recipe.is_file():
                raise NotFound(f"job {job.name}: its recipe {recipe} is gone; put it back (the run resumes "
                                 f"only with the recipe it trained with) and requeue again")
            busy = [j for j in rows.all_jobs(self.con) if j.out == job.out and j.state not in FINAL]
            if busy:
                raise Conflict(f"job {job.name}: its run folder {folder} belongs to job {busy[0].name} "
                                 f"({busy[0].state}) now; cancel that job first")
            job = move(self.con, job, "queued", "requeued by hand", hold=None, pause=None, cause=None) or job
        self.events.info(f"job {job.name}: requeued by hand ({job.state})")
        return job

    def purge(self, refs: list[str], states: list[str] | None, older_than: float | None,
              dry_run: bool) -> list[JobView]:
        """Remove finished jobs from the queue: their rows, logs and control folders, never their
        run folders or the ledger's runs. `refs`: those jobs (each must be finished), else every
        finished one; `states` and `older_than` (seconds since it ended) narrow the choice."""
        wanted = tuple(states or FINAL)
        for state in wanted:
            if state not in FINAL:
                raise BadInput(f"state {state!r}: only finished jobs (completed, failed, cancelled) are "
                                 f"purged; a queued, running or paused job is cancelled first (`ember cancel JOB`)")
        if older_than is not None and older_than < 0:
            raise BadInput(f"older than {older_than:g} s: must be 0 or more")
        with self.lock:
            jobs = list({j.id: j for j in map(self.find, refs)}.values()) if refs else rows.all_jobs(self.con, FINAL)
            for job in jobs:
                if job.state not in FINAL:
                    raise Conflict(f"job {job.name} is {job.state}: only finished jobs (completed, failed, "
                                     f"cancelled) are purged; nothing was removed. `ember cancel {job.name}` "
                                     f"ends it first")
            cutoff = math.inf if older_than is None else time.time() - older_than
            chosen = [j for j in jobs if j.state in wanted and j.updated <= cutoff]
            views = [self.view(j) for j in chosen]
            if dry_run:
                return views
            gone = [j for j in chosen if remove(self.con, j, "purged by hand")]
            for job in gone:  # the service's own files about the job; its run folder is not touched
                self.log_path(job).unlink(missing_ok=True)
                shutil.rmtree(self.ctl(job))
        if gone:
            self.events.info(f"purged {len(gone)} finished job(s): {', '.join(j.name for j in gone)}")
        return [v for v in views if v.id in {j.id for j in gone}]

    def yield_devices(self, seconds: float | None, timeout: float = 600.0) -> dict:
        """Hold all training for `seconds` (None: until released) and return once every job's
        process is gone from the devices (checkpointed and exited), with how long that took."""
        t0 = time.time()
        with self.lock:
            self._set_yield(math.inf if seconds is None else t0 + seconds)
            self.tick()
        while time.time() - t0 < timeout:
            with self.lock:
                live = [j for j in rows.all_jobs(self.con, LIVE)]
                if not live:
                    return {"freed_after_seconds": time.time() - t0, "until": self.yield_until}
            time.sleep(0.02)
        raise Unavailable(f"jobs still on the devices after {timeout:.0f} s: {', '.join(j.name for j in live)}; "
                          f"the yield holds: ask again to wait more")

    def release_yield(self) -> None:
        with self.lock:
            self._set_yield(None)
            self.tick()

    def _load_yield(self) -> float | None:
        """The owner's `ember yield` in force when the service (re)starts: it outlives the service."""
        path = self.dir / YIELD_FILE
        try:
            until = json.loads(path.read_text())["until"]
            return math.inf if until is None else float(until)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:  # the owner asked for the machine: hold
            self.events.warn(f"{path}: unreadable ({e}); all training is held until `ember yield --release`")
            return math.inf

    def _set_yield(self, until: float | None) -> None:
        """Durable (fsynced) before it takes effect, so before `ember yield` is answered."""
        path = self.dir / YIELD_FILE
        if until is None:
            if path.exists():
                path.unlink()
                fsync_dir(self.dir)
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_durable(path, json.dumps({"until": None if math.isinf(until) else until}))
        self.yield_until = until

    def ctl(self, job: JobRow) -> Path:
        """The job's soft-pause control folder (ember.control), outside its run folder."""
        folder = self.home.job_control(job.id)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def log_path(self, job: JobRow) -> Path:
        return self.home.job_log(job.id)

    def logs(self, ref: str, offset: int) -> tuple[bytes, int]:
        job = self.find(ref)
        path = self.log_path(job)
        if not path.exists():
            return b"", 0
        with open(path, "rb") as f:
            f.seek(max(0, offset))
            data = f.read(1 << 20)
        return data, max(0, offset) + len(data)

    def queue(self) -> list[JobView]:
        with self.lock:
            jobs = rows.all_jobs(self.con)
            return [self.view(j) for j in jobs]

    def view(self, j: JobRow) -> JobView:
        step = last_step(Path(j.out))
        by = [f"{h.rule}: {h.detail}" for h in self.holds_on(j)]
        return JobView(j.id, j.name, j.state, j.priority, j.devices, step, j.request.get("max_steps", 0),
                       j.hold, j.pause, j.preemptions, j.cause, j.out, run_goodput(self.con, j.out), by,
                       self.why_waiting(j, by), str(self.log_path(j)), latest_run_at(self.con, Path(j.out)))

    def why_waiting(self, j: JobRow, held_by: list[str]) -> list[str]:
        """Why job `j` does not train now: a hand's hold or pause, the owner's rules and yield,
        inference, or what admission said (memory, priority, devices). Empty when it trains or
        has ended."""
        if j.state in FINAL or (j.state == "running" and j.pause is None and not held_by):
            return []
        why = []
        if j.hold == "user":
            why.append(f"held by hand (a hard pause): `ember resume {j.name}` lets it start again")
        elif j.hold == "cancel":
            why.append("being cancelled")
        elif j.hold == "interrupted":
            why.append(f"stopped by a signal from outside the service: `ember resume {j.name}` starts it again")
        if j.pause == "user":
            why.append(f"paused by hand (soft, the process kept): `ember resume {j.name}`")
        why += held_by
        if j.state == "soft-paused" and control.requested(self.ctl(j)) == "inference":
            why.append(f"inference requests on device {self.gate.device} (it resumes "
                       f"{self.rules.inference.idle_gap_seconds:g} s after the last one)")
        if j.state == "queued" and j.hold is None and not held_by:
            why.append(self.waiting.get(j.id, "waiting for the scheduler's next decision"))
        return why

    def explain(self) -> list[dict]:
        """Which rule holds each unfinished job right now."""
        with self.lock:
            self.observe(force=True)
            return [{"job": v.name, "state": v.state, "held_by": v.held_by, "hold": v.hold, "pause": v.pause,
                     "waiting": v.waiting} for v in map(self.view, rows.all_jobs(self.con)) if v.state not in FINAL]

    # ---- the scheduler ----------------------------------------------------------------------

    def recover(self) -> None:
        """At start: adopt live jobs whose process still runs; queue again those that died."""
        with self.lock:
            for job in rows.all_jobs(self.con, LIVE):
                if process.alive(job.pid, job.pid_start):
                    self.events.info(f"job {job.name}: process {job.pid} still runs; adopted")
                    continue
                control.clear(self.ctl(job))
                if job.hold == "cancel":
                    move(self.con, job, "cancelled" if job.state == "preempting" else "queued",
                         "found dead after a service restart", pid=None)
                else:
                    done = completed(Path(job.out))
                    move(self.con, job, "completed" if done and job.state != "queued" else "queued",
                         "found dead after a service restart" + ("" if done else ": resumes from its last checkpoint"),
                         pid=None)

    def tick(self) -> None:
        """One pass of the scheduler (see the module docstring). Callers hold self.lock."""
        now = time.time()
        self.reap()
        self.observe()
        holds = list(self.holds)
        if self.yield_until is not None:
            if now >= self.yield_until:
                self._set_yield(None)
            else:
                until = "until released" if math.isinf(self.yield_until) else \
                    f"for {self.yield_until - now:.0f} s more"
                holds.append(owner.Hold("yield", "hard", None, False, f"ember yield, {until}"))
        for job in rows.all_jobs(self.con, LIVE):
            try:
                self.steer(job, holds, now)
            except OSError as e:  # one job's folder trouble never stops the others' scheduling
                self.events.warn(f"job {job.name}: {e}")
        self.admit(holds, now)

    def reap(self) -> None:
        """Jobs whose process ended: completed, queued again (preempted) or failed, with the cause."""
        for job in rows.all_jobs(self.con, LIVE):
            popen = self.procs.get(job.id)
            code = popen.poll() if popen is not None else None
            if popen is None and process.alive(job.pid, job.pid_start):
                code = None
            elif popen is None:
                code = -1  # an adopted process that ended: its code is not ours to read
            if code is None:
                self.follow(job)
                continue
            self.procs.pop(job.id, None)
            control.clear(self.ctl(job))
            self.soft_since.pop(job.id, None)
            out = Path(job.out)
            if completed(out):
                move(self.con, job, "completed", "finished", pid=None, cause=None)
            elif job.state == "preempting":
                if job.hold == "cancel":
                    move(self.con, job, "cancelled", "cancelled: checkpointed and exited", pid=None)
                else:
                    move(self.con, job, "queued", job.cause or "preempted: checkpointed and exited", pid=None,
                         preemptions=job.preemptions + 1)
            elif code == EXIT_INTERRUPTED or (code == -1 and last_outcome(self.con, out) == "interrupted"):
                move(self.con, job, "queued", "interrupted from outside the service", pid=None,
                     hold="interrupted", cause="stopped by a signal from outside the service; "
                                               "`ember resume` queues it again")
            elif code == -1 and last_outcome(self.con, out) in (None, "killed"):
                move(self.con, job, "queued", "died while adopted: resumes from its last checkpoint", pid=None)
            else:
                why = failure_cause(self.con, out, self.log_path(job), code)
                move(self.con, job, "failed", why, pid=None, cause=why)
                self.events.warn(f"job {job.name} failed: {why}")

    def follow(self, job: JobRow) -> None:
        """starting -> running once the job logged a step; running <-> soft-paused by its acks."""
        out = Path(job.out)
        if job.state == "starting" and last_step_time(out) >= (job.started or 0):
            move(self.con, job, "running", "first step done")
            return
        if job.state not in ("running", "soft-paused"):
            return
        ack, asked = control.acknowledged(self.ctl(job)), control.requested(self.ctl(job))
        if not ack:
            return
        if job.state == "running" and asked and ack.get("state") == "paused":
            move(self.con, job, "soft-paused", f"paused ({asked})")
            if asked == "inference" and self.gate.device in job.devices:
                self.inference_paused(ack["time"])
        elif job.state == "soft-paused" and not asked and ack.get("state") == "running":
            move(self.con, job, "running", "pause lifted")

    def inference_paused(self, acked_at: float) -> None:
        """A pause sample when every job on the inference device has acknowledged."""
        on_device = [j for j in rows.all_jobs(self.con, ("running", "soft-paused", "starting"))
                     if self.gate.device in j.devices]
        acks = [control.acknowledged(self.ctl(j)) or {} for j in on_device]
        if all(a.get("state") == "paused" for a in acks):
            self.gate.paused(max([a.get("time", acked_at) for a in acks] + [acked_at]))

    def observe(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.observed_at < OBSERVE_SECONDS:
            return
        self.reload_rules()
        ours = {os.getpid()} | {j.pid for j in rows.all_jobs(self.con, LIVE) if j.pid}
        self.observation = self.observer.observe(self.rules, ours)
        self.holds = owner.holds(self.rules, self.observation, dt.datetime.now())
        self.observed_at = now

    def _rules_bytes(self) -> bytes | None:
        """owner.toml's bytes (None: absent): compared, not its mtime, which two quick edits can share."""
        try:
            return owner.owner_file().read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            return repr(e).encode()  # unreadable: load_rules says why, once, until that changes

    def reload_rules(self) -> None:
        """owner.toml edited: its live keys hold from now; a change to a key read only at start
        (owner.RESTART_KEYS) waits for a restart; a file that does not validate changes nothing.
        Both are said in the log and kept in `rules_status` (ember queue, the dashboard)."""
        text = self._rules_bytes()
        if text == self.rules_text:
            return
        self.rules_text, path = text, owner.owner_file()
        try:
            new = owner.load_rules(path)
        except (EmberError, OSError) as e:
            self.rules_status.error = str(e)
            self.events.warn(f"{e}; the rules in force stay as they were until the file is fixed")
            return
        self.rules, restart = owner.merge(self.rules, new)
        self.gate.idle_gap = self.rules.inference.idle_gap_seconds
        self.rules_status = owner.RulesStatus(str(path), time.time(), None, restart)
        later = f"; {', '.join(c['key'] for c in restart)}: changed, but read only at start" if restart else ""
        self.events.info(f"owner rules read from {path}: in force now{later}" if text is not None
                         else f"{path} is gone: the default rules are in force now{later}")
        for note in self.rules_status.notes():
            self.events.warn(note)

    def owner_status(self) -> dict:
        """owner.toml as the service applies it: the error or the changes waiting for a restart,
        said in words (notes), and the rules in force."""
        with self.lock:
            status, rules = self.rules_status, self.rules
            return {**asdict(status), "notes": status.notes(), "rules": asdict(rules)}

    def holds_on(self, job: JobRow) -> list[owner.Hold]:
        devices = tuple(job.devices) or tuple(d.index for d in self.machine.devices)
        accel = any(d.kind != "cpu" for d in self.machine.devices)
        holds = list(self.holds)
        if self.yield_until is not None:
            holds.append(owner.Hold("yield", "hard", None, False, "ember yield"))
        return [h for h in holds if owner.applies(h, devices, accel)]

    def steer(self, job: JobRow, holds: list[owner.Hold], now: float) -> None:
        """Hard holds preempt; soft holds, a hand pause and inference ask for a soft pause."""
        if job.state == "preempting":
            if now - job.updated > PREEMPT_KILL_SECONDS and process.kill_tree(job.pid, job.pid_start):
                self.events.warn(f"job {job.name}: no exit {PREEMPT_KILL_SECONDS:.0f} s after SIGTERM; "
                                 f"killed (it resumes from its last committed checkpoint)")
            return
        accel = any(d.kind != "cpu" for d in self.machine.devices)
        mine = [h for h in holds if owner.applies(h, tuple(job.devices), accel)]
        hard = [h for h in mine if h.kind == "hard"]
        if hard:
            self._preempt(job, f"{hard[0].rule}: {hard[0].detail}", hold=None)
            return
        soft = [h for h in mine if h.kind == "soft"]
        reason = ("user" if job.pause == "user" else "owner" if soft else
                  "inference" if self.gate.device in job.devices and self.gate.busy(now) else None)
        out = self.ctl(job)
        if reason is None:
            self.soft_since.pop(job.id, None)
            if control.requested(out) is not None:
                control.request(out, None)
            return
        since = self.soft_since.setdefault(job.id, now)
        if reason != "inference" and now - since > self.rules.pause.hard_after_minutes * 60:
            # A hand pause stays held once hard; an owner's rule keeps the job queued while it holds.
            self._preempt(job, f"soft pause longer than [pause] hard_after_minutes = "
                               f"{self.rules.pause.hard_after_minutes:g}", hold="user" if reason == "user" else None)
            return
        if reason == "inference":  # a lease, renewed while requests run (ember.control)
            control.request(out, reason, self.rules.inference.pause_lease_seconds)
        elif control.requested(out) != reason:
            control.request(out, reason)

    def _preempt(self, job: JobRow, why: str, hold: str | None) -> None:
        """SIGTERM: the job checkpoints at its next step boundary and exits 75."""
        if job.state in ("soft-paused",):
            control.request(self.ctl(job), None)  # let the loop reach its stop check
        process.signal_job(job.pid, job.pid_start, signal.SIGTERM)
        move(self.con, job, "preempting", why, cause=why, **({"hold": hold} if hold else {}))
        self.events.info(f"job {job.name}: preempting ({why})")

    def capacity(self, d) -> int:
        """Bytes jobs may plan to use on device `d` now."""
        if d.kind == "cpu":
            share = owner.ram_share(self.rules, self.observation) if self.observation else \
                self.rules.memory.max_share_idle
            return int(d.total * share)
        return d.total - d.foreign

    def admit(self, holds: list[owner.Hold], now: float) -> None:
        """Start what fits (ember.sched.admission); preempt lower priorities for higher ones."""
        queued = [j for j in rows.all_jobs(self.con, ("queued",)) if j.hold is None]
        if not queued:
            self.waiting = {}
            return
        accel = any(d.kind != "cpu" for d in self.machine.devices)
        blocked = {i for h in holds for i in (h.devices or [d.index for d in self.machine.devices])
                   if not (h.accelerators_only and not accel)}
        rooms = [admission.Room(d.index, self.capacity(d)) for d in self.machine.devices if d.index not in blocked]
        running = [admission.Holding(j.id, j.priority, j.started or 0, j.request["memory"], tuple(j.devices))
                   for j in rows.all_jobs(self.con, LIVE)]
        wants = [admission.Want(j.id, j.priority, j.submitted, j.request["memory"], j.request.get("count", 1))
                 for j in queued]
        decision = admission.decide(wants, running, rooms, now)
        self.waiting = decision.waiting
        for victim in decision.preempt:
            job = rows.get(self.con, victim)
            if job.state in LIVE and job.state != "preempting":
                self._preempt(job, "preempted by a job of higher priority", hold=None)
        for job_id, devices in decision.start.items():
            self.start(rows.get(self.con, job_id), devices)

    def start(self, job: JobRow, devices: tuple[int, ...]) -> None:
        kinds = {d.index: d.kind for d in self.machine.devices}
        names = {d.index: d.name for d in self.machine.devices}
        env = {"EMBER_JOB": str(job.id), "EMBER_JOB_DEVICES": ",".join(map(str, devices)),
               "EMBER_JOB_DEVICE_NAMES": ",".join(names[i] for i in devices),  # the ledger's attempt row
               control.ENV: str(self.ctl(job))}
        if all(kinds[i] == "cuda" for i in devices):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        control.clear(self.ctl(job))
        Path(job.out).parent.mkdir(parents=True, exist_ok=True)
        argv = process.run_argv(job.recipe, job.out, job.overrides, self.ledger_path, RESTARTS)
        p = process.spawn(argv, self.log_path(job), env)
        self.procs[job.id] = p.popen
        move(self.con, job, "starting", f"admitted on device(s) {list(devices)}", pid=p.pid,
             pid_start=p.start, devices=list(devices), started=time.time(), cause=None)
        self.events.info(f"job {job.name}: started on device(s) {list(devices)} (PID {p.pid})")

    def inference_begin(self) -> None:
        """A request arrives for the inference device: jobs there soft-pause now, not at the next tick."""
        with self.lock:
            on_device = [j for j in rows.all_jobs(self.con, ("running", "starting", "soft-paused"))
                         if self.gate.device in j.devices]
            acks = [control.acknowledged(self.ctl(j)) or {} for j in on_device]
            paused = all(a.get("state") == "paused" for a in acks)
            # Paused already: an earlier request's pause the scheduler has not sampled yet closes now.
            self.gate.begin(not paused, max((a.get("time", 0.0) for a in acks), default=None) if paused else None)
            for job in on_device:
                if control.requested(self.ctl(job)) is None:
                    control.request(self.ctl(job), "inference", self.rules.inference.pause_lease_seconds)

    def inference_end(self) -> None:
        self.gate.end()

    def inference_roots(self) -> list[Path]:
        """The run folders whose adapters inference serves: [inference] runs and the jobs' own."""
        return [Path(r) for r in self.rules.inference.runs] + [self.home.runs]

    def adapter_elsewhere(self, model: object) -> str | None:
        """Why a /v1 request for `model` cannot go to the upstream engine ([inference] upstream):
        it names one of ember's LoRA runs, which that engine has not loaded and would answer with
        its base model. None when it may go."""
        if not self.rules.inference.upstream or not isinstance(model, str) or model == BASE:
            return None
        path = lora_run(self.inference_roots(), model)
        if path is None:
            return None
        return (f"model {model!r} is ember's LoRA run {path}; the upstream engine "
                f"{self.rules.inference.upstream} ([inference] upstream) has not loaded its adapter and "
                f"would answer with its base model. Serve adapters with the built-in engine ([inference] "
                f"upstream = \"\"), or write the run as a model of its own (`ember export {path} --format "
                f"gguf`) and load that into the upstream engine")

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
            for job in rows.all_jobs(self.con, LIVE):
                if job.state != "preempting":
                    self._preempt(job, "the service is stopping", hold=None)
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                live = [j for j in rows.all_jobs(self.con, LIVE) if process.alive(j.pid, j.pid_start)]
            if not live:
                break
            time.sleep(0.05)
        with self.lock:
            self.reap()


def completed(out: Path) -> bool:
    """Whether the run folder holds a completed run (run.json says so and final/ exists)."""
    try:
        record = json.loads((out / "run.json").read_text())
    except (OSError, ValueError):
        return False
    return record.get("completed_step") is not None and (out / "final").is_dir()


def _last_metrics(out: Path) -> dict:
    path = out / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def last_step(out: Path) -> int:
    return int(_last_metrics(out).get("step", 0))


def last_step_time(out: Path) -> float:
    return float(_last_metrics(out).get("time", 0.0))


def last_outcome(con: sqlite3.Connection, out: Path) -> str | None:
    from ember.ledger.database import run_attempt_outcomes
    outcomes = run_attempt_outcomes(con, out)
    return outcomes[-1] if outcomes else None


def failure_cause(con: sqlite3.Connection, out: Path, log: Path, code: int) -> str:
    """Why a job failed: the ledger's last attempt detail, else the last line of its log."""
    from ember.ledger.database import run_attempt_details
    details = [d for d in run_attempt_details(con, out) if d]
    if details:
        return details[-1]
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    errors = [x for x in lines if x.startswith("error:")]  # what `ember run` said, not its summary
    return errors[-1] if errors else lines[-1] if lines else f"exit {code}"


def run_goodput(con: sqlite3.Connection, out: str) -> float | None:
    from ember.ledger.database import summary_for_path
    s = summary_for_path(con, Path(out))
    return s.get("goodput") if s else None
