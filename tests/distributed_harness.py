"""What the distributed tests share: a small recipe whose batch splits over two ranks, the
uninterrupted runs to compare with, and finding a rank's PID under the launcher we started."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from tests import warm
from tests.artifacts import shared
from tests.helpers import run_ember, write_recipe

STEPS = 12
# Changing the world size or the strategy changes the order of floating-point sums (gradient
# averaging, FSDP's reduce-scatter): measured here at most 3e-7 on a loss of ~5 (README).
RTOL = 1e-5


def recipe(folder: Path, **train) -> Path:
    return write_recipe(folder, train={"max_steps": STEPS, "grad_accum": 2, **train},
                        checkpoint={"every_steps": 5, "keep_last": 2})


def ember_run(r: Path, out: Path, *args: str, env: dict | None = None) -> None:
    done = run_ember("run", r, "--out", out, "--no-ledger", *args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def make_baselines() -> dict:
    """The uninterrupted runs: one process, and two ranks under DDP (made once for all workers;
    read-only)."""
    def build(folder: Path) -> None:
        r = recipe(folder)
        ember_run(r, folder / "one")
        ember_run(r, folder / "ddp", "--nproc", "2")
    folder = shared("distributed-baselines", STEPS, build)
    return {"recipe": folder / "recipe.toml", "one": folder / "one", "ddp": folder / "ddp"}


def rank_pid(launcher: int, rank: str, timeout: float = 300.0) -> int:
    """The PID of `rank` under the launcher we started (its PID), seen through the warm stand-ins
    (tests.warm.tree): the rank's own process, which a signal then reaches at once. While the
    supervisor restarts a group there is a moment with no ranks at all: wait for the new ones
    (bounded), as long as the launcher lives. A group torn down while a rank is stuck in a
    collective takes up to the launcher's 30 s, then the backoff and a start-up: 300 s is ten
    times that."""
    deadline = time.monotonic() + timeout
    top = psutil.Process(launcher)
    while time.monotonic() < deadline and top.is_running() and top.status() != psutil.STATUS_ZOMBIE:
        for child in warm.tree(launcher)[1:]:
            try:
                if child.environ().get("RANK") == rank:  # a stand-in's is the rank's own
                    return warm.command_of(child.pid) or child.pid
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} under {launcher} within {timeout:g} s")
