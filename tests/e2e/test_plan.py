"""`ember plan` and `ember preflight` end to end."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from ember.cli.plan import cmd_plan
from ember.doctor.measure import calibrate
from ember.hardware import Device, Kind
from ember.plan.planner import make_plan
from ember.recipe import load_recipe
from ember.data.tokenizer import ByteTokenizer
from tests.e2e.test_orphans import assert_gone, command
from tests.helpers import ROOT, ember_cmd, run_ember, write_recipe


@pytest.fixture(autouse=True)
def own_ember_home(tmp_path, monkeypatch):
    """A plan reads this machine's history from the ledger (checkpoint rates, interruptions): each
    test plans against an empty one, not against whatever the worker's earlier tests recorded."""
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "ember_home"))


def test_plan_json_gives_the_peak_computed_by_hand(tmp_path):
    recipe = write_recipe(tmp_path, data={"seq_len": 128})
    result = run_ember("plan", recipe, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    # builtin:tiny, full fine-tuning, fp32, micro batch 4 x 128 tokens: the breakdown computed by
    # hand in tests/plan/test_memory.py::test_full_fp32_by_hand.
    assert plan["memory"]["peak"] == 8_770_816
    assert plan["fits"] and plan["verdict"] == "local"
    assert plan["checkpoint"]["seconds"] > 0 and plan["time"]["wall_seconds"] > 0


def test_a_device_without_a_known_peak_has_its_time_and_cost_unknown_not_nan(tmp_path, monkeypatch, capsys):
    """On an accelerator the peak table does not know (an Apple GPU, a T4), `ember plan` printed
    "time: nan s/step", "nan h wall-clock", "cost: nan USD" and "takes about nan h", and --json
    wrote NaN, which is not JSON (the dashboard's plan page showed "nan s")."""
    gpu = Device(0, "Apple GPU (mps)", Kind.MPS, 16 * 2**30, 16 * 2**30)
    monkeypatch.setattr("ember.doctor.calibrated_plan.planned_devices", lambda r, gib: [gpu])
    args = argparse.Namespace(recipe=write_recipe(tmp_path, cost={"device_hour_price": 2.0}), overrides=[],
                              target_micro_batch=None, calibrate=False, device_memory=None, ledger=None,
                              apply=None, fit=None, fit_seq=False, json=False)
    cmd_plan(args)
    text = capsys.readouterr().out
    assert not re.search(r"\bnan\b", text), text
    assert "time: unknown: unknown device 'Apple GPU (mps)'" in text and "how long it takes is unknown" in text
    cmd_plan(argparse.Namespace(**{**vars(args), "json": True}))
    plan = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"--json wrote {c}"))
    assert plan["time"]["step_seconds"] is None and plan["cost"]["total"] is None


def test_remedies_make_it_fit_under_a_memory_cap(tmp_path):
    """A recipe that needs ~0.5 GiB, planned for a 200 MiB device: the best remedy's real,
    measured peak fits the cap."""
    r = load_recipe(write_recipe(tmp_path, train={"micro_batch": 64}, data={"seq_len": 512}))
    cap = 200 * 2**20
    plan = make_plan(r, None, None, [Device(0, "capped", Kind.CPU, cap, cap)])
    assert not plan.fits and plan.verdict == "local with remedies"
    best = next(x for x in plan.remedies if x.fits and x.available)
    fixed = r.with_changes(best.changes)
    measured = calibrate(fixed, steps=1).peak_bytes
    assert measured * (1 + r.plan.memory_margin) <= cap, (best.name, measured)
    assert abs(best.peak / measured - 1) < 0.10


def test_apply_writes_a_recipe_that_fits(tmp_path):
    recipe = write_recipe(tmp_path, train={"micro_batch": 64}, data={"seq_len": 512})
    out = tmp_path / "fitted.toml"
    result = run_ember("plan", recipe, "--device-memory", "0.2", "--apply", out)
    assert result.returncode == 0, result.stderr
    assert "does not fit as written" in result.stdout and f"wrote {out}" in result.stderr
    again = run_ember("plan", out, "--device-memory", "0.2", "--json")
    assert json.loads(again.stdout)["fits"]
    r = load_recipe(out)  # a valid recipe, same tokens per optimizer step
    assert r.train.micro_batch * r.train.grad_accum == 64  # same tokens per optimizer step


def test_target_micro_batch_and_remote_verdict(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 10_000_000}, text="[plan]\nlocal_max_hours = 1\n")
    result = run_ember("plan", recipe, "--target-micro-batch", "8", "--json")
    plan = json.loads(result.stdout)
    assert plan["recipe"]["micro_batch"] == 8
    assert plan["verdict"] == "remote" and "local_max_hours" in plan["reasons"][0]


