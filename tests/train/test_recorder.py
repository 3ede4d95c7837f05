"""The run recorder (ember.train.recorder) on a real prepared job: each step's metrics line and
progress event (tokens/s over the steps that learned tokens, the ETA over all of them), the
ledger's events, phase totals and outcome; and the no-op stand-ins of a rank that does not
write the run folder."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest

from ember.events import Events
from ember.recipe import load_recipe
from ember.train.job import prepare
from ember.train.loop import StepResult
from ember.train.recorder import NoMetrics, RunRecorder
from ember.world import World
from tests.helpers import write_recipe


@pytest.fixture
def job(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r", train={"max_steps": 4}))
    seen: list = []
    j = prepare(recipe, tmp_path / "run", False, Events(seen.append), ledger_path=tmp_path / "ledger.db")
    j.seen = seen
    yield j
    j.ledger.close()


def step(tokens: int, verdict: str = "ok") -> StepResult:
    return StepResult(loss=2.5, grad_norm=1.0, lr=1e-3, tokens=tokens, batches=[0], next_k=1, verdict=verdict,
                      applied=verdict == "ok", phases={"data": 0.25, "forward": 0.5})


def test_each_step_is_a_metrics_line_a_progress_event_and_phase_totals(job, tmp_path):
    record = RunRecorder(job)
    record.startup()
    job.state.step, job.state.tokens_seen = 1, 64
    record.step(step(64), 1.0, {"eval_loss": 2.0})
    record.progress(step(64), 1.0)
    job.state.step = 2  # an empty step: 3 s and no token learned
    record.step(step(0, "empty"), 3.0, {})
    record.progress(step(0, "empty"), 3.0)
    record.checkpointed()
    record.close(completed=False)
    record.attempt_end()
    record.interrupted("SIGTERM")

    lines = [json.loads(x) for x in job.run.metrics_path.read_text().splitlines()]
    assert [(x["step"], x["tokens"], x["tokens_seen"], x.get("skipped"), x.get("eval_loss")) for x in lines] == \
        [(1, 64, 64, None, 2.0), (2, 0, 64, "empty", None)]
    assert lines[0]["data_wait_seconds"] == 0.25 and lines[0]["phases"] == {"data": 0.25, "forward": 0.5}
    progress = [e.data for e in job.seen if e.kind == "progress"]
    # tokens/s over the 1 s that learned tokens: 64; ETA: (4 - step) x the mean of all the steps' seconds
    assert [(p["tokens_per_second"], p["eta_seconds"]) for p in progress] == [(64.0, 3.0), (64.0, 4.0)]
    assert job.phase_totals == {"data": 0.5, "forward": 1.0}
    assert (record.tokens, record.seconds, record.step_seconds) == (64, 4.0, [1.0, 3.0])

    con = sqlite3.connect(tmp_path / "ledger.db")
    assert [k for (k,) in con.execute("SELECT kind FROM events ORDER BY id")] == ["startup"]
    assert dict(con.execute("SELECT phase, seconds FROM step_phases")) == {"data": 0.5, "forward": 1.0}
    assert con.execute("SELECT outcome, detail FROM attempts").fetchall() == [("interrupted", "SIGTERM")]
    # No checkpoint yet: said so (it said 'newest committed checkpoint is step 0', which there is not)
    assert any("SIGTERM: no checkpoint committed yet (stopped at step 2); run the same command to start again"
               in e.message for e in job.seen), [e.message for e in job.seen]


def test_a_rank_that_does_not_write_the_run_folder_records_nothing_there(job):
    before = job.run.metrics_path.read_bytes() if job.run.metrics_path.exists() else b""
    job.world = dataclasses.replace(job.world, rank=1)  # not rank 0: no metrics.jsonl, no [log] sinks
    record = RunRecorder(job)
    assert isinstance(record.metrics, NoMetrics) and record.scalars.sinks == []
    job.state.step = 1
    record.step(step(64), 1.0, {})
    record.checkpointed()
    record.close(completed=False)
    after = job.run.metrics_path.read_bytes() if job.run.metrics_path.exists() else b""
    assert after == before
    assert World().main and not job.world.main
