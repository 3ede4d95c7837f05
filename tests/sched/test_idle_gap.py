"""The idle gap's rule (ember.sched.idle_gap), by hand-computed costs and on the three traces of
issue 29 item 4 (seeded synthetic arrivals fed through the real Gate on a synthetic clock)."""

import random

import pytest

from ember.metrics.stats import percentile
from ember.sched.idle_gap import CAP, DEFAULT_SECONDS, HOLD_WEIGHT, Measured, choose, expected_cost, idle_gap
from ember.sched.inference import Gate

PAUSE_P99 = 0.15  # the control-file yield's p99 measured beside training (bench/README): 150-160 ms
REQUEST_SECONDS = 0.3  # one short completion with the built-in engine


def test_the_expected_cost_by_hand():
    periods = (0.2, 0.2, 0.3, 20.0)
    assert expected_cost(0.0, periods, 1.0) == pytest.approx(1.0)  # every request meets training
    assert expected_cost(0.2, periods, 1.0) == pytest.approx((0.2 + 0.2 + 1.2 + 1.2) / 4)
    assert expected_cost(0.3, periods, 1.0) == pytest.approx((0.2 + 0.2 + 0.3 + 1.3) / 4)
    assert expected_cost(10.0, periods, 1.0) == pytest.approx((0.2 + 0.2 + 0.3 + 11.0) / 4)  # 20 s outlasts it
    # weight 10 x 0.1 s = a price of 1: holding through the short ones (0.3 s) costs least
    assert idle_gap(periods, 0.1) == 0.3
    # a yield ten times as fast is cheaper to meet than any hold
    assert idle_gap(periods, 0.01) == 0.0


def test_the_gap_is_bounded_by_the_cap_and_prefers_the_shorter_on_a_tie():
    # a price of 100 s: periods of 8 s are worth holding for; those past the cap are not, whatever the price
    assert idle_gap((8.0,) * 8, 10.0) == 8.0
    assert idle_gap((CAP + 2,) * 8, 10.0) == 0.0
    assert idle_gap((5.0,) * 4 + (CAP + 20,) * 4, 10.0) == 5.0
    # price 1 against periods of exactly 1 s: holding them (cost 1) ties with meeting them (1): resume
    assert idle_gap((1.0,) * 8, 0.1) == 0.0


def test_fixed_and_the_default_until_enough_is_measured():
    assert choose(0.5, Measured((), None)).seconds == 0.5 and choose(0.5, Measured((), None)).rule == "fixed"
    few = choose("auto", Measured((0.1,) * 7, 0.1))
    assert few.seconds == DEFAULT_SECONDS and "7 seen" in few.rule
    assert choose("auto", Measured((0.1,) * 8, None)).seconds == DEFAULT_SECONDS
    enough = choose("auto", Measured((0.1,) * 8, 0.1))
    assert enough.seconds == pytest.approx(0.1) and enough.rule == "auto (8 periods)"


def poisson(rng: random.Random, rate: float, n: int, start: float = 0.0) -> list[float]:
    """n arrival times of a Poisson process."""
    t, out = start, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def bursty(rng: random.Random, bursts: int, start: float = 0.0) -> list[float]:
    """On/off: bursts of 10 requests at ~3 req/s, 15-40 s of quiet between them."""
    t, out = start, []
    for _ in range(bursts):
        out += poisson(rng, 3.0, 10, t)
        t = out[-1] + rng.uniform(15.0, 40.0)
    return out


def replay(gate: Gate, arrivals: list[float]) -> None:
    """Each arrival is a request of REQUEST_SECONDS through the gate, ends before begins at a tie."""
    events = sorted([(t, 1) for t in arrivals] + [(t + REQUEST_SECONDS, 0) for t in arrivals])
    for t, begins in events:
        gate.begin(t) if begins else gate.end(t)


