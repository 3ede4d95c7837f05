"""Two-phase checkpoints: the training thread takes a snapshot into host memory (phase one,
blocking), a background thread persists it with the store's atomic commit (phase two).

One thread, not a process, and not a pool: the persist is O_DIRECT write syscalls from the
snapshot's page-aligned file images, CRC32C and fsync, all of which release the GIL, and a
thread needs no second copy of the snapshot through a pipe. Its CPU time is small (0.3 s for a
1.6 GB state: the checksum and the system calls), but on a machine whose cores all train, the
steps beside it slow down far more than that (bench/README.md): each of its wake-ups preempts a
training thread the others then wait for. Its niceness ([checkpoint] persist_nice, default 13)
trades that slowdown against how soon the checkpoint is durable. Its I/O runs at the lowest
best-effort priority, so the steps' own reads (data, swap) go first; the retired checkpoint's
deletion inherits both. The files are written one after the other (the disk streams one file
faster than several interleaved). At most one persist is in flight; a checkpoint due while one
persists waits for it, and the wait counts as checkpoint time. `wait()` finishes the pending
persist (on exit, on a signal, before the final weights), and re-raises its error, if it
failed, in the training thread.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ember.ckpt.contents import Snapshot, write_snapshot
from ember.ckpt.store import Checkpoint, CheckpointStore


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30, "ppc64le": 273, "s390x": 282,
               "riscv64": 30}.get(platform.machine())
_IOPRIO_WHO_PROCESS, _IOPRIO_CLASS_BE, _IOPRIO_LOWEST = 1, 2, 7


DEFAULT_NICE = 13  # the recipe's default ([checkpoint] persist_nice)


def lower_priority(nice: int) -> None:
    """Run this thread (and the threads it starts, which inherit it) at `nice`. On 2 cores that
    both train, a 1.6 GB persist costs the steps beside it about 1.7 s in all, whatever its
    niceness: at 10 they are 50% slower for 1.6x the persist's standalone time, at 13 36% for
    1.8x, at 16 17% for 2.8x (bench/README.md). Its I/O goes at best-effort level 7, the lowest
    that is never starved (the idle class waits for a disk with nothing else to do, which a
    training run reading its data may never leave); it counts where the disk's scheduler
    honours it (bfq, mq-deadline)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass
    if _IOPRIO_SET is None or not sys.platform.startswith("linux"):
        return  # no ioprio_set here: I/O at the process's priority
    libc = ctypes.CDLL(None, use_errno=True)
    # A refusal (a kernel without it, a seccomp filter) leaves normal I/O priority: only slower.
    libc.syscall(_IOPRIO_SET, _IOPRIO_WHO_PROCESS, tid, (_IOPRIO_CLASS_BE << 13) | _IOPRIO_LOWEST)


@dataclass
class Persisted:
    checkpoint: Checkpoint
    blocked: float          # seconds training was blocked for it (waiting + snapshot; + persist if synchronous)
    to_durable: float       # seconds from the checkpoint's start (before the wait) until the commit was durable
    submitted: float        # time.time() when the snapshot was handed over
    durable: float          # time.time() when the commit was durable


class CheckpointWriter:
    def __init__(self, store: CheckpointStore, background: bool, nice: int = DEFAULT_NICE):
        self.store, self.background, self.nice = store, background, nice
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: list[Persisted] = []

    def submit(self, step: int, snap: Snapshot, meta: dict[str, Any], blocked: float) -> None:
        """Persist `snap` as checkpoint `step` (in the background, or now). Call wait() first."""
        assert self._thread is None, "one persist at a time: wait() before taking a snapshot"
        args = (step, snap, meta, blocked, time.time())
        if not self.background:
            self._persist(*args)
            self._raise()
            return
        self._thread = threading.Thread(target=self._persist, args=args, name=f"ember-ckpt-{step}",
                                        daemon=True)
        self._thread.start()

    def _persist(self, step: int, snap: Snapshot, meta: dict[str, Any], blocked: float,
                 submitted: float) -> None:
        if self.background:
            lower_priority(self.nice)
        try:
            ck = self.store.save(step, lambda folder: write_snapshot(folder, snap), meta)
            durable = time.time()
            to_durable = blocked + durable - submitted
            # A synchronous persist ran in the training thread: training was blocked all along.
            self._done.append(Persisted(ck, blocked if self.background else to_durable, to_durable,
                                        submitted, durable))
        except BaseException as e:  # handed to the training thread by wait()
            self._error = e

    def wait(self) -> float:
        """Block until no persist is in flight (the retired checkpoint's deletion included); raise
        its error if it failed. Returns seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()
        self.store.settle()
        return time.perf_counter() - t0

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def completed(self) -> list[Persisted]:
        """Persists finished since the last call (for the ledger, in the training thread)."""
        done, self._done = self._done, []
        return done

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
