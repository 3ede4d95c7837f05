"""Early stopping ([eval] patience): a run whose held-out loss stops improving completes early,
says why (run.json, the report), keeps its best checkpoint through retention, is not trained
further by the same command, and ends bit for bit the same when it was killed and resumed
(the best loss, its step and the patience counter are RunState).

The recipe: the builtin tiny model at a high constant learning rate, so the held-out loss turns
up within a few dozen steps; an evaluation every 2 steps, patience 3."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.artifacts import shared
from tests.helpers import assert_same_result, losses, run_ember, write_recipe

pytestmark = pytest.mark.e2e
SECTIONS = {"optimizer": {"lr": 3e-2}, "schedule": {"kind": "constant", "warmup_steps": 0},
            "train": {"max_steps": 200},
            "checkpoint": {"every_steps": 2, "keep_last": 1, "async": False},
            "eval": {"holdout": 0.1, "every_steps": 2, "max_batches": 4, "patience": 3}}


def held_out(run: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r}


@pytest.fixture(scope="module")
def stopped() -> Path:
    """The uninterrupted run, made once for all workers."""
    def build(folder: Path) -> None:
        done = run_ember("run", write_recipe(folder, **SECTIONS), "--out", folder / "run")
        assert done.returncode == 0, done.stderr[-3000:]
    return shared("early-stopping", SECTIONS, build) / "run"


def test_patience_stops_the_run_and_keeps_the_best_checkpoint(stopped, tmp_path):
    record = json.loads((stopped / "run.json").read_text())
    evals = held_out(stopped)
    last = max(evals)
    best = min(evals, key=evals.get)
    assert record["completed_step"] == last < 200
    # three evaluations after the best, none lower: what patience 3 means
    assert sorted(s for s in evals if s > best) == [best + 2, best + 4, best + 6] == sorted(evals)[-3:]
    assert f"[eval] patience = 3); the best, {evals[best]:.4f}, was at step {best}" in record["stopped_early"]
    # keep_last = 1, and the best survives it
    assert sorted(p.name for p in (stopped / "checkpoints").glob("step-*")) == \
        [f"step-{best:09d}", f"step-{last:09d}"]
    report = run_ember("report", stopped)
    assert report.returncode == 0 and "stopped early at step" in report.stdout, report.stdout + report.stderr


def test_the_same_command_does_not_train_a_stopped_run_further(stopped, tmp_path):
    from tests.artifacts import copy_of
    run = copy_of(stopped, tmp_path / "run")
    before = (run / "metrics.jsonl").read_text()
    again = run_ember("run", write_recipe(tmp_path, **SECTIONS), "--out", run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already completed" in again.stdout
    assert (run / "metrics.jsonl").read_text() == before


def test_a_run_killed_while_counting_patience_resumes_to_the_same_end(stopped, tmp_path):
    """Killed in the step after the checkpoint where two evaluations had not improved: the
    resumed run must stop where the uninterrupted one did (a lost counter would train longer)."""
    last = json.loads((stopped / "run.json").read_text())["completed_step"]
    recipe = write_recipe(tmp_path, **SECTIONS)
    out = tmp_path / "run"
    killed = run_ember("run", recipe, "--out", out, env={"EMBER_FAULT": f"train.micro_batch@{last - 1}"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_ember("run", recipe, "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{last - 2:09d}" in resumed.stderr  # resumed two evaluations into its patience
    assert_same_result(out, stopped)
    assert losses(out)[-1][0] == last and held_out(out) == held_out(stopped)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == \
        sorted(p.name for p in (stopped / "checkpoints").glob("step-*"))
