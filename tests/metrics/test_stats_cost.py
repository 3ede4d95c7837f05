"""Step-time percentiles, stalls and cost, by hand."""

from __future__ import annotations

import pytest

from ember.metrics.cost import Prices, cost
from ember.metrics.stats import percentile, spread, stalls


def test_percentiles_interpolate_like_numpy():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    s = spread(values)
    assert (s.max, s.count) == (100.0, 100)


def test_stalls_name_what_coincided():
    steps = [{"step": i, "step_seconds": 1.0, "data_wait_seconds": 0.0} for i in range(1, 11)]
    steps[0]["step_seconds"] = 3.0          # first step of the attempt
    steps[5]["step_seconds"] = 2.5          # step 6 follows a checkpoint at 5
    steps[8] |= {"step_seconds": 4.0, "data_wait_seconds": 2.9}  # step 9 waited for data
    found = {s.step: s for s in stalls(steps, 1.0, checkpoint_steps={5}, first_steps={1})}
    assert set(found) == {1, 6, 9}
    assert found[1].coincided == ["first step of an attempt (warm-up)"]
    assert found[6].coincided == ["follows a checkpoint"]
    assert found[9].coincided == ["data wait 2.900s"] and found[9].ratio == 4.0


def test_cost_counts_every_second_and_divides_by_surviving_tokens():
    prices = Prices(device_hour=2.0, devices=4, watts=1000.0, energy_kwh=0.3)
    c = cost(prices, wall_seconds=1800.0, productive_tokens=3_000_000)
    assert c.total == pytest.approx(0.5 * (4 * 2.0 + 1.0 * 0.3))
    assert c.per_million_tokens == pytest.approx(c.total / 3)
    assert cost(Prices(), 100.0, 10).total is None
