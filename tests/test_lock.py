"""The run folder's lock (ember.lock) is its holder's alone, and a refusal names who really holds
it (issue 26, items 1 and 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ember.errors import EmberError
from ember.lock import acquire
from tests.helpers import ROOT

# A process that holds `path`'s flock and writes `pid` into it as its holder (an older ember
# whose forked worker kept the lock after it died looks exactly like this), then waits.
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, (sys.argv[2] if len(sys.argv) > 2 else str(os.getpid())).encode() + b"\\n", 0)
print("held", flush=True)
sys.stdin.read()
"""


def hold(path, pid: str | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), *([pid] if pid else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline() == "held\n"
    return proc


def ended_pid() -> int:
    """The PID of a process that has ended (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """A data-loader worker is forked from the training process; when the training process is
    gone (here: it lets go), the folder is free although the worker still runs."""
    path = tmp_path / ".lock"
    lock = acquire(path, "--out x")
    r, w = os.pipe()
    started_r, started_w = os.pipe()
    child = os.fork()
    if child == 0:  # the worker: says it runs (its fork handlers have run), waits until told to go
        os.close(w)
        os.write(started_w, b"x")
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(started_w)
    assert os.read(started_r, 1) == b"x"  # the child runs: what it inherited is settled
    os.close(started_r)
    try:
        lock.release()
        again = acquire(path, "--out x")  # refused while the child lived, before the fix
        again.release()
    finally:
        os.close(w)
        os.waitpid(child, 0)


def test_a_refusal_names_the_live_holder_its_command_and_since_when(tmp_path):
    path = tmp_path / ".lock"
    holder = hold(path)
    try:
        with pytest.raises(EmberError) as e:
            acquire(path, "--out x")
        message = str(e.value)
        assert f"PID {holder.pid} (" in message and "running since" in message, message
        assert "-c" in message, message  # its command line
        assert message.startswith("--out x: in use by another ember process"), message
    finally:
        holder.kill()
        holder.wait()


def test_a_refusal_never_names_a_dead_process_as_the_holder(tmp_path):
    """The PID in the lock file ended; what still holds the lock is named instead."""
    path = tmp_path / ".lock"
    dead = ended_pid()
    holder = hold(path, str(dead))
    try:
        with pytest.raises(EmberError) as e:
            acquire(path, "--out x")
        message = str(e.value)
        assert f"(PID {dead}) has ended" in message, message
        assert f"PID {holder.pid} (" in message and "still holds its lock" in message, message
        assert "in use by another ember process (PID" not in message, message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    acquire(path, "--out x").release()  # and the holder's end frees it


def test_a_rerun_waits_for_a_killed_holder_to_finish_exiting(tmp_path, monkeypatch):
    """A SIGKILLed holder keeps the lock until its exit releases its files, after its memory;
    meanwhile /proc lists no descriptor of it, and no process seems to hold the lock. `ember run`
    right after a kill -9 refused then ("has ended, and no process this user can see holds its
    lock", seen in the suite under load: tests/e2e/test_rerun.py's supervised case); it now
    waits for the exit (ember.lock.EXITING) and takes the lock."""
    import threading

    from ember import lock
    path = tmp_path / ".lock"
    holder = hold(path)
    monkeypatch.setattr(lock, "holders_of", lambda p: [])  # the exit window: /proc shows no holder
    threading.Timer(0.3, holder.stdin.close).start()  # the holder's exit completes: the lock is free
    try:
        acquire(path, "--out x").release()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


@pytest.mark.parametrize("target", ["a file", "nothing yet"])
def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_what_it_names_is_left_alone(tmp_path, target):
    """A run folder someone else made with `.lock` a link to a file elsewhere (a folder holding
    only .lock is accepted as a run's start): `ember run --out` there followed the link,
    truncated the file and wrote its PID into it, or created the file it named (run as root:
    any file on the machine)."""
    precious = tmp_path / "elsewhere" / "precious"
    precious.parent.mkdir()
    if target == "a file":
        precious.write_text("keep me\n")
    path = tmp_path / ".lock"
    path.symlink_to(precious)
    with pytest.raises(EmberError, match=r"--out x: its lock file .*\.lock is a symbolic link"):
        acquire(path, "--out x")
    assert (precious.read_text() == "keep me\n") if target == "a file" else not precious.exists()


@pytest.mark.parametrize("kind", ["hard link", "fifo"])
def test_a_lock_file_that_is_a_hard_link_or_no_regular_file_is_refused_and_left_alone(tmp_path, kind):
    """`.lock` a hard link to a file elsewhere (O_NOFOLLOW stops symbolic links only): `ember run
    --out` truncated that file and wrote its PID into it (run as root: any file on the same file
    system). A FIFO was opened and "locked" as if it were the lock file."""
    path = tmp_path / ".lock"
    precious = tmp_path / "precious"
    if kind == "hard link":
        precious.write_text("keep me\n")
        os.link(precious, path)
        says = r"is a hard link \(the file has 2 names\), which ember does not write into"
    else:
        os.mkfifo(path)
        says = "is not a regular file, which ember does not write into"
    with pytest.raises(EmberError, match=r"--out x: its lock file .*\.lock " + says):
        acquire(path, "--out x")
    assert kind != "hard link" or precious.read_text() == "keep me\n"


@pytest.mark.parametrize("recorded", ["²", "٣", "12²"])
def test_a_lock_file_naming_no_ascii_pid_says_it_names_no_holder(tmp_path, recorded):
    """The lock file names its holder's PID; read with str.isdigit alone, a damaged one saying
    '²' passed and int() raised a ValueError traceback where the refusal should say who holds it."""
    from ember.lock import who_holds
    path = tmp_path / ".lock"
    path.write_text(recorded)
    assert "its lock file names no holder" in who_holds(path, recorded)
