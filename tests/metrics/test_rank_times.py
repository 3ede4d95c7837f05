"""A pipeline's measured bubble as ranks.json keeps it: each stage's median share of its schedule's
time, the stages' mean, and the schedule's prediction beside it (the timing itself is the run's:
tests/e2e/test_pipeline.py checks it is there)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ember.metrics.rank_times import bubble_share, figures, load, save, summarize
from ember.parallel.pp import bubble
from ember.train.breakdown import StepTimer


def test_a_stage_bubble_is_its_wait_over_its_schedule_time():
    assert bubble_share({"forward": 0.3, "backward": 0.5, "bubble": 0.2, "sync": 9.0}) == pytest.approx(0.2)
    assert bubble_share({"forward": 0.0, "backward": 0.0, "bubble": 0.0}) == 0.0
    assert bubble_share({"forward": 0.3, "backward": 0.5}) is None  # not a pipeline


def test_the_summary_holds_each_stage_median_their_mean_and_the_prediction(tmp_path):
    # stage 0: a warm-up step that waited 90% (shape inference) does not move its median
    s0 = figures(0, [1.0] * 3, 300, {"forward": 1, "backward": 1, "bubble": 1}, [0.9, 0.2, 0.3])
    s1 = figures(1, [1.0] * 3, 300, {"forward": 1, "backward": 1, "bubble": 1}, [0.5, 0.4, 0.4])
    s = summarize(1, [s0, s1], bubble(2, 4))
    assert (s0.bubble, s1.bubble) == (0.3, 0.4)
    assert s.bubble == pytest.approx(0.35) and s.bubble_predicted == pytest.approx(1 / 5)
    save(tmp_path, s)
    assert load(tmp_path) == s
    ddp = summarize(1, [figures(0, [1.0], 10, {"forward": 1}), figures(1, [1.0], 10, {"forward": 1})])
    assert ddp.bubble is None and ddp.bubble_predicted is None and ddp.ranks[0].bubble is None


def test_a_ranks_file_from_before_the_bubble_still_loads(tmp_path):
    s = summarize(1, [figures(0, [1.0], 10, {"forward": 1})])
    d = json.loads(json.dumps(s.__dict__, default=lambda x: x.__dict__))
    del d["bubble"], d["bubble_predicted"], d["ranks"][0]["bubble"]
    (tmp_path / "ranks.json").write_text(json.dumps(d))
    assert load(tmp_path).bubble is None


def test_the_schedule_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    assert (bubble(2, 2), bubble(2, 4), bubble(2, 8), bubble(4, 8), bubble(1, 4)) == (1 / 3, 1 / 5, 1 / 9, 3 / 11, 0.0)


def test_a_pipeline_step_splits_into_its_parts_and_the_rest():
    """The timer hands a pipeline step's host time to its forward, backward and bubble (measured
    inside the schedule), what they leave to the phase named, never less than nothing."""
    timer = StepTimer(torch.device("cpu"))
    timer.begin()
    time.sleep(0.001)
    timer.split({"forward": 0.0, "backward": 0.0, "bubble": 0.0}, "h2d")
    t = timer.end()
    assert t["bubble"] == 0.0 and t["h2d"] > 0.0
    timer.begin()
    timer.split({"forward": 1e6, "backward": 0.0, "bubble": 0.0}, "h2d")  # measured inside: more than elapsed
    t = timer.end()
    assert t["forward"] == 1e6 and t["h2d"] == 0.0
