"""This process: when it started (the start of an attempt's wall-clock, imports included), and
that what it starts does not outlive it.

    process_start_time()          Unix time the kernel started this process
    die_with_parent(sig, parent)  in a child: Linux sends `sig` when the parent goes (PR_SET_PDEATHSIG)
    dies_with_us(sig)             a Popen preexec_fn that does that for the child it starts

A child of ember that has no use once its parent is gone (the inference worker of a service, the
training process of a supervisor, a tokenization worker) asks the kernel for a signal at its
parent's death: a SIGKILLed parent leaves no orphan holding gigabytes. (The signal comes when the
*thread* that started the child ends: ember starts these from threads that live as long as the
child is needed.) The jobs of `ember serve` are not among them: they outlive a service that dies,
which adopts them when it starts again.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def process_start_time() -> float:
    """Unix time at which the kernel started this process (Linux /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Age from two boot-relative clocks (10 ms resolution); btime would be whole seconds.
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


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


@functools.cache
def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
