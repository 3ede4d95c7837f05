"""The process that owns one Slurm allocation of a remote job (`exec`ed by the batch script):
it checks the staged data, keeps the job within its limits, runs the training under `srun`, and
decides what the allocation's end means.

    start        the staged data must match data.sha256 (else: failed, no training)
                 the wall-clock left = the job's budget - what earlier allocations held
                 (allocations.json, a heartbeat every HEARTBEAT seconds); too little: stopped at limit
    train        srun ... ember run (resuming from the newest checkpoint)
    signals      USR1 from Slurm (the allocation ends in --signal seconds, or a preemption warns):
                 forwarded, the run checkpoints and exits 75
                 TERM (scancel, scontrol requeue, preemption): forwarded, the same
                 the budget timer (the job's own limit): USR1 to the run
    end          exit 0: completed
                 75 after the budget timer: stopped at its limit (outcome.json says so), exit 0
                 75 after Slurm's USR1: requeue itself (`scontrol requeue`) when budget is left,
                 else stopped at its limit
                 75 after TERM: exit 75 (Slurm requeues or cancels, as it was asked to)
                 killed by the signal passed on (srun: 128 + N): as 75 (`decide`)
                 anything else: failed, with the exit code
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from ember.durable import sha256_file, write_durable
from ember.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK
from ember.events import Events
from ember.remote.script import ALLOCATIONS_FILE, DATA_SUMS, OUTCOME_FILE, JobSpec, node_command

HEARTBEAT = 2.0
REQUEUE_WAIT = 120.0  # after `scontrol requeue`, Slurm's TERM comes within KillWait


def run_allocation(folder: Path, events: Events) -> int:
    """Run this allocation of the job in `folder`; the batch step's exit code."""
    spec = JobSpec.read(folder)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    events.info(f"allocation {restart} of ember job {spec.name} (Slurm job {job_id}) on {socket.gethostname()}")
    (folder / OUTCOME_FILE).unlink(missing_ok=True)  # an earlier allocation's, if the job was requeued after it
    changed = check_data(folder)
    if changed:
        return finish(folder, "failed", f"staged data changed since it was verified: {changed}", EXIT_ERROR, events)
    ledger = Allocations(folder / ALLOCATIONS_FILE, restart)
    left = spec.budget_seconds - ledger.earlier()
    if left <= spec.signal_seconds:
        return finish(folder, "limit", f"its limits are spent ({spec.budget_seconds - left:.0f} s of "
                      f"{spec.budget_seconds:.0f} s held)", EXIT_OK, events)
    why: list[str] = []
    child: subprocess.Popen | None = None

    def stop(reason: str, sig: int) -> None:
        if not why:
            why.append(reason)
        if child is not None and child.poll() is None:
            child.send_signal(sig)

    handlers = {signal.SIGUSR1: lambda *_: stop("allocation-end", signal.SIGUSR1),
                signal.SIGTERM: lambda *_: stop("terminated", signal.SIGTERM)}
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    budget = threading.Timer(left - spec.signal_seconds, lambda: stop("limit", signal.SIGUSR1))
    budget.daemon = True
    beat = threading.Thread(target=ledger.beat, daemon=True)
    try:
        ledger.begin()
        beat.start()
        budget.start()
        argv = node_command(spec, f"{socket.gethostname()}:{free_port()}")
        child = subprocess.Popen(argv)
        if why:  # a signal came before the child existed: it gets it now
            child.send_signal(signal.SIGTERM if why[0] == "terminated" else signal.SIGUSR1)
        code = child.wait()
    finally:
        budget.cancel()
        ledger.end()
        for s, h in previous.items():
            signal.signal(s, h)
    reason = why[0] if why else ""
    events.info(f"the training exited {code}" + (f" after {reason}" if reason else ""))
    left = spec.budget_seconds - ledger.earlier() - ledger.held()
    ending = decide(code, reason, left > spec.signal_seconds)
    if ending == "completed":
        return finish(folder, "completed", "max_steps reached", EXIT_OK, events)
    if ending == "interrupted":  # however srun ended: Slurm requeues or cancels the job, as it was asked to
        return EXIT_INTERRUPTED
    if ending == "failed":
        return finish(folder, "failed", f"the training exited {code}", code if code > 0 else EXIT_ERROR, events)
    if ending == "limit":
        said = (f"its limits reached: checkpointed and stopped within its budget of {spec.budget_seconds:.0f} s"
                if reason == "limit" else "the allocation ended with its limits spent")
        return finish(folder, "limit", said, EXIT_OK, events)
    return requeue(job_id, events)


