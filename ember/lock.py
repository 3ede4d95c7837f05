"""An advisory lock held for the life of a process: a run folder has one process at a time.

`flock` on a lock file: the kernel drops the lock when the process dies however it dies (SIGKILL,
a power cut), so a lock is never stale. The holder's PID is written into the file so a refusal
can name it. A supervisor hands its lock to the child it starts (the child inherits the open file
description, and `EMBER_LOCK_FD` names the descriptor), so the folder stays locked across restarts.
The ranks of a distributed run are torchrun's grandchildren and inherit no descriptor: their
launcher holds the lock, and `EMBER_LOCK_LAUNCHER` names its PID, which the ranks check against
the PID written in the lock file while the lock is held.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ember.errors import EmberError

INHERITED = "EMBER_LOCK_FD"
LAUNCHER = "EMBER_LOCK_LAUNCHER"  # the PID of the distributed launcher that holds the lock


@dataclass
class Lock:
    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:  # -1: held by the launcher, not by this process
            os.close(self.fd)  # closing the last descriptor of the description drops the lock


def acquire(path: Path, what: str, wait: Callable[[str], None] | None = None) -> Lock:
    """Hold the lock at `path` or raise, naming the PID that holds it. `what` names the thing
    locked in the error ("--out runs/a"). With `wait`, a held lock is waited for instead:
    `wait(holder PID)` is called once, then this blocks until the holder is done (or dead)."""
    inherited = _inherited(path)
    if inherited is not None:
        return inherited
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        if wait is not None:
            wait(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return Lock(path, fd)
        os.close(fd)
        if holder == os.environ.get(LAUNCHER):  # our launcher holds it for us (it is held: flock failed)
            return Lock(path, -1)
        raise EmberError(f"{what}: in use by another ember process (PID {holder}); wait for it to "
                         f"finish or stop it, or use another folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return Lock(path, fd)


def _inherited(path: Path) -> Lock | None:
    """The lock a supervising parent passed down for this very file, if any."""
    value = os.environ.get(INHERITED)
    if not value:
        return None
    try:
        fd = int(value)
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except (ValueError, OSError):
        return None
    if not same:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already: the same open file description
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return Lock(path, fd)
