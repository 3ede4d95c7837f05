"""Runs written the way a training process writes them (run.json, metrics.jsonl, the ledger's rows
through ember.ledger.database), without training: for runs longer or more numerous than a test can
train (100,000 steps, 1,000 runs), and for figures a test must know exactly (a spike at step S)."""

from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import time
from pathlib import Path

from ember.ledger import database as store
from ember.metrics.report import build_report, summarize
from ember.recipe import Recipe
from tests.helpers import GENESIS


def loss_at(step: int, spike_at: int | None = None) -> float:
    """A smooth, known loss curve; `spike_at` gets 40.0."""
    return 40.0 if step == spike_at else 2.0 + 3.0 * math.exp(-step / 2000) + 0.05 * math.sin(step)


def metrics_line(step: int, loss: float, step_seconds: float = 0.02, when: float | None = None) -> str:
    """One line of metrics.jsonl as the training loop writes it."""
    return json.dumps({"step": step, "loss": loss, "lr": 1e-3 * min(1.0, step / 100), "grad_norm": 1.0, "tokens": 128,
                       "tokens_seen": 128 * step, "step_seconds": step_seconds, "data_wait_seconds": 0.001,
                       "phases": {}, "attempt": 1, "time": when or time.time()}) + "\n"


def make_run(con: sqlite3.Connection, folder: Path, steps: int, name: str | None = None, spike_at: int | None = None,
             run_id: str | None = None, completed: bool = True, step_seconds: float = 0.02) -> str:
    """A run of `steps` optimizer steps in `folder`, recorded in the ledger; its id. Not `completed`:
    its attempt is still going, in this process (a live run)."""
    folder.mkdir(parents=True, exist_ok=True)
    run_id = run_id or f"{folder.name}-{abs(hash(str(folder))) % 1_000_000:06d}"
    recipe = Recipe().to_dict()
    recipe["train"]["max_steps"] = steps
    recipe["data"]["seq_len"] = 32
    recipe["data"]["files"] = [str(GENESIS)]
    now = time.time()
    start = now - steps * step_seconds - 5
    record = {"id": run_id, "created": start, "recipe": recipe, "recipe_digest": "0" * 64,
              "manifest": {"python": "3.11", "seed": 0, "packages": ["torch==2.13.0"]},
              "data_fingerprint": "f" * 64,
              "performance": {"devices": 1, "flops_per_token": 1e6, "peak_flops": 1e12, "peak_source": "test"}}
    (folder / "run.json").write_text(json.dumps(record))
    lines = [metrics_line(s, loss_at(s, spike_at), step_seconds * (3 if s % 97 == 0 else 1), start + 2 + s * step_seconds)
             for s in range(1, steps + 1)]
    (folder / "metrics.jsonl").write_text("".join(lines))
    store.register_run(con, run_id, folder, name or folder.name, "0" * 64, record["manifest"], steps)
    store.start_attempt(con, run_id, 1, start, socket.gethostname(), os.getpid(), "cpu", None)  # alive: us
    ledger = store.Ledger(con, run_id, 1, print)
    ledger.event("startup", start, start + 2, step=0)
    if completed:
        ledger.checkpoint(steps, str(folder / "checkpoints" / f"step-{steps:09d}"), 10_000, 0.05, 0.2)
        ledger.finish("completed")
        ledger.summary(summarize(build_report(folder, con)).__dict__)
    return run_id
