"""What a run cost: device-hours and energy over every second of wall-clock, badput included."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    device_hour: float = 0.0       # price of one device for one hour
    devices: int = 1
    watts: float = 0.0             # power draw of the whole machine while the run holds it
    energy_kwh: float = 0.0        # price of one kWh
    currency: str = "USD"

    @property
    def known(self) -> bool:
        return self.device_hour > 0 or (self.watts > 0 and self.energy_kwh > 0)


@dataclass(frozen=True)
class Cost:
    total: float | None
    per_million_tokens: float | None
    currency: str
    formula: str


def cost(prices: Prices, wall_seconds: float, productive_tokens: int) -> Cost:
    """Cost of `wall_seconds` of holding the machine, and per million tokens that survived."""
    formula = (f"{wall_seconds / 3600:.4f} h x ({prices.devices} x {prices.device_hour} "
               f"+ {prices.watts} W / 1000 x {prices.energy_kwh} per kWh)")
    if not prices.known:
        return Cost(None, None, prices.currency, "no prices set ([cost] in the recipe or "
                    "$EMBER_HOME/machine.toml)")
    if not math.isfinite(wall_seconds):  # a plan whose step time is unknown (nan): so is its cost
        return Cost(None, None, prices.currency, "the run's time is unknown")
    hourly = prices.devices * prices.device_hour + prices.watts / 1000 * prices.energy_kwh
    total = wall_seconds / 3600 * hourly
    per_m = total / (productive_tokens / 1e6) if productive_tokens else None
    return Cost(total, per_m, prices.currency, formula)
