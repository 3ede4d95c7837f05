"""Job processes: each job is its own `ember run` (the service never imports torch), started in
its own session with its output appended to a log, and known by PID *and* start time, so that
a PID the kernel reused for something else is never mistaken for the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ember.durable import open_append


@dataclass
class Spawned:
    pid: int
    start: str           # the process's start time in clock ticks since boot (/proc/PID/stat)
    popen: subprocess.Popen | None


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat, or None if there is no such process (or it is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def alive(pid: int | None, started: str | None) -> bool:
    """Whether the process that was started as (pid, started) still runs."""
    return pid is not None and started is not None and start_time(pid) == started


def run_argv(recipe: str, out: str, overrides: list[str], ledger: Path, restarts: int) -> list[str]:
    """`ember run` for a job: supervised, so a crash restarts with the supervisor's backoff."""
    argv = [sys.executable, "-m", "ember", "run", recipe, "--out", out, "--ledger", str(ledger),
            "--restarts", str(restarts)]
    for item in overrides:
        argv += ["--set", item]
    return argv


def spawn(argv: list[str], log: Path, env: dict[str, str]) -> Spawned:
    """Start a job process in a new session (a signal to the service's group never reaches it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open_append(log) as f:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, **env})
    return Spawned(p.pid, start_time(p.pid) or "", p)


def signal_job(pid: int, started: str | None, sig: signal.Signals) -> bool:
    """Send `sig` to the job's process if it is still that process."""
    if not alive(pid, started):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def kill_tree(pid: int | None, started: str | None) -> bool:
    """SIGKILL the job's process and its descendants (its supervised child runs in a session of
    its own, so a process-group kill would miss it). The root first: killed after its children, it
    could see one die and act on it (exit on its own, or a supervisor restart it) before its turn."""
    import psutil
    if not alive(pid, started):
        return False
    try:
        root = psutil.Process(pid)
        tree = [root] + root.children(recursive=True)
    except psutil.Error:
        return False
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    return True
