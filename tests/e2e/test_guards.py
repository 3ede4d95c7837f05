"""Numerical guards on whole runs: poisoned batches are skipped or rolled back, deterministically."""

from __future__ import annotations

import json
import math

import torch

from tests.helpers import assert_same_result, losses, run_ember, write_recipe


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def state_of(out):
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    return torch.load(newest / "train_state.pt", weights_only=True)["run_state"]


def test_nan_batch_is_skipped_and_the_run_is_deterministic(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 12})
    env = {"EMBER_FAULT_LOSS": "9:nan"}  # micro-batch 9 of the stream -> step 10
    for name in ("a", "b"):
        result = run_ember("run", recipe, "--out", tmp_path / name, env=env)
        assert result.returncode == 0, result.stderr
        assert "step 10: nonfinite" in result.stderr and "update skipped" in result.stderr
    rows = metrics(tmp_path / "a")
    assert [r.get("skipped") for r in rows].count("nonfinite") == 1 and rows[9]["skipped"] == "nonfinite"
    assert math.isfinite(rows[10]["loss"])  # finite again after the skip (NaN and inf both fail)
    assert state_of(tmp_path / "a")["bad_steps"][0]["batches"] == [9]
    assert_same_result(tmp_path / "b", tmp_path / "a")
    clean = tmp_path / "clean"
    assert run_ember("run", recipe, "--out", clean).returncode == 0
    assert losses(clean)[:9] == losses(tmp_path / "a")[:9]  # identical up to the poisoned step


def test_spike_rolls_back_skips_the_batches_and_is_deterministic(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 20},
                          checkpoint={"every_steps": 5, "async": False},
                          guard={"spike_action": "rollback", "spike_min_steps": 5, "spike_k": 6.0,
                                 "rollback_lr_factor": 0.5})
    env = {"EMBER_FAULT_LOSS": "12:40"}  # a 40x loss at micro-batch 12 -> step 13
    for name in ("a", "b"):
        result = run_ember("run", recipe, "--out", tmp_path / name, env=env)
        assert result.returncode == 0, result.stderr
        assert "rolled back to step 10" in result.stderr and "batches [12] skipped" in result.stderr
    a = tmp_path / "a"
    assert [r["step"] for r in metrics(a)] == list(range(1, 21))
    lost = [json.loads(line)["step"] for line in (a / "metrics.lost.jsonl").read_text().splitlines()]
    assert lost == [11, 12]  # computed before the spike, then again after the rollback
    state = state_of(a)
    assert state["skip_batches"] == [12] and state["lr_scale"] == 0.5
    assert all(r["loss"] < 10 for r in metrics(a))  # the poisoned batch never trained
    assert_same_result(tmp_path / "b", a)


def test_too_many_bad_steps_stop_with_a_clear_error(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 12}, guard={"max_bad_steps": 3})
    result = run_ember("run", recipe, "--out", tmp_path / "o",
                       env={"EMBER_FAULT_LOSS": "4:nan,5:nan,6:nan"})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "3 bad steps in a row" in result.stderr
    assert "step 5 nonfinite" in result.stderr and "batches [6]" in result.stderr
