"""The checkpoint-due rule (ember.ckpt.policy) against hand-worked cases: the triggers the recipe
names, the order of the rules, and Young/Daly's interval from the measured cost."""

from __future__ import annotations

import dataclasses

import pytest

from ember.ckpt.policy import (CheckpointKind, CheckpointPolicy, EveryAuto, EverySeconds, EverySteps, LastSave,
                               auto_of, cadence)
from ember.recipe import CheckpointConfig, Recipe


def policy(*every, max_steps=12, keep_best=True, mtbf=0.0) -> CheckpointPolicy:
    return CheckpointPolicy(tuple(every), max_steps, keep_best, mtbf)


def test_the_recipe_keys_become_the_triggers_they_name():
    assert cadence(CheckpointConfig()) == (EverySteps(50),)  # the defaults: every 50 steps, no time
    assert cadence(CheckpointConfig(every_steps=0, every_seconds=0.0)) == ()
    assert cadence(CheckpointConfig(every_steps=10, every_seconds=30.0)) == (EverySteps(10), EverySeconds(30.0))
    auto = CheckpointConfig(every_steps=0, every_seconds="auto", interruption_hours=2.0)
    assert cadence(auto) == (EveryAuto(2.0),) and auto_of(cadence(auto)) == EveryAuto(2.0)
    assert auto_of(cadence(CheckpointConfig())) is None
    r = Recipe()
    r = dataclasses.replace(r, checkpoint=dataclasses.replace(r.checkpoint, keep_best=False))
    assert CheckpointPolicy.of(r, 60.0) == CheckpointPolicy((EverySteps(50),), 100, False, 60.0)


def test_every_n_steps_and_the_final_step():
    p = policy(EverySteps(5))
    due = {step: p.due(step, 0.0, LastSave(0.0)) for step in range(1, 13)}
    assert {s: k for s, k in due.items() if k} == {5: CheckpointKind.PERIODIC, 10: CheckpointKind.PERIODIC,
                                                   12: CheckpointKind.FINAL}
    assert policy().due(11, 1e9, LastSave(0.0)) is None  # no trigger: only the end, a stop, early stopping, a best


def test_every_s_seconds_counts_from_the_last_save():
    p = policy(EverySeconds(30.0))
    assert p.interval(LastSave(100.0)) == 30.0
    assert p.due(3, 129.9, LastSave(100.0)) is None
    assert p.due(3, 130.0, LastSave(100.0)) == CheckpointKind.TIMED
    assert p.due(3, 130.0, LastSave(120.0, cost=5.0)) is None  # the cost of a save changes nothing here
    both = policy(EverySteps(4), EverySeconds(30.0))
    assert both.due(4, 0.0, LastSave(0.0)) == CheckpointKind.PERIODIC
    assert both.due(3, 31.0, LastSave(0.0)) == CheckpointKind.TIMED


def test_auto_is_dalys_interval_for_the_measured_cost():
    # M = 5000 s. Assumed cost δ = 1 s: √(2·1·5000) = 100, δ/2M = 1e-4, so
    # τ = 100·(1 + 0.01/3 + 1e-4/9) − 1 = 99 + 1/3 + 1/900.
    p = policy(EveryAuto(0.0), mtbf=5000.0)
    assert p.interval(LastSave(0.0)) == pytest.approx(99 + 1 / 3 + 1 / 900)
    # Measured δ = 4 s: √(2·4·5000) = 200, δ/2M = 4e-4, τ = 200·(1 + 0.02/3 + 4e-4/9) − 4.
    assert p.interval(LastSave(0.0, cost=4.0)) == pytest.approx(196 + 4 / 3 + 0.08 / 9)
    assert p.interval(LastSave(0.0, cost=0.0)) == pytest.approx(p.interval(LastSave(0.0, cost=1e-3)))
    assert p.due(7, 99.3, LastSave(0.0)) is None
    assert p.due(7, 99.34, LastSave(0.0)) == CheckpointKind.TIMED
    assert p.due(7, 150.0, LastSave(0.0, cost=4.0)) is None


def test_a_stop_early_stopping_and_a_new_best_make_a_checkpoint_due():
    p = policy(EverySteps(5))
    assert p.due(3, 0.0, LastSave(0.0), stop=True) == CheckpointKind.STOP
    assert p.due(12, 0.0, LastSave(0.0), stop=True) == CheckpointKind.STOP  # the first rule first
    assert p.due(3, 0.0, LastSave(0.0), early=True) == CheckpointKind.EARLY_STOP
    assert p.due(12, 0.0, LastSave(0.0), early=True) == CheckpointKind.FINAL
    assert p.due(3, 0.0, LastSave(0.0), best=True) == CheckpointKind.BEST
    assert p.due(5, 0.0, LastSave(0.0), best=True) == CheckpointKind.PERIODIC
    assert policy(EverySteps(5), keep_best=False).due(3, 0.0, LastSave(0.0), best=True) is None


def test_the_kinds_are_their_names():
    assert [str(k) for k in CheckpointKind] == ["stop", "final", "early_stop", "periodic", "timed", "best"]
    assert CheckpointKind.FINAL == "final"
