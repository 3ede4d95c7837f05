"""Supervised restarts: `ember run --restarts N` runs the training in a child process and
restarts it from its last durable checkpoint after a crash.

    child exit 0           completed: done
    child exit 75          interrupted on request: not a crash, not restarted; exit 75
    other exit, or signal  a crash: wait, restart; more than N crashes within an hour: give up

The wait doubles from train.restart_backoff_seconds (at most 5 minutes) with each crash in a
row that committed no new checkpoint: a crash loop backs off, while a run that was making
progress (preempted, killed, the power cut) comes back after the base wait however often it
happens.

Signals to the supervisor (SIGINT, SIGTERM, SIGUSR1, SIGHUP) are forwarded to the child, which runs in
its own session so that a terminal's Ctrl-C reaches it once, through the supervisor.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from ember.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK
from ember.events import Events
from ember.lock import Lock
from ember.proc import dies_with_us
from ember.train.signals import STOP_SIGNALS, StopRequest

WINDOW_SECONDS = 3600.0
MAX_BACKOFF_SECONDS = 300.0


@dataclass
class ChildRun:
    start: float
    end: float
    returncode: int
    advanced: bool = False  # committed a checkpoint newer than the one it started from

    @property
    def cause(self) -> str:
        if self.returncode == EXIT_OK:
            return "completed"
        if self.returncode == EXIT_INTERRUPTED:
            return "interrupted (exit 75)"
        if self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        return f"exit {self.returncode}"


def backoff(crash_number: int, base: float) -> float:
    """Seconds to wait before restart number `crash_number` (1-based)."""
    return min(MAX_BACKOFF_SECONDS, base * 2 ** (crash_number - 1))


def quick_crashes(runs: list[ChildRun]) -> int:
    """Crashes without progress in a row at the end of `runs` (at least 1: the last crash)."""
    n = 0
    for r in reversed(runs):
        if r.returncode in (EXIT_OK, EXIT_INTERRUPTED) or r.advanced:
            break
        n += 1
    return max(1, n)


def supervise(child_argv: list[str], restarts: int, base_backoff: float, events: Events,
              progress: Callable[[], int] = lambda: 0, lock: Lock | None = None,
              stop: StopRequest | None = None) -> int:
    """`progress()`: the newest committed checkpoint's step, to tell progress from a crash loop.
    `lock`: the run folder's, handed to each child (ember.lock). `stop`: the command's own stop
    handlers, installed before this began: a signal they caught means no child is started. A
    child that dies of the stop signal it was sent (before its own handlers were in place) was
    stopped, not crashed: exit 75, as a child that checkpointed."""
    runs: list[ChildRun] = []
    child: subprocess.Popen | None = None
    stopping = stop is not None and stop.requested  # no child is started then (the loop's first check)

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        while True:
            if stopping:  # asked to stop before this child started (during a back-off, say)
                code = EXIT_INTERRUPTED
                break
            start, before = time.time(), progress()
            # SIGTERM when the supervisor dies, even by SIGKILL: the child checkpoints and exits 75
            with lock.handed_down() if lock is not None else contextlib.nullcontext({}) as passed:
                child = subprocess.Popen(child_argv, start_new_session=True,
                                         preexec_fn=dies_with_us(signal.SIGTERM), **passed)
            code = child.wait()
            runs.append(ChildRun(start, time.time(), code, progress() > before))
            if code in (EXIT_OK, EXIT_INTERRUPTED) or stopping:
                if stopping and code < 0:  # it died of the signal forwarded to it: stopped, resumable
                    code = EXIT_INTERRUPTED
                break
            recent = [r for r in runs if r.returncode not in (EXIT_OK, EXIT_INTERRUPTED)
                      and r.end > time.time() - WINDOW_SECONDS]
            if len(recent) > restarts:
                events.warn(f"giving up: {len(recent)} crashes within {WINDOW_SECONDS / 60:.0f} minutes "
                            f"(--restarts {restarts})")
                code = EXIT_ERROR
                break
            wait = backoff(quick_crashes(runs), base_backoff)
            events.warn(f"attempt {len(runs)} crashed ({runs[-1].cause}); restarting from the last "
                        f"durable checkpoint in {wait:.1f} s ({len(recent)}/{restarts} crashes used)")
            time.sleep(wait)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if runs:
        events.info("supervised attempts:\n" + "\n".join(f"  {i}: {r.end - r.start:7.1f} s  {r.cause}"
                                                          for i, r in enumerate(runs, 1)))
    return code

