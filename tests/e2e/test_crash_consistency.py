"""Bounded crash-consistency suite (the long one is bench/crash_soak.py): SIGKILLs at random
moments and at fault points, 6 in `make test` and 30 in `make soak` (12 power cuts there, 3 here);
the run still ends bit-for-bit equal to the uninterrupted one."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.artifacts import copy_of, shared
from tests.crash_harness import crash_and_resume, power_cuts
from tests.helpers import (
    MANIFEST_DAMAGE,
    assert_same_result,
    losses,
    run_ember,
    write_recipe,
)

KILLS, CUTS = (6, 30), (3, 12)  # (make test, make soak)
# Long enough that every kill lands while the run trains: an attempt killed at a random moment
# trains at most 0.6 s (~90 steps here), one killed at a fault point ~21. `make test`'s 6 kills
# reach step ~550 at most; the soak's 30 need its 3,000. A constant schedule: the first N losses
# are the same whatever max_steps is. The run to the end is most of each test's CPU (3,000 steps:
# ~20 CPU-s for the baseline and again for each test's last attempt).
MAX_STEPS = (1000, 3000)  # (make test, make soak)


def recipe_of(soak: bool) -> dict:
    return {"train": {"max_steps": MAX_STEPS[soak], "micro_batch": 2}, "data": {"seq_len": 16},
            "checkpoint": {"every_steps": 7, "keep_last": 2}, "schedule": {"kind": "constant"}}


def baseline(soak: bool) -> Path:
    """The uninterrupted run, shared by the kill and power-cut tests."""
    sections = recipe_of(soak)

    def build(folder: Path) -> None:
        recipe = write_recipe(folder, **sections)
        assert run_ember("run", recipe, "--out", folder / "run", "--no-ledger").returncode == 0
    return shared("crash-baseline", sections, build) / "run"


def enough(done: int, asked: int) -> bool:
    """A few kills may land after the run completed: five in six must have killed it."""
    return done >= asked * 5 // 6


@pytest.mark.soak
def test_kills_lose_nothing_committed_and_end_identical(tmp_path, soak):
    kills = KILLS[soak]
    recipe = write_recipe(tmp_path, **recipe_of(soak))
    stats = crash_and_resume(recipe, tmp_path / "run", kills=kills, seed=20261130)
    print(f"kills: {stats.kills} {stats.by_fault}")
    assert stats.violations == []
    assert enough(stats.kills, kills), stats
    assert_same_result(tmp_path / "run", baseline(soak))


def fuse_missing() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist on this machine"
    if shutil.which("fusermount") is None:
        return "fusermount not found (Debian package `fuse`; `make test` installs it)"
    if importlib.util.find_spec("fuse") is None:
        return "the fusepy binding is not installed (`make test` installs it)"
    return None


@pytest.mark.soak
def test_power_cuts_keep_every_durable_commit_and_end_identical(tmp_path, soak):
    """A kill followed by a simulated power cut (un-fsynced writes and folder changes forgotten),
    at random moments and at the commit's fault points."""
    if why := fuse_missing():
        pytest.skip(why)
    cuts = CUTS[soak]
    recipe = write_recipe(tmp_path, **recipe_of(soak))
    base = baseline(soak)
    stats = power_cuts(recipe, tmp_path / "cut", cuts=cuts, seed=20261201, baseline=losses(base))
    print(f"power cuts: {stats.kills} {stats.by_fault}")
    assert stats.violations == []
    assert enough(stats.kills, cuts), stats
    assert_same_result(tmp_path / "cut" / "disk" / "run", base)


TORN = {"train": {"max_steps": 12}, "checkpoint": {"every_steps": 5, "async": False}}


def killed_at_step_12() -> Path:
    """A run killed at step 12, its checkpoints 5 and 10 committed (shared: copy before damage)."""
    def build(folder: Path) -> None:
        recipe = write_recipe(folder, **TORN)
        killed = run_ember("run", recipe, "--out", folder / "run", env={"EMBER_FAULT": "train.micro_batch@12"})
        assert killed.returncode < 0, killed.stderr
    return shared("killed-at-12", TORN, build)


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE)
@pytest.mark.parametrize("target", ["model.safetensors", "optimizer.safetensors", "train_state.pt", "MANIFEST.json"])
def test_torn_writes_in_any_file_are_detected(tmp_path, target, damage):
    """Truncation, a zeroed 4 KiB block, a flipped bit: in each checkpoint file and the manifest."""
    killed = copy_of(killed_at_step_12(), tmp_path / "killed")
    recipe, out = write_recipe(tmp_path, **TORN), killed / "run"
    path = out / "checkpoints" / "step-000000010" / target
    MANIFEST_DAMAGE[damage](path)
    result = run_ember("run", recipe, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "step-000000010 is damaged" in result.stderr and "step-000000005" in result.stderr
    kept = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kept == list(range(1, 13))
