"""`ember runs`, `ember capacity` and `/metrics` give a run the figures `ember report` gives it,
on ledgers and run folders written by hand (times and seconds known exactly): a live run whose
first step compiled and one of whose steps learned nothing, a run SIGKILLed and not resumed yet
(its attempt has no outcome), and a run whose last attempt crashed after an earlier one stored
its summary."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ember.ledger import database as store
from ember.metrics.capacity import capacity_report
from ember.metrics.exposition import LedgerCollector
from ember.metrics.listing import run_table
from ember.metrics.report import build_report, summarize
from ember.recipe import Recipe

DEAD_PID = 2**22 + 1  # above Linux's pid_max: no process has it


def run_folder(con, tmp: Path, run_id: str, lines: list[dict]) -> Path:
    """A run folder (run.json at 1 TFLOP/s peak, 1e6 FLOPs a token, 3.6 an hour) with these
    metrics lines, registered in the ledger."""
    folder = tmp / run_id
    folder.mkdir()
    recipe = Recipe().to_dict()
    recipe["train"]["max_steps"] = 10
    recipe["cost"] = {**recipe.get("cost", {}), "device_hour_price": 3.6}
    (folder / "run.json").write_text(json.dumps({
        "id": run_id, "created": 0.0, "recipe": recipe,
        "performance": {"devices": 1, "flops_per_token": 1e6, "peak_flops": 1e12, "peak_source": "test"}}))
    write_lines(folder, lines)
    store.register_run(con, run_id, folder, run_id, "0" * 64, {}, 10)
    return folder


def write_lines(folder: Path, lines: list[dict], mode: str = "w") -> None:
    with open(folder / "metrics.jsonl", mode) as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))


def line(step: int, attempt: int, at: float, tokens: int = 100, seconds: float = 1.0, **extra) -> dict:
    return {"step": step, "loss": 2.0 if tokens else math.nan, "tokens": tokens, "step_seconds": seconds,
            "data_wait_seconds": 0.0, "attempt": attempt, "time": at, **extra}


def scrape(con) -> dict:
    registry = CollectorRegistry()
    registry.register(LedgerCollector(lambda: con))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}


def test_a_live_runs_tokens_per_second_leaves_out_compiles_and_steps_that_learned_nothing(tmp_path):
    """Step 1 (100 tokens) took 41 s, 40 of them compiling; step 2 learned no token in 1 s; step
    3, 100 tokens in 1 s: 200 tokens in 2 s of learning, 100 tokens/s, MFU 1e8 / 1e12 = 1e-4.
    `/metrics` once said 200 / 43 = 4.65 tokens/s for the same run."""
    con = store.connect(tmp_path / "ledger.db")
    run_folder(con, tmp_path, "live", [line(1, 1, 1041.0, seconds=41.0, compile_seconds=40.0),
                                       line(2, 1, 1042.0, tokens=0, skipped="empty"), line(3, 1, 1043.0)])
    store.start_attempt(con, "live", 1, time.time() - 60, socket.gethostname(), os.getpid(), "cpu x1", None)
    report = build_report(tmp_path / "live", con)
    assert report.run.status == "running"
    assert report.throughput.tokens_per_second_per_device == pytest.approx(100.0)
    got = scrape(con)
    assert got[("ember_tokens_per_second_per_device", (("run", "live"),))] == pytest.approx(100.0)
    assert got[("ember_mfu_ratio", (("run", "live"),))] == pytest.approx(report.mfu.value) == pytest.approx(1e-4)


def test_a_run_killed_and_not_resumed_has_its_reports_figures_on_metrics(tmp_path):
    """Attempt 1, 1000-1014: start-up 10 s, steps 1-4 of 1 s, no checkpoint, then SIGKILL (no
    outcome; its process gone). Its four steps will be computed again: no tokens/s, goodput 0 of
    14 s. `/metrics` once took it for a live run: 100 tokens/s from the lost steps, and no goodput."""
    con = store.connect(tmp_path / "ledger.db")
    run_folder(con, tmp_path, "dead", [line(s, 1, 1010.0 + s) for s in range(1, 5)])
    store.start_attempt(con, "dead", 1, 1000.0, socket.gethostname(), DEAD_PID, "cpu x1", None)
    store.Ledger(con, "dead", 1, print).event("startup", 1000.0, 1010.0, step=0)
    report = build_report(tmp_path / "dead", con)
    assert (report.run.status, report.throughput, report.goodput.wall_seconds) == ("killed", None, 14.0)
    assert report.goodput.goodput == 0.0 and report.goodput.buckets["wasted_progress"] == 4.0
    got = scrape(con)
    run = (("run", "dead"),)
    assert ("ember_tokens_per_second_per_device", run) not in got and ("ember_mfu_ratio", run) not in got
    assert got[("ember_goodput_ratio", run)] == 0.0
    assert got[("ember_badput_seconds", (("bucket", "wasted_progress"),) + run)] == 4.0
    assert got[("ember_badput_seconds", (("bucket", "program_startup"),) + run)] == 10.0


def test_a_crashed_attempt_leaves_no_earlier_summary_in_the_runs_table(tmp_path):
    """Attempt 1, 1000-1010: start-up 5 s, steps 1-4 of 1 s, checkpoint at 4, interrupted; its
    summary stored. Attempt 2, 1100-1120: resumed from 4, steps 5-8, then an unexpected exception:
    crashed, which stores no summary. The run: crashed, 4 steps that survive, 30 s held, goodput
    4 / 30, cost 30 s x 3.6 an hour = 0.03. `ember runs`, `/metrics` and `ember capacity` once kept
    attempt 1's figures: interrupted, 10 s, goodput 0.4, cost 0.01."""
    con = store.connect(tmp_path / "ledger.db")
    folder = run_folder(con, tmp_path, "r", [line(s, 1, 1005.0 + s) for s in range(1, 5)])
    (folder / "checkpoints" / "step-000000004").mkdir(parents=True)
    store.start_attempt(con, "r", 1, 1000.0, "elsewhere", DEAD_PID, "cpu x1", None)
    first = store.Ledger(con, "r", 1, print)
    first.event("startup", 1000.0, 1005.0, step=0)
    con.execute("UPDATE attempts SET end = 1010.0, last_seen = 1010.0, outcome = 'interrupted' WHERE attempt = 1")
    first.summary(asdict(summarize(build_report(folder, con))))
    write_lines(folder, [line(s, 2, 1105.0 + s) for s in range(5, 9)], "a")
    store.start_attempt(con, "r", 2, 1100.0, "elsewhere", DEAD_PID, "cpu x1", 4)
    store.Ledger(con, "r", 2, print).event("startup", 1100.0, 1105.0, step=4)
    con.execute("UPDATE attempts SET end = 1120.0, last_seen = 1120.0, outcome = 'crashed' WHERE attempt = 2")

    report = build_report(folder, con)
    assert (report.run.status, report.run.steps, report.goodput.wall_seconds) == ("crashed", 4, 30.0)
    assert report.goodput.goodput == pytest.approx(4 / 30) and report.cost.total == pytest.approx(0.03)
    (entry,) = run_table(con)
    assert (entry.status, entry.steps, entry.wall_seconds) == ("crashed", 4, 30.0)
    assert entry.goodput == pytest.approx(4 / 30) and entry.cost == pytest.approx(0.03)
    got = scrape(con)
    assert got[("ember_goodput_ratio", (("run", "r"),))] == pytest.approx(4 / 30)
    assert got[("ember_badput_seconds", (("bucket", "wasted_progress"), ("run", "r")))] == 4.0
    (device,) = capacity_report(con, None, now=2000.0).devices
    assert device.use.productive_seconds == pytest.approx(4.0)  # 30 s held x 4 / 30, not x 0.4
