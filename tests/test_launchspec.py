"""One owner of a launch (ember.launchspec, ember.runfolder): whoever launches a run reads its
recipe and plans its memory once, and every process under it takes both from the launch spec.
The supervisor of `ember run --restarts N`, which never trains, never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ember.launchspec import ENV, LaunchSpec, PlannedMemory
from ember.recipe import load_recipe
from ember.runfolder import completed, inherited_launch_spec, write_launch_spec
from tests.helpers import ROOT, ember_cmd, losses, write_recipe

# Loaded by every fresh interpreter the test starts (PYTHONPATH): an audit hook that writes, per
# process, its command line, each open() of the recipe and each import of torch and of the planner.
SITECUSTOMIZE = """
import os, sys
_fd = os.open(os.environ["EMBER_TEST_AUDIT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
_recipe = os.environ["EMBER_TEST_AUDIT_RECIPE"]
def _line(text):
    os.write(_fd, f"{os.getpid()} {text}\\n".encode())
def _hook(event, args):
    if event == "open" and isinstance(args[0], str) and os.path.abspath(args[0]) == _recipe:
        _line("open-recipe")
    elif event == "import" and args[0] in ("torch", "ember.plan.planner"):
        _line("import " + args[0])
_line("argv " + " ".join(sys.argv[1:] if sys.argv[1:] else ["?"]))
sys.addaudithook(_hook)
"""


def audited(tmp_path: Path, recipe: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[int, list[str]]]:
    """Run `ember ARGS` in fresh interpreters with the audit hook; each process's lines by PID."""
    hook = tmp_path / "audit"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "audit.log"
    env = {**os.environ, "PYTHONPATH": f"{hook}:{ROOT}", "EMBER_TEST_AUDIT": str(log),
           "EMBER_TEST_AUDIT_RECIPE": str(recipe.resolve())}
    env.pop(ENV, None)
    done = subprocess.run(ember_cmd(*args), capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    by_pid: dict[int, list[str]] = {}
    for line in log.read_text().splitlines():
        pid, text = line.split(" ", 1)
        by_pid.setdefault(int(pid), []).append(text)
    return done, by_pid


def test_a_supervised_run_reads_its_recipe_once_plans_once_and_its_supervisor_never_imports_torch(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 3})
    out = tmp_path / "run"
    done, procs = audited(tmp_path, recipe, "run", recipe, "--out", out, "--restarts", "2", "--no-ledger")
    assert done.returncode == 0, done.stderr
    supervisors = [pid for pid, lines in procs.items() if "--restarts" in lines[0]]
    children = [pid for pid, lines in procs.items() if "--no-supervise" in lines[0]]
    assert len(supervisors) == 1 and len(children) == 1, procs
    seen = "\n".join(f"{pid}: {lines}" for pid, lines in procs.items())
    opens = sum(lines.count("open-recipe") for lines in procs.values())
    assert opens == 1, f"the recipe file was opened {opens} times (want 1: read once):\n{seen}"
    assert "import torch" not in procs[supervisors[0]], f"the supervisor imported torch:\n{seen}"
    assert "import torch" in procs[children[0]], f"the audit hook saw no import in the child:\n{seen}"
    # The child plans nothing: it takes the supervisor's plan from the launch spec.
    assert "import ember.plan.planner" in procs[supervisors[0]], seen
    assert "import ember.plan.planner" not in procs[children[0]], f"the child planned again:\n{seen}"
    spec = LaunchSpec.from_dict(json.loads((out / "launch.json").read_text()))
    assert spec.is_for(out) and spec.restarts == 2 and spec.plan is not None and spec.plan.fits
    assert spec.recipe_digest == load_recipe(recipe).digest()
    assert completed(out) == 3


def test_the_child_trains_the_recipe_of_its_launch_spec_not_the_file(tmp_path):
    """A recipe file edited after the launch decided on it does not reach the training process."""
    recipe_file = write_recipe(tmp_path, train={"max_steps": 4})
    out = tmp_path / "run"
    out.mkdir()
    spec = LaunchSpec.create(out, load_recipe(recipe_file), recipe_file, [], PlannedMemory(1, "cpu", 2, True))
    path = write_launch_spec(out, spec)
    write_recipe(tmp_path, train={"max_steps": 9})  # edited after the launch
    done = subprocess.run(ember_cmd("run", recipe_file, "--out", out, "--no-supervise", "--no-ledger"),
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, ENV: str(path)})
    assert done.returncode == 0, done.stderr
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4]
    assert json.loads((out / "run.json").read_text())["recipe"]["train"]["max_steps"] == 4


def test_a_spec_of_another_run_folder_is_not_inherited(tmp_path, monkeypatch):
    recipe_file = write_recipe(tmp_path)
    spec = LaunchSpec.create(tmp_path / "a", load_recipe(recipe_file), recipe_file, [], None, job=7)
    (tmp_path / "a").mkdir()
    monkeypatch.setenv(ENV, str(write_launch_spec(tmp_path / "a", spec)))
    assert inherited_launch_spec(tmp_path / "b") is None
    got = inherited_launch_spec(tmp_path / "a")
    assert got == spec and got.job == 7 and got.build_recipe().digest() == spec.recipe_digest


def test_an_unreadable_spec_is_refused_by_name(tmp_path, monkeypatch):
    from ember.errors import EmberError
    bad = tmp_path / "launch.json"
    bad.write_text("{not json")
    monkeypatch.setenv(ENV, str(bad))
    with pytest.raises(EmberError, match=f"{ENV}=.*unreadable launch spec"):
        inherited_launch_spec(tmp_path)
