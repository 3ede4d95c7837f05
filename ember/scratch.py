"""Private working folders under $EMBER_HOME/scratch, each held by the process that made it.

`with scratch("doctor-") as folder:` makes a new folder, holds the lock in it (ember.lock: a
flock the kernel drops however the process ends) for the block's length, and removes the folder
after. A process killed inside the block (SIGKILL, a power cut) cannot remove its folder; the
next folder made under the same $EMBER_HOME does: each one made first removes every folder whose
lock no process holds any more.

Only this host's folders are judged (their names end with `.HOST`): a $EMBER_HOME shared over
NFS by the nodes of a distributed run holds every node's, and a flock need not be seen across
hosts (NFS mounted with local_lock), so another host's live folder could look free from here.

A folder is locked microseconds after it is made, so one whose lock is free is only removed once
it is older than STALE_AFTER (its last change, not its birth: a dead owner changes nothing). A
folder with no lock file at all (made by an ember before this module, or whose owner died
between making it and locking it) is removed once older than UNLOCKED_AFTER: an older ember that
still runs might be using it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ember.lock import Lock, acquire
from ember.paths import home

LOCK = ".lock"
STALE_AFTER = 60.0               # seconds since a free folder last changed
UNLOCKED_AFTER = 24 * 3600.0     # seconds since a folder without a lock file last changed


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A new folder under $EMBER_HOME/scratch (on the same disk as the runs' caches), held by this
    process while the block runs and removed after it; stale folders of dead owners go first."""
    folder, lock = _made(prefix)
    try:
        yield folder
    finally:
        _removed(folder, lock)


def for_this_process(prefix: str) -> Path:
    """A scratch folder held until this process ends: removed at its exit, and by the next folder
    made (`reap`) once a SIGKILL or a power cut ended it. A child forked from this process gets
    its own if it asks, and its exit removes only that: the exit handler it inherits checks
    whose process it runs in."""
    pid = os.getpid()
    with _FOR_LIFE_LOCK:
        if (pid, prefix) not in _FOR_LIFE:
            folder, lock = _made(prefix)
            _FOR_LIFE[pid, prefix] = folder
            atexit.register(_end_of_life, pid, folder, lock)
        return _FOR_LIFE[pid, prefix]


_FOR_LIFE: dict[tuple[int, str], Path] = {}
_FOR_LIFE_LOCK = threading.Lock()


def _end_of_life(pid: int, folder: Path, lock: Lock) -> None:
    if os.getpid() == pid:
        _removed(folder, lock)


def _made(prefix: str) -> tuple[Path, Lock]:
    """A new folder, locked, once the stale ones are gone."""
    root = home().scratch
    root.mkdir(parents=True, exist_ok=True)
    reap(root)
    folder = Path(tempfile.mkdtemp(prefix=prefix, suffix=_host_suffix(), dir=root))
    try:
        return folder, acquire(folder / LOCK, f"the scratch folder {folder}")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _removed(folder: Path, lock: Lock) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    lock.release()


def reap(root: Path) -> None:
    """Remove the folders under `root` that no live process holds (see the module's docstring)."""
    now, mine = time.time(), _host_suffix()
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return
    for entry in entries:
        age = 0.0
        try:
            if not entry.is_dir(follow_symlinks=False) or ("." in entry.name and not entry.name.endswith(mine)):
                continue  # not a folder, or another host's (a folder without a host is an older ember's)
            age = now - entry.stat(follow_symlinks=False).st_mtime
            if age < STALE_AFTER:
                continue
            # Open for writing, as its owner did: where NFS makes flock a POSIX lock, an
            # exclusive one needs a file open for writing.
            fd = os.open(Path(entry.path) / LOCK, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:  # no lock file (or the folder went meanwhile)
            if age >= UNLOCKED_AFTER and os.path.isdir(entry.path):
                shutil.rmtree(entry.path, ignore_errors=True)
            continue
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EACCES, errno.ENOTDIR):
                continue  # not a lock file ember wrote, or not ours to open: left alone
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner lives (EWOULDBLOCK); or no lock to be had here (ENOLCK): kept
            continue
        else:  # held by us now, so no other reaper removes it meanwhile
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def _host_suffix() -> str:
    return "." + (re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host")
