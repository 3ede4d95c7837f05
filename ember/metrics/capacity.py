"""Capacity and duty cycle: how busy each device was, and what that work costs rented on demand,
reserved, or owned. Pure arithmetic; the decision is the duty cycle's, so the arithmetic is shown.

    duty cycle d = (productive + badput seconds) / period seconds
    on demand:  d * H * on_demand_hour                   (pay only while a run holds the device)
    reserved:   H * reserved_hour                        (pay every hour of the term)
    owned:      H * hardware_price / lifetime_hours + d * H * watts / 1000 * energy_price_kwh
    break-even against on demand:
        reserved  d* = reserved_hour / on_demand_hour
        owned     d* = (hardware_price / lifetime_hours) / (on_demand_hour - watts / 1000 * energy_price_kwh)
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import time
from dataclasses import dataclass, field

from ember.errors import EmberError
from ember.ledger import database as ledger_store
from ember.ledger.database import AttemptRow
from ember.metrics.machine import MachinePrices, machine_file, read_machine

HOURS_PER_YEAR = 365.25 * 24


@dataclass(frozen=True)
class DeviceUse:
    device: str
    period_seconds: float
    productive_seconds: float
    badput_seconds: float
    idle_seconds: float = field(init=False)    # fields, not properties: they are in the JSON too
    duty_cycle: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "idle_seconds",
                           max(0.0, self.period_seconds - self.productive_seconds - self.badput_seconds))
        object.__setattr__(self, "duty_cycle", (self.productive_seconds + self.badput_seconds) / self.period_seconds)


@dataclass(frozen=True)
class Option:
    name: str
    cost: float | None
    break_even_duty_cycle: float | None
    arithmetic: str


def options(use: DeviceUse, p: MachinePrices) -> list[Option]:
    """The period's cost under each way of paying for the device, with break-even duty cycles."""
    hours = use.period_seconds / 3600
    d = use.duty_cycle
    energy_hour = p.watts / 1000 * p.energy_price_kwh
    out = []
    if p.on_demand_hour:
        out.append(Option("on demand", d * hours * p.on_demand_hour, None,
                          f"{d:.3f} x {hours:.2f} h x {p.on_demand_hour}"))
    if p.reserved_hour:
        even = p.reserved_hour / p.on_demand_hour if p.on_demand_hour else None
        out.append(Option("reserved", hours * p.reserved_hour, even,
                          f"{hours:.2f} h x {p.reserved_hour}"
                          + (f"; break-even d* = {p.reserved_hour} / {p.on_demand_hour}" if even else "")))
    if p.hardware_price:
        amortized = p.hardware_price / (p.lifetime_years * HOURS_PER_YEAR)
        margin = p.on_demand_hour - energy_hour
        even = amortized / margin if p.on_demand_hour and margin > 0 else None
        out.append(Option("owned", hours * amortized + d * hours * energy_hour, even,
                          f"{hours:.2f} h x {amortized:.4f} (hardware / lifetime) + {d:.3f} x {hours:.2f} h "
                          f"x {energy_hour:.4f} (energy)"
                          + (f"; break-even d* = {amortized:.4f} / ({p.on_demand_hour} - {energy_hour:.4f})"
                             if even else "")))
    return out


@dataclass
class DeviceReport:
    use: DeviceUse
    options: list[Option]


@dataclass
class CapacityReport:
    period_seconds: float
    since: str | None               # the --since date, or None for "since the first attempt"
    devices: list[DeviceReport] = field(default_factory=list)
    prices: MachinePrices = field(default_factory=MachinePrices)
    prices_file: str = ""


def parse_since(text: str | None, now: float) -> float | None:
    """--since as Unix time; a date in the future is refused."""
    if not text:
        return None
    try:
        since = dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise EmberError(f"--since {text!r}: not a date; use e.g. 2026-11-01 or 2026-11-01T08:00") from None
    if since >= now:
        raise EmberError(f"--since {text!r}: in the future; give a date before now")
    return since


def capacity_report(con: sqlite3.Connection, since_text: str | None, now: float | None = None) -> CapacityReport:
    """Duty cycle per device over the period, from every attempt in the ledger, and the cost of
    that work rented, reserved or owned (prices from machine.toml [capacity])."""
    now = time.time() if now is None else now
    since = parse_since(since_text, now)
    held: dict[str, list[tuple[float, float]]] = {}   # device -> intervals some attempt held it
    productive: dict[str, float] = {}
    starts = []
    for row in ledger_store.all_runs(con):
        attempts = ledger_store.attempts(con, row["id"])
        share = _goodput_share(row, con, attempts[-1] if attempts else None)
        for a in attempts:
            end = min(a.end or a.last_seen or a.start, now)
            start = max(a.start, since) if since else a.start
            starts.append(a.start)
            if end <= start:
                continue
            key = f"{a.host}: {a.devices}"
            held.setdefault(key, []).append((start, end))
            productive[key] = productive.get(key, 0.0) + (end - start) * share
    # Jobs packed onto one device overlap: the device is busy for the union of their intervals
    # (packing raises the duty cycle, never above 1), productive for their productive seconds.
    use = {}
    for key, intervals in held.items():
        busy = union_seconds(intervals)
        use[key] = [min(busy, productive[key]), busy - min(busy, productive[key])]
    prices = read_machine().capacity
    if not use:
        return CapacityReport(0.0, since_text, [], prices, str(machine_file()))
    period = now - (since if since is not None else min(starts))
    devices = [DeviceReport(u, options(u, prices)) for u in
               (DeviceUse(name, period, productive, badput) for name, (productive, badput) in sorted(use.items()))]
    return CapacityReport(period, since_text, devices, prices, str(machine_file()))


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _goodput_share(row: sqlite3.Row, con: sqlite3.Connection, last: AttemptRow | None) -> float:
    """Productive share of a run's held time, as `ember runs` has it (report.run_summary); 0 when
    its folder is gone: its time counts as badput."""
    from ember.metrics.report import run_summary
    summary = run_summary(con, row, last)
    return summary.goodput if summary is not None and summary.goodput is not None else 0.0