# How the training ended when it stopped on a signal we passed on: 75 (it checkpointed), or killed
# by that signal itself (before its handlers were up, say), which srun reports as 128 + the signal.
# Either way its newest committed checkpoint is where the next allocation resumes.
STOPPED = (EXIT_INTERRUPTED, -signal.SIGUSR1, -signal.SIGTERM, 128 + signal.SIGUSR1, 128 + signal.SIGTERM)


def decide(code: int, reason: str, budget_left: bool) -> str:
    """What this allocation's end means, from the training's exit `code`, why it was stopped
    (`reason`: '', 'terminated', 'limit' or 'allocation-end') and whether the job's budget
    outlasts another allocation: 'completed', 'interrupted' (Slurm's TERM: it requeues or
    cancels), 'failed', 'limit' (stopped within the job's own limits) or 'requeue'."""
    if code == EXIT_OK:
        return "completed"
    if reason == "terminated":
        return "interrupted"
    if code not in STOPPED or not reason:
        return "failed"
    if reason == "limit" or not budget_left:
        return "limit"
    return "requeue"


def requeue(job_id: str, events: Events) -> int:
    """Put this job back in the queue (it resumes from its checkpoint), then wait for Slurm's TERM."""
    events.info(f"checkpointed before the allocation's end; requeueing job {job_id}")
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if done.returncode != 0:
        events.warn(f"scontrol requeue {job_id} failed: {done.stderr.strip()}")
        return EXIT_ERROR
    ended = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ended.set())
    ended.wait(REQUEUE_WAIT)
    return EXIT_INTERRUPTED


def finish(folder: Path, outcome: str, detail: str, code: int, events: Events) -> int:
    """Record how the job ended by its own decision (outcome.json), and return the exit code."""
    write_durable(folder / OUTCOME_FILE, json.dumps({"outcome": outcome, "detail": detail, "time": time.time()}))
    (events.info if outcome != "failed" else events.warn)(f"{outcome}: {detail}")
    return code


def check_data(folder: Path) -> str:
    """'' when every staged file still has the SHA-256 verified on arrival, else the first that does not."""
    sums = folder / DATA_SUMS
    if not sums.is_file():
        return f"{sums} is missing"
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            return name
    return ""


def free_port() -> int:
    """A free port on this node for the rendezvous of several nodes (node 0 runs this process)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Allocations:
    """How long each allocation of the job held its nodes: {restart: [start, last seen]}, written
    atomically every HEARTBEAT seconds, so a killed allocation is counted to its last heartbeat."""

    def __init__(self, path: Path, restart: int):
        self.path, self.key = path, str(restart)
        self.start = time.time()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the heartbeat thread and the main thread both write
        try:
            self.spans: dict[str, list[float]] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.spans = {}
        # An allocation counted under this restart number before (its process was restarted
        # within the allocation) keeps its time: it is a key of its own.
        while self.key in self.spans:
            self.key += "+"

    def earlier(self) -> float:
        return sum(end - start for key, (start, end) in self.spans.items() if key != self.key)

    def held(self) -> float:
        return time.time() - self.start

    def begin(self) -> None:
        self._write()

    def beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            self._write()

    def end(self) -> None:
        self._stop.set()
        self._write()

    def _write(self) -> None:
        with self._lock:
            self.spans[self.key] = [self.start, time.time()]
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.spans))
            os.replace(tmp, self.path)

