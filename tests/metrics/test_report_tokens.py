"""No figure over zero tokens in `ember report`: a step that learned no token is left out of the
loss, tokens/s and MFU (not averaged in as 0); an evaluation over no token has no loss."""

from __future__ import annotations

import json
import math

import pytest

from ember.errors import EmberError
from ember.metrics.compare import compare_folders, compare_runs
from ember.metrics.report import build_report, summary_line
from ember.recipe import Recipe


def write_run(folder, steps: list[tuple[int, float, float]], data: dict | None = None) -> None:
    """A run folder whose metrics.jsonl holds (tokens, loss, step_seconds) per step."""
    folder.mkdir(parents=True)
    record = {"id": folder.name, "recipe": Recipe().to_dict(), "data": data or {},
              "performance": {"devices": 1, "flops_per_token": 1e6, "peak_flops": 1e12, "peak_source": "test"}}
    (folder / "run.json").write_text(json.dumps(record))
    lines = [json.dumps({"step": i, "loss": loss, "tokens": tokens, "step_seconds": seconds, "data_wait_seconds": 0.0,
                         "attempt": 1, "time": 1000.0 + i, **({} if tokens else {"skipped": "empty"})})
             for i, (tokens, loss, seconds) in enumerate(steps, 1)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_steps_without_learned_tokens_are_not_averaged_in(tmp_path):
    write_run(tmp_path / "r", [(0, math.nan, 1.0), (100, 3.0, 0.5), (0, math.nan, 2.0), (300, 2.5, 1.5),
                               (0, math.nan, 1.0)])
    report = build_report(tmp_path / "r", None)
    assert report.throughput.tokens_per_second == 400 / 2.0  # the two steps that learned: not 400 / 6.0
    assert report.mfu.value == 200 * 1e6 / 1e12
    assert (report.loss.first, report.loss.last) == (3.0, 2.5)
    assert report.step_time.count == 5  # time is time: every step's


def test_a_run_whose_steps_learned_nothing_has_no_throughput_and_no_mfu(tmp_path):
    write_run(tmp_path / "r", [(0, math.nan, 1.0), (0, math.nan, 1.0)])
    report = build_report(tmp_path / "r", None)
    assert report.throughput is None and report.loss is None
    assert report.mfu.value is None and report.mfu.reason == "no step learned a token"
    line = summary_line(report)
    assert "tokens/s" not in line and "MFU n/a (no step learned a token)" in line


def test_an_evaluation_over_no_token_has_no_figure(tmp_path):
    write_run(tmp_path / "r", [(100, 3.0, 1.0), (100, 2.9, 1.0)])
    (tmp_path / "r" / "eval").mkdir()
    (tmp_path / "r" / "eval" / "step-000000001.json").write_text(json.dumps(
        {"step": 1, "loss": 3.1, "perplexity": 22.2, "tokens": 40, "row_loss": [124.0], "row_tokens": [40]}))
    (tmp_path / "r" / "eval" / "step-000000002.json").write_text(json.dumps(
        {"step": 2, "tokens": 0, "row_loss": [0.0], "row_tokens": [0]}))
    assert build_report(tmp_path / "r", None).held_out == [{"step": 1, "loss": 3.1, "perplexity": 22.2, "tokens": 40}]


def test_the_report_says_what_the_data_holds_to_learn(tmp_path):
    learning = {"records": 40, "before": 750, "learned": 187, "cut": 30, "emptied": 30, "dropped": 0,
                "longest": [382, 381, 380], "p95": 381, "seq_len": 64, "rule": "truncate"}
    write_run(tmp_path / "r", [(100, 3.0, 1.0)], {"format": "chat", "long_records": "truncate",
                                                   "learning": learning, "warnings": ["30 of 40 lose all"]})
    d = build_report(tmp_path / "r", None).data
    assert d.warnings == ["30 of 40 lose all"]
    assert d.text() == ("data: 40 chat records, 187 tokens learned per epoch at seq_len 64 (of 750; "
                        "long_records = truncate); 30 records lost some of their learned tokens, 30 all")


def test_runs_with_the_same_empty_steps_compare_identical():
    record = {"recipe": Recipe().to_dict()}
    same = {1: math.nan, 2: 3.0}
    assert compare_runs(record, record, same, dict(same), 0.0).verdict == "identical"
    other = compare_runs(record, record, same, {1: 2.0, 2: 3.0}, 1.0)
    assert other.verdict == "diverged" and other.first_differing_step == 1


@pytest.mark.parametrize("tolerance", [math.nan, -1.0])
def test_a_tolerance_no_difference_can_be_within_is_refused(tmp_path, tolerance):
    """`ember compare A B --tolerance nan` (or -1) once called two runs 1e-6 apart 'diverged'
    (exit 4): nothing is within nan, or within a negative tolerance."""
    write_run(tmp_path / "a", [(100, 3.0, 1.0), (100, 2.5, 1.0)])
    write_run(tmp_path / "b", [(100, 3.0, 1.0), (100, 2.5 + 1e-6, 1.0)])
    assert compare_folders(tmp_path / "a", tmp_path / "b", 1e-3).verdict == "close"
    with pytest.raises(EmberError, match=rf"--tolerance {tolerance:g}: must be a number >= 0"):
        compare_folders(tmp_path / "a", tmp_path / "b", tolerance)


def test_the_seconds_a_step_spent_compiling_are_no_part_of_tokens_per_second(tmp_path):
    """[train] compile: the first step's compile (its metrics line's compile_seconds) is the
    goodput bucket `compile`, not training: tokens/s and MFU are over the rest of the step."""
    write_run(tmp_path / "r", [(100, 3.0, 40.5), (300, 2.5, 1.5)])
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    first = {**json.loads(lines[0]), "compile_seconds": 40.0}
    (tmp_path / "r" / "metrics.jsonl").write_text("\n".join([json.dumps(first), lines[1]]) + "\n")
    report = build_report(tmp_path / "r", None)
    assert report.throughput.tokens_per_second == 400 / 2.0


@pytest.mark.parametrize("change, why", [
    ({"loss": None}, 'no "loss"'),  # None: the field removed
    ({"step_seconds": "0.5"}, '"step_seconds" is "0.5", not int or float'),
    ({"attempt": True}, '"attempt" is true, not int'),
    ({"step": None}, 'no "step"')])
def test_a_metrics_line_without_a_field_the_report_reads_is_named(tmp_path, change, why):
    """A metrics line that is an object but lacks what `ember report`, `ember compare` and the
    report's charts read once ended in a KeyError or TypeError traceback; it is named by its
    line, as a corrupted line is, and the file is left as it was."""
    folder = tmp_path / "r"
    write_run(folder, [(100, 3.0, 0.5), (100, 2.5, 0.5), (100, 2.0, 0.5)])
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines()
    line = {**json.loads(lines[1]), **change}
    line = {k: v for k, v in line.items() if not (v is None and k in change)}
    path.write_text("\n".join([lines[0], json.dumps(line), lines[2]]) + "\n")
    before = path.read_bytes()
    where = rf"metrics\.jsonl:2: not one of ember's lines \({why}\)"
    with pytest.raises(EmberError, match=where):
        build_report(folder, None)
    with pytest.raises(EmberError, match=where):
        compare_folders(folder, folder, 0.0)
    assert path.read_bytes() == before
