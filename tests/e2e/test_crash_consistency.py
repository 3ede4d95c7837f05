"""Bounded crash-consistency suite (the long one is bench/crash_soak.py): 30 SIGKILLs at random
moments and at fault points; the run still ends bit-for-bit equal to the uninterrupted one."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

from tests.crash_harness import crash_and_resume, power_cuts
from tests.helpers import (
    MANIFEST_DAMAGE,
    assert_same_result,
    losses,
    run_ember,
    write_recipe,
)

RECIPE = {"train": {"max_steps": 3000, "micro_batch": 2}, "data": {"seq_len": 16},
          "checkpoint": {"every_steps": 7, "keep_last": 2}, "schedule": {"kind": "constant"}}


def test_thirty_kills_lose_nothing_committed_and_end_identical(tmp_path):
    recipe = write_recipe(tmp_path, **RECIPE)
    base = tmp_path / "base"
    assert run_ember("run", recipe, "--out", base, "--no-ledger").returncode == 0
    stats = crash_and_resume(recipe, tmp_path / "run", kills=30, seed=20261130)
    print(f"kills: {stats.kills} {stats.by_fault}")
    assert stats.violations == []
    assert stats.kills >= 25  # a few may land after the run completed
    assert_same_result(tmp_path / "run", base)


def fuse_missing() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist on this machine"
    if shutil.which("fusermount") is None:
        return "fusermount not found (Debian package `fuse`; `make test` installs it)"
    if importlib.util.find_spec("fuse") is None:
        return "the fusepy binding is not installed (`make test` installs it)"
    return None


def test_power_cuts_keep_every_durable_commit_and_end_identical(tmp_path):
    """A kill followed by a simulated power cut (un-fsynced writes and folder changes forgotten),
    twelve times, at random moments and at the commit's fault points."""
    if why := fuse_missing():
        pytest.skip(why)
    recipe = write_recipe(tmp_path, **RECIPE)
    base = tmp_path / "base"
    assert run_ember("run", recipe, "--out", base, "--no-ledger").returncode == 0
    stats = power_cuts(recipe, tmp_path / "cut", cuts=12, seed=20261201, baseline=losses(base))
    print(f"power cuts: {stats.kills} {stats.by_fault}")
    assert stats.violations == []
    assert stats.kills >= 10
    assert_same_result(tmp_path / "cut" / "disk" / "run", base)


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE)
@pytest.mark.parametrize("target", ["model.safetensors", "optimizer.safetensors", "train_state.pt", "MANIFEST.json"])
def test_torn_writes_in_any_file_are_detected(tmp_path, target, damage):
    """Truncation, a zeroed 4 KiB block, a flipped bit: in each checkpoint file and the manifest."""
    recipe = write_recipe(tmp_path, train={"max_steps": 12}, checkpoint={"every_steps": 5, "async": False})
    out = tmp_path / "run"
    assert run_ember("run", recipe, "--out", out, env={"EMBER_FAULT": "train.micro_batch@12"}).returncode < 0
    path = out / "checkpoints" / "step-000000010" / target
    MANIFEST_DAMAGE[damage](path)
    result = run_ember("run", recipe, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "step-000000010 is damaged" in result.stderr and "step-000000005" in result.stderr
    kept = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kept == list(range(1, 13))
