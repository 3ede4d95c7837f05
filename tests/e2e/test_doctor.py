"""`ember doctor` names the right top cause for each injected bottleneck, with no false alarm
on a healthy configuration."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from ember.doctor.diagnose import THRESHOLD
from ember.train.model import ByteTokenizer
from tests.helpers import run_ember, write_recipe


def doctor(recipe, *args, env=None) -> dict:
    result = run_ember("doctor", recipe, "--budget", "10", "--json", *args, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def top(report: dict) -> str:
    return report["findings"][0]["cause"]


def test_slow_input_pipeline_is_input_bound(tmp_path):
    report = doctor(write_recipe(tmp_path), env={"EMBER_FAULT_DATA_DELAY": "0.02"})
    assert top(report) == "input-bound"
    first = report["findings"][0]
    assert "the loader alone delivers" in first["evidence"][0]
    assert report["figures"]["loader_batches_per_second"] < 60  # 20 ms a micro-batch
    assert first["changes"] == {"data.workers": report["figures"]["suggested_workers"]}


def test_synchronous_checkpoint_every_step_is_checkpoint_bound(tmp_path):
    report = doctor(write_recipe(tmp_path, checkpoint={"every_steps": 1, "async": False}))
    assert top(report) == "checkpoint-bound"
    assert report["findings"][0]["changes"] == {"checkpoint.async": True}


def test_micro_batch_one_is_overhead_bound(tmp_path):
    report = doctor(write_recipe(tmp_path, train={"micro_batch": 1}))
    assert top(report) == "overhead-bound"
    assert report["findings"][0]["changes"]["train.micro_batch"] >= 8


def test_healthy_configuration_is_compute_bound(tmp_path, ember_home):
    plots = tmp_path / "plots"
    report = doctor(write_recipe(tmp_path, train={"micro_batch": 32}, data={"seq_len": 128}), "--plots", plots)
    assert top(report) == "compute-bound"
    assert all(x["saving_share"] < THRESHOLD for x in report["findings"][1:])
    h = report["headline"]
    assert h["tokens_per_second_per_device"] > 0 and 0 < h["mfu"] and h["step_p99"] >= h["step_p50"]
    assert (plots / "doctor.png").stat().st_size > 10_000


def test_slow_gradient_synchronisation_is_communication_bound(tmp_path):
    """Two processes, DDP over gloo on loopback, a wide model with tiny compute per step."""
    folder = tmp_path / "wide"
    LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                 num_attention_heads=8, max_position_embeddings=64)).save_pretrained(folder)
    ByteTokenizer().save(folder)
    recipe = write_recipe(tmp_path, model={"path": str(folder)}, train={"micro_batch": 4}, data={"seq_len": 16})
    report = doctor(recipe, "--ddp", "2")
    assert top(report) == "communication-bound"
    f = report["figures"]
    assert f["ddp_sync_seconds"] > f["ddp_nosync_seconds"] and f["ddp_allreduce_seconds"] > 0


def test_a_run_folder_gives_the_runs_own_figures(tmp_path):
    recipe = write_recipe(tmp_path)
    assert run_ember("run", recipe, "--out", tmp_path / "run").returncode == 0
    report = doctor(tmp_path / "run")
    assert report["headline"]["source"].startswith("run ") and report["headline"]["goodput"] > 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert set(rows[-1]["phases"]) == {"data", "h2d", "forward", "backward", "sync", "optimizer", "checkpoint"}
    assert sum(rows[-1]["phases"].values()) == pytest.approx(rows[-1]["step_seconds"], rel=0.2, abs=2e-3)


def test_bad_input(tmp_path):
    result = run_ember("doctor", tmp_path / "nothing")
    assert result.returncode == 1 and "no such run folder or recipe" in result.stderr
    result = run_ember("doctor", write_recipe(tmp_path), "--budget", "0")
    assert result.returncode == 1 and "--budget" in result.stderr
