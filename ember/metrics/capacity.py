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

from dataclasses import dataclass

HOURS_PER_YEAR = 365.25 * 24


@dataclass(frozen=True)
class MachinePrices:
    on_demand_hour: float = 0.0
    reserved_hour: float = 0.0
    hardware_price: float = 0.0
    lifetime_years: float = 4.0
    watts: float = 0.0
    energy_price_kwh: float = 0.0
    currency: str = "USD"


@dataclass(frozen=True)
class DeviceUse:
    device: str
    period_seconds: float
    productive_seconds: float
    badput_seconds: float

    @property
    def idle_seconds(self) -> float:
        return max(0.0, self.period_seconds - self.productive_seconds - self.badput_seconds)

    @property
    def duty_cycle(self) -> float:
        return (self.productive_seconds + self.badput_seconds) / self.period_seconds


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