def test_bad_input(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    recipe = write_recipe(tmp_path, model={"path": str(empty)})
    result = run_ember("plan", recipe)
    assert result.returncode == 1 and "no config.json" in result.stderr and "Traceback" not in result.stderr
    bad = write_recipe(tmp_path / "b", data={"seq_len": 0})
    result = run_ember("plan", bad)
    assert result.returncode == 1 and "seq_len = 0" in result.stderr
    result = run_ember("plan", write_recipe(tmp_path / "c"), "--device-memory", "-1")
    assert result.returncode == 1 and "--device-memory" in result.stderr


def test_unknown_architecture_is_traced_and_calibrate_measures_it(tmp_path):
    """A family without formulas is planned from its step traced on fake tensors (issue 30,
    item 3; before, the plan measured a step); --calibrate still measures, beside the trace."""
    from transformers import GPT2Config, GPT2LMHeadModel
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=257, n_positions=256)).save_pretrained(folder)
    ByteTokenizer().save(folder)
    recipe = write_recipe(tmp_path, model={"path": str(folder)})
    result = run_ember("plan", recipe, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["memory"]["phase"] == "the traced step's high point" and plan["memory"]["peak"] > 0
    assert any("gpt2" in n and "traced" in n for n in plan["notes"])
    result = run_ember("plan", recipe, "--json", "--calibrate")
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)["memory"]
    assert measured["peak"] == plan["memory"]["peak"] and abs(measured["error"]) <= 0.02, measured


def test_preflight_passes_on_a_healthy_recipe(tmp_path):
    result = run_ember("preflight", write_recipe(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert set(checks) == {"data", "memory", "input", "loss", "resume"}
    assert all(c["ok"] for c in checks.values())
    assert abs(checks["memory"]["figures"]["error"]) < 0.10


def test_preflight_catches_a_nan_config_and_run_stops(tmp_path):
    recipe = write_recipe(tmp_path, optimizer={"lr": 1e8}, schedule={"warmup_steps": 0})
    result = run_ember("preflight", recipe)
    assert result.returncode == 1
    assert "FAIL  loss" in result.stdout and "update skipped" in result.stdout
    run = run_ember("run", recipe, "--out", tmp_path / "run", "--preflight")
    assert run.returncode == 1 and "preflight failed (loss" in run.stderr
    assert not (tmp_path / "run").exists()


def test_preflight_catches_a_state_that_does_not_resume(tmp_path):
    result = run_ember("preflight", write_recipe(tmp_path),
                       env={"EMBER_FAULT_FLAGS": "resume.fresh_optimizer"})
    assert result.returncode == 1
    assert "FAIL  resume" in result.stdout and "differs" in result.stdout


def test_preflights_short_run_ends_with_a_killed_preflight(tmp_path):
    """`ember preflight` SIGKILLed while its short run trains: the run (and anything under it) goes
    with it, rather than training on to its end unwatched. Before, it trained on and wrote final/."""
    steps = 5000  # far more than the short run reaches before the kill (a few ms a step)
    preflight = subprocess.Popen(ember_cmd("preflight", write_recipe(tmp_path), "--steps", str(steps)),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                 start_new_session=True)
    run, seen = None, []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and preflight.poll() is None:
            run = next((p for p in psutil.Process(preflight.pid).children() if " run " in command(p)), None)
            seen = sorted((tmp_path / "ember_home" / "scratch").glob("preflight-*/a/metrics.jsonl"))
            if run and seen and seen[0].read_text().count("\n") >= 1:
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"preflight's short run never logged a step (preflight's exit code "
                                 f"{preflight.poll()}, its run {run}, metrics {seen}): "
                                 f"{preflight.stderr.read()[-2000:] if preflight.poll() is not None else ''}")
        under = [run, *run.children(recursive=True)]
        preflight.kill()
        preflight.wait()
        assert_gone(under, "preflight's short run")
        folder = seen[0].parent
        logged = folder.joinpath("metrics.jsonl").read_text().count("\n")
        assert not (folder / "final").exists() and logged < steps, \
            f"the short run trained on to its end after preflight was killed ({logged} steps logged)"
    finally:
        try:
            os.killpg(preflight.pid, signal.SIGKILL)  # the group this test made
        except ProcessLookupError:
            pass
        preflight.wait()


def test_plan_fit_searches_a_family_without_formulas(tmp_path):
    """`ember plan --fit` on GPT-2 (no formulas): each configuration's step traced (before, it
    refused: '--fit searches with the memory formulas'); the pick as --set lines, and why QLoRA
    is not searched."""
    from transformers import GPT2Config, GPT2LMHeadModel
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=257, n_positions=256)).save_pretrained(folder)
    ByteTokenizer().save(folder)
    recipe = write_recipe(tmp_path, model={"path": str(folder)}, train={"micro_batch": 1}, cost={"peak_tflops": 1.0})
    result = run_ember("plan", recipe, "--fit", "1GiB")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("1. fastest that fits: "))
    assert "MiB peak" in lines[first] and "s/step predicted" in lines[first], result.stdout
    assert "steps traced" in result.stdout and "QLoRA not searched" in result.stdout
