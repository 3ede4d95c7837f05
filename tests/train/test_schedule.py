"""Learning-rate schedules against hand-computed values."""

from __future__ import annotations

import math

import pytest

from ember.recipe import ScheduleConfig
from ember.train.schedule import lr_factor


def test_warmup_is_linear_from_the_first_step():
    cfg = ScheduleConfig(kind="constant", warmup_steps=4)
    assert [lr_factor(s, cfg, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_the_floor():
    cfg = ScheduleConfig(kind="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert lr_factor(2, cfg, 12) == pytest.approx(1.0)
    assert lr_factor(7, cfg, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(12, cfg, 12) == pytest.approx(0.1)


def test_linear_decays_to_the_floor():
    cfg = ScheduleConfig(kind="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_factor(s, cfg, 4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
