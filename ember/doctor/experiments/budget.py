"""When the doctor's experiments stop: --budget as a deadline on the whole command, each
experiment's share of what is left (`Budget`), and the stop condition of one comparison, its
time and its confidence (`Stop`)."""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ember.doctor.diagnose import Difference
from ember.errors import EmberError

# Each experiment's share of the time left when it starts, against those still to run.
SHARES = {"baseline": 0.30, "checkpoint": 0.15, "contention": 0.15, "input": 0.10, "sweep": 0.15,
          "loader": 0.05, "profile": 0.05, "ddp": 0.60}
MIN_SAMPLES = 3  # per side of a comparison: fewer is no evidence (diagnose.difference)
# A comparison may stop early once its effect's 98% interval (diagnose.difference) is narrower
# than this share of the step, over at least SETTLE_ROUNDS rounds: the ranking needs a saving
# to within a few percent of the step (a cause counts from diagnose.THRESHOLD, 10%), and a
# bootstrap over fewer rounds can look tight by chance.
PRECISION = 0.04
SETTLE_ROUNDS = 6
MAX_ALARM_SECONDS = 1e8  # about three years: hard_deadline's longest alarm


@dataclass(frozen=True)
class Stop:
    """When one experiment stops: at `until` (time.monotonic()), or once the effect it measures
    is known to within `tolerance` seconds a step (its interval's width), whichever comes first."""
    until: float
    tolerance: float = 0.0  # 0: at `until` only

    def left(self) -> float:
        """Seconds to `until`, never below 0."""
        return max(0.0, self.until - time.monotonic())

    def fits(self, seconds: float) -> bool:
        """Whether `seconds` of work started now ends by `until`."""
        return time.monotonic() + seconds <= self.until

    def settled(self, d: Difference, rounds: int, least: int = SETTLE_ROUNDS) -> bool:
        """Whether effect `d`, measured over `rounds` rounds (at least `least`), is known well enough."""
        return rounds >= least and d.high - d.low < self.tolerance


class Budget:
    """--budget as a deadline on the whole command, and each experiment's share of what is left."""

    def __init__(self, seconds: float, started: float, reserve: float, startup: float):
        self.seconds, self.started = seconds, started  # started: time.monotonic() when the clock began
        self.deadline = started + seconds - reserve  # the reserve is for the output after the experiments
        self.startup = startup  # seconds this process took to reach the clock (interpreter, CLI imports)
        self.shares = dict(SHARES)
        self.pending: list[str] = []  # the experiments still to run, this one included

    def left(self) -> float:
        """Seconds to the deadline (negative past it)."""
        return self.deadline - time.monotonic()

    def share(self, names: list[str]) -> float:
        """Seconds for experiments `names`: their shares of what is left, against those pending."""
        return max(0.0, self.left()) * sum(self.shares[n] for n in names) / sum(self.shares[p] for p in self.pending)

    def stop(self, name: str, tolerance: float = 0.0) -> Stop:
        """Experiment `name`'s stop condition: its share of the time left, and `tolerance` (seconds)."""
        return Stop(time.monotonic() + self.share([name]), tolerance)

    def done(self, name: str) -> None:
        """Experiment `name` ran (or was skipped): the others share what is left."""
        self.pending.remove(name)


class BudgetExhausted(EmberError):
    """--budget ran out before the doctor had measured anything it could report."""


@contextmanager
def hard_deadline(deadline: float, what: str, budget: Budget) -> Iterator[None]:
    """Stop whatever runs at `deadline` (time.monotonic()) with BudgetExhausted: for the parts
    with no estimate of their own, loading the model and the first steps. SIGALRM, so only in
    the main thread (elsewhere the budget holds from the first step on). What it interrupts is
    safe to drop: the scratch job goes, and $EMBER_HOME's caches are replaced atomically."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        used = time.monotonic() - budget.started
        raise BudgetExhausted(f"--budget {budget.seconds:g}: used up while {what} ({budget.startup:.1f} s of "
                              f"start-up, then {used:.1f} s); nothing was measured. Give a larger --budget "
                              f"(at least {math.ceil(2 * (used + budget.startup) + 5)} s here)")
    previous = signal.signal(signal.SIGALRM, expire)
    # setitimer refuses an interval past the platform's time_t (about 1e12 s here); a deadline
    # further off than MAX_ALARM_SECONDS never comes, so the alarm is set no later than that.
    signal.setitimer(signal.ITIMER_REAL, min(MAX_ALARM_SECONDS, max(1e-3, deadline - time.monotonic())))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
