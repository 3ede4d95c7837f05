"""An advisory lock held for the life of a process: a run folder has one process at a time.

`flock` on a lock file: the kernel drops the lock when the process dies however it dies (SIGKILL,
a power cut), so a lock is never stale. The holder's PID is written into the file so a refusal
can name it.

A flock belongs to the open file description, and a forked child shares its parent's: a
data-loader worker forked from the training process would keep the folder locked after the
training process is SIGKILLed, for as long as it lives. So the lock is the holder's alone: the
descriptor is close-on-exec, and every child forked from the holder closes it as it starts
(os.register_at_fork), whatever forks it (multiprocessing, torch's DataLoader, os.fork).

A supervisor hands its lock to the child it starts, on purpose (`Lock.handed_down()` around the
start; the child inherits the open file description, and `EMBER_LOCK_FD` names the descriptor),
so the folder stays locked across restarts. The ranks of a distributed run are torchrun's
grandchildren and inherit no descriptor: their launcher holds the lock, and `EMBER_LOCK_LAUNCHER`
names its PID, which the ranks check against the PID written in the lock file while the lock is
held.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ember.errors import EmberError
from ember.proc import described, holders_of
from ember.paths import NotOwnFile, ascii_digits, open_own_file

INHERITED = "EMBER_LOCK_FD"
# A SIGKILLed holder keeps its lock until its exit has released its files, after its memory:
# meanwhile /proc shows it with no descriptors, and no process seems to hold the lock. A rerun
# at once waits for that (milliseconds; longer for a large process on a busy machine), this long.
EXITING = 10.0
LAUNCHER = "EMBER_LOCK_LAUNCHER"  # the PID of the distributed launcher that holds the lock

_held: set[int] = set()  # this process's lock descriptors: closed in every child it forks


def _close_in_child() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's copy only: the parent's lock stays as it was
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


@dataclass
class Lock:
    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:  # -1: held by the launcher, not by this process
            _held.discard(self.fd)
            os.close(self.fd)  # closing the last descriptor of the description drops the lock

    @contextlib.contextmanager
    def handed_down(self) -> Iterator[dict]:
        """Around starting a child that is to share this lock (a supervisor's training process):
        the Popen arguments that pass the descriptor, which the fork then keeps."""
        _held.discard(self.fd)
        try:
            yield {"pass_fds": (self.fd,), "env": {**os.environ, INHERITED: str(self.fd)}}
        finally:
            _held.add(self.fd)


def acquire(path: Path, what: str, wait: Callable[[str], None] | None = None) -> Lock:
    """Hold the lock at `path` or raise, naming the process that holds it. `what` names the
    thing locked in the error ("--out runs/a"). With `wait`, a held lock is waited for instead:
    `wait(holder PID)` is called once, then this blocks until the holder is done (or dead)."""
    inherited = _inherited(path)
    if inherited is not None:
        return inherited
    try:  # never through a link: this process truncates the file and writes its PID into it
        fd = open_own_file(path, os.O_RDWR | os.O_CREAT)
    except NotOwnFile as e:
        raise EmberError(f"{what}: its lock file {path} is {e.strerror}, which ember does not write into "
                         f"(its PID would overwrite what the file also is); remove it, or use another folder") from None
    except OSError as e:
        if e.errno != errno.ELOOP or not path.is_symlink():
            raise
        raise EmberError(f"{what}: its lock file {path} is a symbolic link (to {os.readlink(path)}), which "
                         f"ember does not follow: it would write into what the link names; remove the link, "
                         f"or use another folder") from None
    deadline = time.monotonic() + EXITING
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return _own(path, fd)
        except BlockingIOError:
            holder = _recorded(fd)
        if wait is not None:
            wait(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
            return _own(path, fd)
        if holder == os.environ.get(LAUNCHER):  # our launcher holds it for us (it is held: flock failed)
            os.close(fd)
            return Lock(path, -1)
        if holders_of(path) or time.monotonic() > deadline:
            break  # a process holds it; else the holder is exiting (or let go since): again, shortly
        time.sleep(0.02)
    os.close(fd)
    raise EmberError(f"{what}: {who_holds(path, holder)}; wait for it to finish or stop it, "
                     f"or use another folder")


def _own(path: Path, fd: int) -> Lock:
    """Write this process's PID into the lock file it now holds, and keep it from its children."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held.add(fd)
    return Lock(path, fd)


def _recorded(fd: int) -> str:
    """The PID the holder wrote into the lock file, as written ('unknown' if none)."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def who_holds(path: Path, recorded: str) -> str:
    """Which live process holds the lock at `path`, whose file names `recorded` as its holder:
    that process while it lives; else that it has ended, and what still has the file open."""
    others = holders_of(path)
    numeric = ascii_digits(recorded)  # what the lock file says may be damaged: not "²"
    if numeric and int(recorded) in others and (holder := described(int(recorded))):
        return f"in use by another ember process, {holder}"
    ended = f"the ember process that locked it (PID {recorded}) has ended" if numeric \
        else "its lock file names no holder"
    still = [d for pid in others if (d := described(pid))]
    if still:
        return f"locked: {ended}, but {'; '.join(still)} still holds its lock"
    return f"locked: {ended}, and no process this user can see holds its lock (another user's?)"


def _inherited(path: Path) -> Lock | None:
    """The lock a supervising parent passed down for this very file, if any."""
    value = os.environ.get(INHERITED)
    if not value:
        return None
    try:
        fd = int(value)
        mine, theirs = os.fstat(fd), os.stat(path)
        same = (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)  # an inode number is per disk
    except (ValueError, OSError):
        return None
    if not same:
        return None
    os.set_inheritable(fd, False)  # passed to this process; not on to what it starts in turn
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already: the same open file description
    return _own(path, fd)
