"""The targets.toml the remote tests write: one target with every cap stated (small, the same in
every test), and the kind, stage folder and extra keys each test needs; the limits they submit with."""

from __future__ import annotations

from pathlib import Path

LIMITS = ("--max-wall-hours", "0.5", "--max-device-hours", "0.5", "--max-cost", "0.5", "--max-nodes", "1")


def target_toml(name: str, kind: str, stage: str | Path, **extra: object) -> str:
    """`[targets.NAME]` with every cap and the price stated, plus `extra` keys (TOML literals)."""
    lines = [f"[targets.{name}]", f'kind = "{kind}"', 'device = "cpu"', "device_hour_price = 1.0",
             "max_nodes = 1", "max_wall_hours = 1", "max_device_hours = 1", "max_cost_per_job = 1",
             "max_cost_per_month = 100", 'allowed_classifications = ["public"]', f'stage_dir = "{stage}"']
    return "\n".join(lines + [f"{k} = {v}" for k, v in extra.items()]) + "\n"
