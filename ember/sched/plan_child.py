"""A recipe's plan as `ember plan --json` prints it, computed in a child process: planning imports
torch and transformers (seconds, and hundreds of MB), which the service and the dashboard never
load into their own long-lived process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ember.errors import EmberError


def plan_json(recipe: Path, overrides: list[str], ledger: Path | None, device_memory_gib: float | None = None,
              target_micro_batch: int | None = None, timeout: float = 600) -> dict:
    """`ember plan RECIPE --json` (ember.doctor.calibrated_plan.plan_recipe) in a child; its refusal as an EmberError."""
    argv = [sys.executable, "-m", "ember", "plan", str(recipe), "--json"]
    if ledger is not None:
        argv += ["--ledger", str(ledger)]
    if device_memory_gib is not None:
        argv += ["--device-memory", repr(float(device_memory_gib))]
    if target_micro_batch is not None:
        argv += ["--target-micro-batch", str(int(target_micro_batch))]
    for item in overrides:
        argv += ["--set", item]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
        raise EmberError(f"{recipe}: `ember plan` refused it: {lines[-1] if lines else 'exit ' + str(r.returncode)}")
    return json.loads(r.stdout)
