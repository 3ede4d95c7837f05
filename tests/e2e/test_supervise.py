"""Supervised restarts: a crash is restarted from the last durable checkpoint; exit 75 is not."""

from __future__ import annotations

import signal
from pathlib import Path

from ember.launch import RunRequest
from ember.supervise import ChildRun, backoff, quick_crashes
from tests.helpers import (
    assert_same_result,
    run_ember,
    start_ember,
    stop,
    wait_for_step,
    write_recipe,
)


def test_backoff_doubles_and_is_capped():
    assert [backoff(n, 2.0) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert backoff(20, 2.0) == 300.0


def test_only_a_crash_loop_backs_off():
    """Crashes in a row without a new checkpoint double the wait; progress resets it."""
    loop = [ChildRun(0, 5, 1), ChildRun(10, 12, -9), ChildRun(20, 21, 1)]
    assert quick_crashes(loop) == 3
    assert quick_crashes([*loop, ChildRun(30, 60, -9, advanced=True)]) == 1  # trained, then killed
    assert quick_crashes([ChildRun(0, 600, -9, advanced=True), ChildRun(600, 601, 1)]) == 1
    assert quick_crashes([ChildRun(0, 600, -9, advanced=True), ChildRun(600, 601, 1), ChildRun(602, 603, 1)]) == 2


def test_child_command_drops_restarts():
    argv = RunRequest(Path("r.toml"), Path("o"), restarts=3).child_argv()
    assert argv[-6:] == ["ember", "run", "r.toml", "--out", "o", "--no-supervise"]


def test_restart_after_an_injected_crash_ends_identical_to_the_baseline(tmp_path):
    recipe = write_recipe(tmp_path, train={"restart_backoff_seconds": 0.1},
                          checkpoint={"async": False})
    assert run_ember("run", recipe, "--out", tmp_path / "base").returncode == 0
    result = run_ember("run", recipe, "--out", tmp_path / "sup", "--restarts", "2",
                       env={"EMBER_FAULT": "train.micro_batch@12",
                            "EMBER_FAULT_ONCE": str(tmp_path / "crashed-once")})
    assert result.returncode == 0, result.stderr
    assert "attempt 1 crashed (killed by SIGKILL)" in result.stderr
    assert "1: " in result.stderr and "completed" in result.stderr
    assert_same_result(tmp_path / "sup", tmp_path / "base")


def test_gives_up_after_n_crashes(tmp_path):
    recipe = write_recipe(tmp_path, train={"restarts": 1, "restart_backoff_seconds": 0.1})
    result = run_ember("run", recipe, "--out", tmp_path / "o", env={"EMBER_FAULT": "train.micro_batch@3"})
    assert result.returncode == 1
    assert "giving up: 2 crashes" in result.stderr
    assert result.stderr.count("killed by SIGKILL") == 3  # one restart message, two summary lines


def test_sigterm_is_forwarded_and_exit_75_is_not_restarted(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 400})
    proc = start_ember("run", recipe, "--out", tmp_path / "o", "--restarts", "3", warm=True)
    wait_for_step(proc, tmp_path / "o" / "metrics.jsonl", 5)
    assert stop(proc, signal.SIGTERM) == 75
    attempts = (tmp_path / "o" / "attempts.jsonl").read_text().splitlines()
    assert len(attempts) == 1
