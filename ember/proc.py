"""This process: when it started (the start of an attempt's wall-clock, imports included), and
that what it starts does not outlive it.

    process_start_time()          Unix time the kernel started this process
    described(pid)                "PID 123 (its command line, running since 14:07:12)", or None if gone
    holders_of(path)              the live processes (of this user) with `path` open
    die_with_parent(sig, parent)  in a child: Linux sends `sig` when the parent goes (PR_SET_PDEATHSIG)
    dies_with_us(sig)             a Popen preexec_fn that does that for the child it starts
    born_blocking(sig)            a block in which the children started are born with `sig` blocked
    ended_only_by(parent, sig)    in a worker: `sig` ends it when `parent` sends it, else is ignored

A child of ember that has no use once its parent is gone (the inference worker of a service, the
training process of a supervisor, a tokenization worker) asks the kernel for a signal at its
parent's death: a SIGKILLed parent leaves no orphan holding gigabytes. (The signal comes when the
*thread* that started the child ends: ember starts these from threads that live as long as the
child is needed.) The jobs of `ember serve` are not among them: they outlive a service that dies,
which adopts them when it starts again.

A stop signal sent to a whole process group or cgroup (systemd, Slurm's `scancel --signal`, a
container runtime, `kill -TERM -PGID`) reaches a run's worker processes (DataLoader workers,
the tokenization pool) as well as the run. The run decides what a stop means (ember.train.signals:
a checkpoint, exit 75) and ends its workers itself; a worker that died of the signal instead
would crash it (torch raises "DataLoader worker is killed by signal" wherever the training
thread is, a checkpoint's fsync included). But a worker cannot simply ignore SIGTERM: its
parent's own shutdown ends stragglers with SIGTERM (torch's DataLoader `_shutdown_workers`,
multiprocessing's exit handler, a broken ProcessPoolExecutor) and then joins them, without a
timeout in the last two, so an ignored SIGTERM there is a hang. Hence `ended_only_by`: the
worker tells the two apart by the sender the kernel records (si_pid), not by a guess.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PR_SET_PDEATHSIG = 1


def process_start_time() -> float:
    """Unix time at which the kernel started this process (Linux /proc), else now."""
    return _started("self") or time.time()


def _started(pid: int | str) -> float | None:
    """Unix time at which the kernel started `pid` (Linux /proc); None for no such live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):  # a zombie holds nothing and runs nothing
            return None
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Age from two boot-relative clocks (10 ms resolution); btime would be whole seconds.
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def described(pid: int) -> str | None:
    """'PID 123 (python -m ember run ..., running since 14:07:12)' for a live process, else None."""
    started = _started(pid)
    if started is None:
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = " ".join(f.read().decode(errors="replace").replace("\0", " ").split())
    except OSError:
        command = ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    return f"PID {pid} ({command[:160] or 'command unknown'}, running since {since})"


def holders_of(path: Path) -> list[int]:
    """The PIDs of the live processes that have `path` open (those this user may inspect),
    this one excluded: who keeps an advisory lock on it, whoever took the lock."""
    try:
        st = path.stat()
    except OSError:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
            with fds:
                for fd in fds:
                    target = os.stat(fd.path)  # follows the link to the open file
                    if (target.st_dev, target.st_ino) == (st.st_dev, st.st_ino):
                        found.append(int(entry.name))
                        break
        except OSError:  # gone meanwhile, another user's, or not Linux
            continue
    return sorted(found)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent ends; if `parent` (the PID that
    started it) is already gone, send it now. A no-op where prctl(2) is missing (not Linux)."""
    prctl = _prctl()
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if parent is not None and os.getppid() != parent:  # it ended before the request was in place
        os.kill(os.getpid(), sig)


def dies_with_us(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when this process ends. (prctl is
    looked up here, in the parent: the child between fork and exec only calls it.)"""
    parent = os.getpid()
    _prctl()
    return lambda: die_with_parent(sig, parent)


@contextlib.contextmanager
def born_blocking(sig: int = signal.SIGTERM) -> Iterator[None]:
    """Block `sig` in this thread for the block's length: the children it starts meanwhile (fork,
    or spawn: exec keeps the mask) are born with it blocked, so one sent to the group before a
    child ran its start-up code (`ended_only_by`) waits for it instead of killing it. Here a `sig`
    that came meanwhile is handled when the block ends (or at once by a thread not blocking it)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ended_only_by(parent: int, sig: int = signal.SIGTERM) -> None:
    """In a worker process: `sig` sent by `parent` ends it at once (SIGKILL, as the parent's
    terminate() intends); sent by anyone else (a signal to the whole group) it is ignored, as the
    parent has it too and ends its workers itself. Called by the main thread, before it starts
    threads (they inherit its mask), in a process born with `sig` blocked (`born_blocking`): a
    thread that an import started already would otherwise take `sig` as before."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})  # none delivered: each waits for the judge below
    threading.Thread(target=_judge, args=(parent, sig), name=f"{signal.Signals(sig).name} judge",
                     daemon=True).start()


def _judge(parent: int, sig: int) -> None:
    while True:
        if signal.sigwaitinfo({sig}).si_pid == parent:  # sigwaitinfo takes a pending one too
            os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
