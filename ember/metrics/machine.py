"""The one reader of `$EMBER_HOME/machine.toml`: this machine's prices and power, shared by every
run's cost (`[cost]`) and by `ember capacity` (`[capacity]`). Values are checked here, so a
wrong type is an error naming the file, the key and the value, never a traceback later."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.paths import ember_home
from ember.recipe import read_toml

# section -> key -> the type it must have ("number" is an int or a float, never a bool)
KEYS: dict[str, dict[str, str]] = {
    "cost": {"device_hour_price": "number", "devices": "number", "watts": "number",
             "energy_price_kwh": "number", "currency": "string", "peak_tflops": "number"},
    "capacity": {"on_demand_hour": "number", "reserved_hour": "number", "hardware_price": "number",
                 "lifetime_years": "number", "watts": "number", "energy_price_kwh": "number",
                 "currency": "string"},
}


def machine_file() -> Path:
    return ember_home() / "machine.toml"


def read_machine(section: str) -> dict[str, Any]:
    """The checked `[section]` of machine.toml ({} when the file or the section is absent)."""
    path = machine_file()
    if not path.is_file():
        return {}
    raw = read_toml(path)
    values = raw.get(section, {})
    if not isinstance(values, dict):
        raise EmberError(f"{path}: '{section}' must be a [{section}] table")
    known = KEYS[section]
    for key, value in values.items():
        if key not in known:
            raise EmberError(f"{path}: unknown key '{key}' in [{section}]; keys are {', '.join(known)}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if known[key] == "number" and not (number and value >= 0):
            raise EmberError(f"{path}: [{section}] {key} = {value!r}: must be a number >= 0")
        if known[key] == "string" and not isinstance(value, str):
            raise EmberError(f"{path}: [{section}] {key} = {value!r}: must be a string")
    return values
