"""Resume (ember.train.resume): what a resume that fails leaves in the run folder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ember.ckpt import contents
from ember.ckpt.state import RunState
from ember.ckpt.store import CheckpointStore
from ember.errors import EmberError
from ember.events import Events
from ember.recipe import load_recipe
from ember.runfolder import RunDir, read_record
from ember.train.resume import restore
from ember.world import World
from tests.helpers import write_recipe


def job_with(run: RunDir, recipe, model: torch.nn.Module) -> SimpleNamespace:
    """What restore() reads of a Job (ember.train.job), around a plain model."""
    optimizer = torch.optim.AdamW(model.parameters())
    return SimpleNamespace(recipe=recipe, run=run, device=torch.device("cpu"), model=model, optimizer=optimizer,
                           scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                           scaler=torch.amp.GradScaler("cpu", enabled=False), state=RunState(),
                           store=CheckpointStore(run.ckpt_dir, keep_last=2), events=Events(), world=World())


def test_a_changed_recipe_whose_checkpoint_does_not_load_is_not_recorded_as_the_runs(tmp_path):
    """`ember run --allow-recipe-change` with a model the checkpoint does not fit stopped with
    'Restore the recipe, or start a new --out', yet run.json kept the changed recipe: the original
    command was then refused ('belongs to a run with a different recipe'), and `ember export
    --checkpoint` built the changed model and could not load the checkpoint into it."""
    out = tmp_path / "o"
    original = load_recipe(write_recipe(tmp_path / "a"))
    job = job_with(RunDir.open(out, original, False, Events()), original, torch.nn.Linear(4, 4))
    snap = contents.snapshot(job.model, job.optimizer, job.scheduler, job.scaler, RunState(step=1), copy=False)
    job.store.save(1, lambda folder: contents.write_snapshot(folder, snap), meta={})
    job.run.lock.release()
    changed = load_recipe(write_recipe(tmp_path / "b", optimizer={"lr": 5e-4}))
    job = job_with(RunDir.open(out, changed, True, Events()), changed, torch.nn.Linear(5, 5))
    try:
        with pytest.raises(EmberError, match="is intact but does not load"):
            restore(job)
    finally:
        job.run.lock.release()
    assert read_record(out)["recipe"] == original.to_dict()
    RunDir.open(out, original, False, Events()).lock.release()  # the original command resumes
