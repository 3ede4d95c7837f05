"""Two-phase checkpoints: the training thread takes a snapshot into host memory (phase one,
blocking), a background thread persists it with the store's atomic commit (phase two).

A thread, not a process: the persist is file writes, fsync and SHA-256, all of which release
the GIL, and a thread needs no second copy of the snapshot through a pipe. At most one persist
is in flight; a checkpoint due while one persists waits for it, and the wait counts as
checkpoint time. `wait()` finishes the pending persist (on exit, on a signal, before the final
weights), and re-raises its error, if it failed, in the training thread.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ember.ckpt.contents import Snapshot, write_snapshot
from ember.ckpt.store import Checkpoint, CheckpointStore


def _lower_priority() -> None:
    """Run this thread (and the hashing threads it starts, which inherit it) at nice 10, so on a
    machine whose cores all train, the persist yields most of the CPU to the steps instead of
    halving them, yet still becomes durable within seconds (nice 19 starved it for minutes on a
    busy CPU; bench/README.md has the figures)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


@dataclass
class Persisted:
    checkpoint: Checkpoint
    blocked: float          # seconds training was blocked for it (waiting + snapshot)
    submitted: float        # time.time() when the snapshot was handed over
    durable: float          # time.time() when the commit was durable


class CheckpointWriter:
    def __init__(self, store: CheckpointStore, background: bool):
        self.store, self.background = store, background
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
            _lower_priority()
        try:
            ck = self.store.save(step, lambda folder: write_snapshot(folder, snap), meta)
            self._done.append(Persisted(ck, blocked, submitted, time.time()))
        except BaseException as e:  # handed to the training thread by wait()
            self._error = e

    def wait(self) -> float:
        """Block until no persist is in flight; raise its error if it failed. Returns seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()
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
