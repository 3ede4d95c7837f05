"""M, the time between interruptions (ember.ledger.mtbf), against hand-computed numbers."""

from __future__ import annotations

import pytest

from ember.ledger.mtbf import DEFAULT_MTBF_HOURS, AttemptTime, mtbf


def test_attempt_time_over_interruptions():
    # 3 h + 2 h + 0.5 h + 0.5 h of attempts, two of them killed: 6 h / 2 = 3 h = 10,800 s.
    history = [AttemptTime(3 * 3600, "killed"), AttemptTime(2 * 3600, "completed"),
               AttemptTime(1800, "crashed"), AttemptTime(1800, "killed")]
    m = mtbf(0.0, history, "box")
    assert m.seconds == 10_800
    assert m.source == "2 interruptions in 6.0 h of attempts on box"


def test_only_killed_attempts_are_interruptions():
    # errors and stops on request say nothing about the machine: their time counts, they do not
    history = [AttemptTime(100, "failed"), AttemptTime(200, "crashed"), AttemptTime(300, "interrupted"),
               AttemptTime(400, None), AttemptTime(1000, "killed")]
    assert mtbf(0.0, history, "box").seconds == 2000  # 100 + 200 + 300 + 400 + 1000 over 1
    assert "1 interruption in" in mtbf(0.0, history, "box").source


def test_the_recipe_setting_wins_over_history():
    m = mtbf(2.5, [AttemptTime(60, "killed")], "box")
    assert m == (9000.0, "[checkpoint] interruption_hours")


@pytest.mark.parametrize("history", [[], [AttemptTime(7200, "completed")], [AttemptTime(0, "killed")],
                                     [AttemptTime(-5, "killed")]])
def test_no_interruption_on_record_is_the_default(history):
    # no killed attempt, or a killed one with no time at all (a clock that went back counts as 0)
    m = mtbf(0.0, history, "box")
    assert m.seconds == DEFAULT_MTBF_HOURS * 3600 == 86_400
    assert m.source == "default 24 h (no interruption on record)"
