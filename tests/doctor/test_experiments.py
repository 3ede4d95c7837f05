"""The doctor's experiments on a machine slower than their estimates: rounds that did not fit
leave no figures behind (a figure with no samples crashed the ranking: CI, a busy machine)."""

from __future__ import annotations

import dataclasses
import time

import torch

from ember.doctor import experiments
from ember.doctor.diagnose import Shape
from ember.events import Events
from ember.recipe import load_recipe
from ember.data.loader import MicroBatch
from tests.helpers import write_recipe


@dataclasses.dataclass
class FakeJob:
    recipe: object


def starve(monkeypatch) -> None:
    """Every interleaved comparison ends before its first round (the budget ran out)."""
    monkeypatch.setattr(experiments, "interleave", lambda arms, until, **kw: [[] for _ in arms])
    monkeypatch.setattr(experiments, "timed_step",
                        lambda job, data: lambda: (0.01, {"h2d": 0.0, "forward": 0.004, "backward": 0.006}))


def test_interleave_keeps_nothing_when_no_round_fits():
    calls = []
    out = experiments.interleave([(lambda: calls.append(1), 1, 0)], time.monotonic() + 0.05, first_round=1.0)
    assert out == [[]] and calls == []


def test_a_sweep_size_that_got_no_rounds_is_skipped_not_kept(monkeypatch, tmp_path):
    starve(monkeypatch)
    r = load_recipe(write_recipe(tmp_path, train={"micro_batch": 2}))
    monkeypatch.setattr(experiments, "fitting_micro_batches", lambda r: {2: 1, 4: 1, 8: 1})
    skipped: list = []
    got = experiments.sweep(FakeJob(r), r, MicroBatch(torch.zeros(2, 32, dtype=torch.long)), 0.001,
                            time.monotonic() + 60, Events(), skipped)
    assert got is None
    assert [s.experiment for s in skipped] == ["sweep", "sweep"]
    assert "only 0 rounds fitted" in skipped[0].reason


def test_fewer_threads_that_got_no_rounds_are_skipped_not_kept(monkeypatch, tmp_path):
    starve(monkeypatch)
    r = load_recipe(write_recipe(tmp_path))
    shape = Shape(micro_batch=4, grad_accum=1, seq_len=32, workers=0, threads=2, cores=2, checkpoint_async=True,
                  checkpoint_every_steps=5, checkpoint_every_seconds=0.0)
    cpu = {"load": 2.0, "runnable": 3, "others": 1.0, "steal": 0.0, "wait_share": 0.4, "main_wait_share": 0.4}
    skipped: list = []
    c = experiments.contention(FakeJob(r), shape, cpu, 0.01, None, 0.001, time.monotonic() + 60, Events(), skipped)
    assert c.fewer_threads is None and c.at_threads == []
    assert skipped and "only 0 rounds fitted" in skipped[-1].reason
