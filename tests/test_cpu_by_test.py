"""`pytest --cpu-by-test` (tests/cpu_by_test.py) counts in a test's group the processes the test
starts and the commands the warm process forks for it, and nothing of another test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cpu_by_test
from tests.helpers import run_ember, write_recipe

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass"


def test_a_tests_own_children_and_warm_commands_are_counted_in_its_group(tmp_path, monkeypatch):
    if os.geteuid() != 0 or cpu_by_test.hierarchy() is None:
        pytest.skip("counting CPU by test takes root and a cgroup hierarchy with CPU accounting")
    was = cpu_by_test.group_of(os.getpid())  # an outer --cpu-by-test run's, or the root
    monkeypatch.delenv(cpu_by_test.ENV, raising=False)
    monkeypatch.setenv("EMBER_TEST_CACHE", str(tmp_path / "cache"))
    why = cpu_by_test.start(tmp_path / "log")
    if why is not None:
        pytest.skip(f"--cpu-by-test: {why}")
    run = Path(json.loads(os.environ[cpu_by_test.ENV])["group"])
    try:
        counted = cpu_by_test.PerTest(os.environ[cpu_by_test.ENV])
        counted.begin()
        subprocess.run([sys.executable, "-c", BUSY], check=True)  # 0.5 CPU-s in a child
        counted.end("child")
        counted.begin()
        recipe = write_recipe(tmp_path, train={"max_steps": 2})
        assert run_ember("run", recipe, "--out", tmp_path / "run", "--no-ledger").returncode == 0
        counted.end("warm")
        counted.begin()
        counted.end("nothing")
    finally:
        if was is not None:  # out of the run's group, as a worker is gone by the end of a run
            cpu_by_test.join(was, os.getpid())
    lines = cpu_by_test.finish(tmp_path / "log")
    cpu = {r["id"]: r["cpu"] for r in json.loads((tmp_path / "cache" / "cpu-by-test.json").read_text())["tests"]}
    assert cpu["child"] >= 0.5, cpu
    # a run's step, checkpoint and exit, in the command the warm process forked: this worker's own
    # share of it is waiting on a pipe
    assert cpu["warm"] >= 0.05, cpu
    assert cpu["nothing"] < 0.05, cpu
    assert lines[1].endswith("child") and "CPU seconds by test" in lines[0], lines
    assert not (tmp_path / "log").exists()
    assert not run.exists(), f"{run} left behind"  # each `make test` left an empty group once
