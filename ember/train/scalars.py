"""Where else a step's figures go, beside metrics.jsonl: the tools a team already watches.

    [log] tensorboard = true         OUT/tensorboard: event files through torch.utils.tensorboard;
                                     a resumed attempt purges the steps after its checkpoint, so
                                     the curves hold the surviving steps, as metrics.jsonl does
    [log] mlflow_tracking_uri = URI  one MLflow run per ember run (tag ember.run_id), every attempt
                                     logging to it; steps computed again after a resume are logged
                                     again (MLflow keeps the whole history)

Neither package is required by ember: asking for one that is not installed stops the run at its
start with what to install. Only rank 0 writes (it writes the run folder too).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

from ember.errors import EmberError
from ember.recipe import LogConfig

SCALARS = ("loss", "lr", "grad_norm", "tokens", "tokens_seen", "step_seconds", "data_wait_seconds",
           "eval_loss", "eval_perplexity")


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl line that are drawn as curves (finite ones only)."""
    return {k: float(record[k]) for k in SCALARS if isinstance(record.get(k), (int, float))
            and math.isfinite(record[k])}


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...
    def flush(self) -> None: ...
    def close(self, completed: bool) -> None: ...


class TensorBoard:
    def __init__(self, folder: Path, resumed_from: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise EmberError(f"[log] tensorboard = true needs the tensorboard package ({e}): `pip install "
                             f"tensorboard`, or set log.tensorboard = false") from None
        # purge_step: TensorBoard drops the events of earlier attempts from this step on, which
        # are the steps a killed attempt computed after its last checkpoint.
        self.writer = SummaryWriter(str(folder), purge_step=resumed_from + 1 if resumed_from else None)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"train/{key}" if not key.startswith("eval_") else f"eval/{key[5:]}",
                                   value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, completed: bool) -> None:
        self.writer.close()


class Mlflow:
    def __init__(self, cfg: LogConfig, run_id: str, attempt: int):
        try:
            import mlflow
            from mlflow.entities import Metric
        except ImportError as e:
            raise EmberError(f"[log] mlflow_tracking_uri is set but mlflow is not installed ({e}): `pip install "
                             f"mlflow` (or mlflow-skinny), or set log.mlflow_tracking_uri = ''") from None
        self.Metric = Metric
        try:
            self.client = mlflow.MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
            exp = self.client.get_experiment_by_name(cfg.mlflow_experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.mlflow_experiment)
            found = self.client.search_runs([exp_id], filter_string=f"tags.`ember.run_id` = '{run_id}'")
            self.run = found[0].info.run_id if found else self.client.create_run(
                exp_id, run_name=run_id, tags={"ember.run_id": run_id}).info.run_id
            self.client.set_tag(self.run, "ember.attempt", str(attempt))
        except mlflow.exceptions.MlflowException as e:
            raise EmberError(f"[log] mlflow_tracking_uri {cfg.mlflow_tracking_uri!r}: {e}") from None
        self.pending: list[Any] = []

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.pending += [self.Metric(k, v, now, step) for k, v in values.items()]
        if len(self.pending) >= 500:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self.pending), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run, metrics=self.pending[i:i + 1000])
        self.pending = []

    def close(self, completed: bool) -> None:
        self.flush()
        self.client.set_terminated(self.run, "FINISHED" if completed else "KILLED")


class Scalars:
    """The sinks the recipe asks for; with none, every call does nothing."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, record: dict[str, Any]) -> None:
        values = scalars_of(record)
        for s in self.sinks:
            s.log(record["step"], values)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self, completed: bool = False) -> None:
        for s in self.sinks:
            s.close(completed)


def open_sinks(cfg: LogConfig, run: Path, run_id: str, attempt: int, resumed_from: int) -> Scalars:
    """The sinks `cfg` names, opened for this attempt (which resumed from step `resumed_from`)."""
    sinks: list[Sink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoard(run / "tensorboard", resumed_from))
    if cfg.mlflow_tracking_uri:
        sinks.append(Mlflow(cfg, run_id, attempt))
    return Scalars(sinks)
