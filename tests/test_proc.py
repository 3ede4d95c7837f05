"""ember.proc's worker signals: a worker ends on its parent's SIGTERM (a shutdown ending a
straggler) and ignores one sent by anyone else (a stop sent to the whole group), also one that
came before it set itself up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ember.proc import born_blocking
from tests.helpers import ROOT

WORKER = """
import sys
from ember.proc import ended_only_by
print("started", flush=True)
assert sys.stdin.readline() == "set up\\n"
ended_only_by(int(sys.argv[1]))
print("ready", flush=True)
for line in sys.stdin:
    print("alive", flush=True)
"""


def start_worker() -> subprocess.Popen:
    """A worker of this process, born with SIGTERM blocked; it sets itself up when told."""
    with born_blocking(signal.SIGTERM):
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(os.getpid())], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert worker.stdout.readline() == "started\n"
    return worker


def from_elsewhere(pid: int) -> None:
    """SIGTERM to `pid` sent by another process (as a group signal is: kill(1), not us)."""
    subprocess.run(["kill", "-TERM", str(pid)], check=True)


def sigterm_pending(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd", "ShdPnd"))]
    return any(mask & 1 << (signal.SIGTERM - 1) for mask in pending)


def taken(worker: subprocess.Popen) -> None:
    """Wait until the worker took the SIGTERMs sent to it (none pending), then ask it to answer."""
    deadline = time.monotonic() + 60
    while sigterm_pending(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sigterm_pending(worker.pid), "the worker never took its SIGTERM"
    worker.stdin.write("still there?\n")
    worker.stdin.flush()


def test_a_worker_ignores_a_sigterm_from_elsewhere_and_ends_on_its_parents():
    worker = start_worker()
    try:
        # one before it set itself up (waits, blocked since its birth), one after
        from_elsewhere(worker.pid)
        worker.stdin.write("set up\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == "ready\n"
        from_elsewhere(worker.pid)
        taken(worker)
        assert worker.stdout.readline() == "alive\n"
        worker.send_signal(signal.SIGTERM)  # from its parent: a shutdown ending a straggler
        assert worker.wait(timeout=60) == -signal.SIGKILL
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
