"""Duty cycle and rent / reserve / own arithmetic, by hand."""

from __future__ import annotations

import pytest

from ember.metrics.capacity import HOURS_PER_YEAR, DeviceUse, MachinePrices, options


def test_duty_cycle_and_the_three_ways_to_pay():
    # A 100-hour period, 30 h productive and 10 h of badput: duty cycle 0.4.
    use = DeviceUse("gpu0", 100 * 3600, 30 * 3600, 10 * 3600)
    assert use.duty_cycle == pytest.approx(0.4) and use.idle_seconds == 60 * 3600
    p = MachinePrices(on_demand_hour=2.0, reserved_hour=1.2, hardware_price=HOURS_PER_YEAR * 4 * 0.5,
                      lifetime_years=4, watts=500, energy_price_kwh=0.2)
    got = {o.name: o for o in options(use, p)}
    assert got["on demand"].cost == pytest.approx(0.4 * 100 * 2.0)           # 80
    assert got["reserved"].cost == pytest.approx(100 * 1.2)                  # 120
    assert got["reserved"].break_even_duty_cycle == pytest.approx(0.6)
    # owned: 0.5 an hour amortised over every hour, 0.1 an hour of energy while busy
    assert got["owned"].cost == pytest.approx(100 * 0.5 + 0.4 * 100 * 0.1)  # 54
    assert got["owned"].break_even_duty_cycle == pytest.approx(0.5 / (2.0 - 0.1))


def test_no_prices_no_options():
    assert options(DeviceUse("d", 3600, 0, 0), MachinePrices()) == []


def test_jobs_packed_on_one_device_count_once_in_its_duty_cycle():
    from ember.metrics.capacity import union_seconds
    assert union_seconds([(0, 10), (5, 15), (20, 30)]) == 25  # two packed jobs overlap 5 s
    assert union_seconds([(0, 10), (2, 3)]) == 10
    assert union_seconds([]) == 0
