"""Why a job does not train now, in words (ember.sched.job_view.why_waiting), and what the
service reads of a run folder: its last step and whether it completed."""

import json

from ember.ledger.job_rows import JobRow
from ember.sched.job_view import Inference, completed, last_step, last_step_time, why_waiting

INFERENCE = Inference(device=0, idle_gap_seconds=2.0)


def job(state: str, **kw) -> JobRow:
    return JobRow(id=1, name="j", recipe="/r.toml", out="/runs/j", overrides=[], priority=0, state=state,
                  submitted=0.0, updated=0.0, request={"memory": 1}, **kw)


def test_a_training_or_finished_job_waits_for_nothing():
    assert why_waiting(job("running"), [], None, INFERENCE, None) == []
    assert why_waiting(job("failed", hold="user"), ["yield: ember yield"], None, INFERENCE, None) == []


def test_each_reason_is_said_with_the_way_out():
    held = why_waiting(job("queued", hold="user"), [], None, INFERENCE, "memory: too big")
    assert held == ["held by hand (a hard pause): `ember resume j` lets it start again"]  # not admission's
    assert why_waiting(job("preempting", hold="cancel"), [], None, INFERENCE, None) == ["being cancelled"]
    assert "stopped by a signal from outside" in why_waiting(job("queued", hold="interrupted"), [], None,
                                                             INFERENCE, None)[0]
    paused = why_waiting(job("soft-paused", pause="user"), ["cpu.max_other_load: busy"], "user", INFERENCE, None)
    assert paused == ["paused by hand (soft, the process kept): `ember resume j`", "cpu.max_other_load: busy"]
    assert why_waiting(job("soft-paused"), [], "inference", INFERENCE, None) == \
        ["inference requests on device 0 (it resumes 2 s after the last one)"]
    auto = Inference(device=0, idle_gap_seconds=0.41234, idle_gap_rule="auto (12 periods)")
    assert why_waiting(job("soft-paused"), [], "inference", auto, None) == \
        ["inference requests on device 0 (it resumes 0.412 s after the last one; idle gap auto (12 periods))"]
    assert why_waiting(job("queued"), [], None, INFERENCE, "memory: too big") == ["memory: too big"]
    assert why_waiting(job("queued"), [], None, INFERENCE, None) == ["waiting for the scheduler's next decision"]
    assert why_waiting(job("queued"), ["yield: ember yield"], None, INFERENCE, "memory") == ["yield: ember yield"]


def test_the_run_folder_says_its_last_step_and_whether_it_completed(tmp_path):
    assert (last_step(tmp_path), last_step_time(tmp_path), completed(tmp_path)) == (0, 0.0, False)
    lines = [json.dumps({"step": s, "time": 100.0 + s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 4, \"ti")  # a torn last line
    assert (last_step(tmp_path), last_step_time(tmp_path)) == (3, 103.0)
    (tmp_path / "run.json").write_text(json.dumps({"recipe": {}, "completed_step": 3}))  # as every run.json has one
    assert not completed(tmp_path)  # final/ is not there yet
    (tmp_path / "final").mkdir()
    assert completed(tmp_path)


def test_a_metrics_file_ember_did_not_write_reads_as_no_step(tmp_path):
    """A job's --out pointed at a folder whose metrics.jsonl another tool wrote: a last line with an
    ISO time, a step named 'train', a list or a null raised ValueError, AttributeError or
    TypeError in the scheduler's pass (which then stopped for good: its thread retries only
    database and disk errors) and in every GET /api/jobs (500). Such a line is no step now."""
    for line, read in (('{"step": 3, "time": "2024-01-01T00:00:00"}', (3, 0.0)),
                       ('{"step": "train", "time": 1.5}', (0, 1.5)), ("[1, 2]", (0, 0.0)), ("7", (0, 0.0)),
                       ('{"step": null, "time": null}', (0, 0.0)), ('{"step": 1e400, "time": 1e400}', (0, 0.0)),
                       ('{"step": true, "time": false}', (0, 0.0))):
        (tmp_path / "metrics.jsonl").write_text(line + "\n")
        assert (last_step(tmp_path), last_step_time(tmp_path)) == read, line