def idle_periods(arrivals: list[float]) -> list[float]:
    """The idle periods of a trace, computed apart from the gate (a check on its measuring)."""
    out, free_at = [], None  # when the requests so far have all ended
    for t in sorted(arrivals):
        if free_at is not None and t >= free_at:
            out.append(t - free_at)
        free_at = max(free_at or t, t + REQUEST_SECONDS)
    return out


def trained(gate: Gate, arrivals: list[float]) -> Gate:
    """A gate set to "auto" that has seen `arrivals` and one pause-latency sample of PAUSE_P99."""
    gate.observe({"pid": 1, "last": {"n": 1, "reason": "inference", "asked": 0.0, "at": PAUSE_P99}})
    replay(gate, arrivals)
    return gate


def regret(gap: float, future: list[float]) -> float:
    """The cost of `gap` on what comes next, over the cost of the best gap in hindsight (>= 1)."""
    price = HOLD_WEIGHT * PAUSE_P99
    best = idle_gap(tuple(future), PAUSE_P99)
    return expected_cost(gap, tuple(future), price) / expected_cost(best, tuple(future), price)


def test_the_gate_measures_idle_periods_from_no_request_in_flight_to_the_next_arrival():
    g = Gate(device=0, idle_gap="auto")
    replay(g, [0.0, 0.1, 1.0, 5.0])  # 0.0 and 0.1 overlap: no idle period between them
    assert list(g.idle_periods) == pytest.approx([1.0 - 0.4, 5.0 - 1.3])
    arrivals = poisson(random.Random(29), 2.0, 400)
    g = Gate(device=0, idle_gap="auto")
    replay(g, arrivals)
    assert list(g.idle_periods) == pytest.approx(idle_periods(arrivals)[-64:])  # the last 64


def test_light_poisson_resumes_training_between_sparse_requests():
    rng = random.Random(29)
    g = trained(Gate(device=0, idle_gap="auto"), poisson(rng, 0.2, 200))
    gap = g.gap()
    assert gap.rule == "auto (64 periods)", gap
    # what comes next in the same trace: training keeps nearly all of the idle time
    future = idle_periods(poisson(rng, 0.2, 200))
    kept = sum(max(0.0, i - gap.seconds) for i in future) / sum(future)
    assert gap.seconds < 0.5 and kept > 0.9, (gap, kept, percentile(future, 50))
    assert regret(gap.seconds, future) < 1.25 and regret(gap.seconds, future) < regret(DEFAULT_SECONDS, future)
    assert not g.busy(g.last_end + 1.0)  # a second after the last request, training runs


def test_heavy_poisson_holds_because_the_next_request_is_near():
    rng = random.Random(29)
    g = trained(Gate(device=0, idle_gap="auto"), poisson(rng, 2.0, 400))
    gap = g.gap()
    future = idle_periods(poisson(rng, 2.0, 400))
    met = sum(i > gap.seconds for i in future) / len(future)  # requests that would meet training
    assert gap.seconds > percentile(future, 90) and met < 0.05, (gap, met, percentile(future, 90))
    assert regret(gap.seconds, future) < 1.25
    assert g.busy(g.last_end + 0.5)


def test_bursty_holds_within_bursts_and_resumes_between_them():
    rng = random.Random(29)
    g = trained(Gate(device=0, idle_gap="auto"), bursty(rng, 20))
    gap = g.gap()
    future = idle_periods(bursty(rng, 20))
    within = [i for i in future if i < 10.0]
    between = [i for i in future if i >= 10.0]
    assert len(between) == 19 and len(within) > 40, (len(between), len(within))
    # Hold through most of a burst's pauses, never into the quiet between bursts: each second
    # held costs training in every quiet period too, so the tail of a burst's pauses is let go.
    held = sum(i <= gap.seconds for i in within) / len(within)
    assert held > 0.5 and gap.seconds < min(between) / 5, (gap, held, max(within), min(between))
    assert regret(gap.seconds, future) < 1.25 and regret(gap.seconds, future) < regret(DEFAULT_SECONDS, future)
