"""What a restart pays (issue 31, item 3; bench/restart.py times it): a resumed attempt redoes
none of the first attempt's recording. The reproducibility manifest (git state of ember and of
the recipe's folder, the package list) is built when the run begins or its data changes, never
on a resume over the same data, which kept the first attempt's manifest and threw a new one away."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ember.events import Events
from ember.recipe import load_recipe
from ember.runfolder import RunDir
from ember.train.job import _record_inputs
from ember.train.model import load_model
from tests.helpers import ROOT, ember_cmd, losses, write_recipe

# In every fresh interpreter the test starts (PYTHONPATH): one line per process started, with
# the PID of the process that started it.
SITECUSTOMIZE = """
import os, sys
_fd = os.open(os.environ["EMBER_TEST_SPAWNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def _hook(event, args):
    if event == "subprocess.Popen":
        os.write(_fd, (f"{os.getpid()} " + " ".join(map(str, args[1] or [args[0]])) + "\\n").encode())
sys.addaudithook(_hook)
"""


def spawned(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `ember ARGS` in a fresh interpreter; the command lines of the processes it started."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / f"spawns-{len(list(tmp_path.glob('spawns-*')))}"
    env = {**os.environ, **(env or {}), "PYTHONPATH": f"{hook}:{ROOT}", "EMBER_TEST_SPAWNS": str(log)}
    done = subprocess.run(ember_cmd(*args), capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    return done, log.read_text().splitlines() if log.exists() else []


def test_a_resume_over_the_same_data_runs_no_git_and_keeps_the_first_manifest(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 6}, checkpoint={"every_steps": 3, "async": False})
    out = tmp_path / "run"
    first, seen = spawned(tmp_path, "run", recipe, "--out", out, "--no-ledger",
                          env={"EMBER_FAULT": "train.micro_batch@5"})  # killed in step 5: resumes at 3
    assert first.returncode == -9, first.stderr
    assert any(" git " in f" {line} " for line in seen), f"the first attempt ran no git (hook broken?): {seen}"
    manifest = json.loads((out / "run.json").read_text())["manifest"]
    resumed, seen = spawned(tmp_path, "run", recipe, "--out", out, "--no-ledger")
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr
    assert not [line for line in seen if " git " in f" {line} "], f"the resume ran git again: {seen}"
    assert json.loads((out / "run.json").read_text())["manifest"] == manifest
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4, 5, 6]


def test_the_manifest_is_built_when_recorded_and_only_then(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path))
    run = RunDir.open(tmp_path / "run", recipe, False, Events(None))
    bundle = load_model(recipe.model, recipe.method, False)
    built: list[int] = []

    def manifest() -> dict:
        built.append(1)
        return {"n": len(built)}

    _record_inputs(run, bundle, "f1", 1, manifest, False, Events(None))  # the run begins
    assert built == [1] and run.record["manifest"] == {"n": 1}
    _record_inputs(run, bundle, "f1", 1, manifest, False, Events(None))  # a resume, same data
    assert built == [1] and run.record["manifest"] == {"n": 1}
    _record_inputs(run, bundle, "f2", 1, manifest, False, Events(None))  # changed data, no checkpoint yet
    assert built == [1, 1] and run.record["manifest"] == {"n": 2} and run.record["data_fingerprint"] == "f2"
    run.lock.release()
