"""How long training stays paused after the last inference request ends: `[inference]
idle_gap_seconds`, a number (a fixed gap) or "auto" (chosen here from what the gate measured).

    choose(setting, Measured(idle_periods, pause_latency_p99)) -> Gap(seconds, rule)

The rule for "auto" is a ski-rental decision over the recent idle periods (the time from the
moment no request is in flight to the next arrival; the gate keeps the last IDLE_PERIODS).
Holding the pause for g seconds through an idle period of length I costs training min(I, g)
seconds. Resuming costs, when the next request then arrives while training runs (I > g), one
pause latency L: that request shares the device until the job stops after its micro-batch in
progress. Nothing of training is undone by that pause (the micro-batch finishes, the step goes
on where it stopped), so L, the request's wait, is the whole price of resuming too early.

    expected_cost(g) = mean over periods of  min(I, g) + [I > g] * HOLD_WEIGHT * L
    gap = the g in {0} + {each period <= CAP} with the least expected cost (ties: the smaller)

The least cost lies at 0 or at a period: between two periods the cost only grows with g (and
holding past the longest period <= CAP spares no request the wait: CAP bounds every hold).
L is the pause latency's p99, since the latency goal (inference p99 beside training <= 1.2x
alone) is broken by the slowest yields. HOLD_WEIGHT = 10 prices one second a request waits as
ten seconds of training: training is background work with slack (its goal is 0.9x of the idle
time) while a request is a person or a program waiting, and a request meeting running training
is the only way the pause scheme spends the latency goal. With L ~ 0.15 s (bench/README) the
break-even idle period is ~1.5 s: memoryless arrivals whose mean idle period is shorter than that
(Poisson at ~2 req/s) are held for, longer ones (~0.2 req/s) resume at once, and bursts are
held within and resumed between. Until MIN_PERIODS idle periods and one pause latency are
measured, the gap is DEFAULT_SECONDS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

IDLE_PERIODS = 64      # the recent idle periods the rule reads: a few minutes of a busy trace
MIN_PERIODS = 8        # fewer than this and the empirical distribution says too little
DEFAULT_SECONDS = 2.0  # the gap until then (the fixed default before "auto")
CAP = 10.0             # the longest hold: past it a request is no longer "soon"
HOLD_WEIGHT = 10.0     # one second a request waits for the yield, in seconds of training (above)


@dataclass(frozen=True)
class Measured:
    """What the gate measured: recent idle periods (seconds) and the pause latency's p99."""
    idle_periods: tuple[float, ...]
    pause_latency_p99: float | None


@dataclass(frozen=True)
class Gap:
    """The gap in use and how it was chosen ('fixed', 'auto (40 periods)', ...)."""
    seconds: float
    rule: str


def expected_cost(gap: float, periods: tuple[float, ...], price: float) -> float:
    """Mean cost of holding `gap` seconds per idle period: training seconds held, plus `price`
    for each period that outlasts the gap (the next request meets running training)."""
    return sum(min(i, gap) + (price if i > gap else 0.0) for i in periods) / len(periods)


def idle_gap(periods: tuple[float, ...], pause_latency: float, weight: float = HOLD_WEIGHT,
             cap: float = CAP) -> float:
    """The gap in [0, cap] with the least expected cost over `periods` (ties: the shorter)."""
    price = weight * pause_latency
    candidates = sorted({0.0, *(i for i in periods if i <= cap)})
    return min(candidates, key=lambda g: (expected_cost(g, periods, price), g))


def choose(setting: float | Literal["auto"], measured: Measured) -> Gap:
    """The gap `[inference] idle_gap_seconds` asks for, given what was measured."""
    if setting != "auto":
        return Gap(float(setting), "fixed")
    n = len(measured.idle_periods)
    if n < MIN_PERIODS:
        return Gap(DEFAULT_SECONDS, f"auto (default until {MIN_PERIODS} idle periods; {n} seen)")
    if measured.pause_latency_p99 is None:
        return Gap(DEFAULT_SECONDS, "auto (default until a pause latency is measured)")
    return Gap(idle_gap(measured.idle_periods, measured.pause_latency_p99), f"auto ({n} periods)")
