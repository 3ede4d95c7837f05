"""[log] sinks for real: a run killed mid-way and resumed leaves TensorBoard event files and one
MLflow run whose per-step losses are metrics.jsonl's, each surviving step once."""

from __future__ import annotations

import json
import struct

import pytest

from ember.train.scalars import scalars_of
from tests.helpers import run_ember, write_recipe

pytestmark = pytest.mark.e2e


def f32(x: float) -> float:
    """TensorBoard keeps scalars as float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def test_a_resumed_run_logs_its_surviving_steps_to_tensorboard_and_mlflow(tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    uri = f"file:{tmp_path / 'mlruns'}"
    recipe = write_recipe(tmp_path / "r", log={"tensorboard": True, "mlflow_tracking_uri": uri})
    out = tmp_path / "run"
    env = {"MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow 3 keeps its file store for those who ask
    killed = run_ember("run", recipe, "--out", out, env={**env, "EMBER_FAULT": "train.micro_batch@13"})
    assert killed.returncode == -9, killed.stderr  # during step 13: the steps after its newest checkpoint are lost
    done = run_ember("run", recipe, "--out", out, env=env)
    assert done.returncode == 0, done.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == list(range(1, 25))
    lost = [json.loads(x)["step"] for x in (out / "metrics.lost.jsonl").read_text().splitlines()]
    assert lost and lost == list(range(lost[0], 13))  # computed, lost, computed again

    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(r["step"], f32(r["loss"])) for r in metrics]
    assert [e.step for e in tb.Scalars("train/step_seconds")] == list(range(1, 25))
    assert set(tb.Tags()["scalars"]) == {f"train/{k}" for k in scalars_of(metrics[0])}

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ember")
    run_id = json.loads((out / "run.json").read_text())["id"]
    runs = client.search_runs([exp.experiment_id])
    assert [r.data.tags["ember.run_id"] for r in runs] == [run_id] and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    newest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert newest == {r["step"]: r["loss"] for r in metrics}
