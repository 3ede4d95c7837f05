"""Goodput accounting against hand-computed timelines."""

from __future__ import annotations

import pytest

from ember.ledger.goodput import BUCKETS, Bucket, Event, EventKind, Span, Step, account


def steps(attempt: int, first: int, last: int, seconds: float, wait: float = 0.0, lost: bool = False):
    return [Step(attempt, s, seconds, wait, lost) for s in range(first, last + 1)]


def test_single_clean_attempt():
    # 0-10 s start-up, 20 steps of 2 s (0.5 s of it data wait), 2 checkpoints of 3 s, 4 s final save.
    spans = [Span(1, 0.0, 60.0)]
    events = [Event(1, "startup", 0.0, 10.0), Event(1, "checkpoint", 30.0, 33.0),
              Event(1, "checkpoint", 52.0, 55.0), Event(1, "final_save", 55.0, 59.0)]
    g = account(spans, events, steps(1, 1, 20, 2.0, 0.5))
    assert g.wall_seconds == 60.0
    assert g.buckets["productive"] == pytest.approx(30.0)
    assert g.buckets["data_loading"] == pytest.approx(10.0)
    assert g.buckets["program_startup"] == pytest.approx(10.0)
    assert g.buckets["checkpoint_save"] == pytest.approx(10.0)
    assert g.buckets["other"] == pytest.approx(0.0)
    assert g.goodput == pytest.approx(0.5)
    assert set(g.buckets) == set(BUCKETS)


def test_crash_that_loses_seven_steps():
    # Attempt 1: start-up 5 s, steps 1-10 of 1 s, checkpoint at 10 (2 s), steps 11-17 of 1 s,
    # then SIGKILL: steps 11-17 are lost. Attempt 2: start-up 6 s of which restore 1.5 s,
    # steps 11-20 of 1 s, checkpoint 2 s, final save 1 s.
    spans = [Span(1, 100.0, 124.0), Span(2, 130.0, 149.0)]
    events = [Event(1, "startup", 100.0, 105.0), Event(1, "checkpoint", 115.0, 117.0),
              Event(2, "startup", 130.0, 136.0), Event(2, "restore", 134.0, 135.5),
              Event(2, "checkpoint", 146.0, 148.0), Event(2, "final_save", 148.0, 149.0)]
    recorded = steps(1, 1, 10, 1.0) + steps(1, 11, 17, 1.0, lost=True) + steps(2, 11, 20, 1.0)
    g = account(spans, events, recorded)
    assert g.wall_seconds == 43.0  # 24 + 19: the 6 s between attempts are not an attempt's
    assert g.buckets["productive"] == 20.0
    assert g.buckets["wasted_progress"] == 7.0
    assert g.buckets["program_startup"] == pytest.approx(5.0 + 4.5)
    assert g.buckets["checkpoint_restore"] == pytest.approx(1.5)
    assert g.buckets["checkpoint_save"] == pytest.approx(5.0)
    assert g.buckets["other"] == pytest.approx(43.0 - 20 - 7 - 9.5 - 1.5 - 5)
    assert sum(g.buckets.values()) == pytest.approx(g.wall_seconds)
    assert [name for name, _ in g.badput()][:2] == ["program_startup", "wasted_progress"]


def test_pauses_and_evaluation_have_their_own_buckets():
    g = account([Span(1, 0.0, 10.0)],
                [Event(1, "startup", 0.0, 1.0), Event(1, "pause", 3.0, 6.0),
                 Event(1, "evaluation", 7.0, 8.0)], steps(1, 1, 4, 1.0))
    assert (g.buckets["paused"], g.buckets["evaluation"], g.buckets["other"]) == (3.0, 1.0, 1.0)


def test_bucket_and_event_names_are_the_stored_strings():
    """The ledger and the reports hold these names: the StrEnums are those strings."""
    assert BUCKETS == ("productive", "data_loading", "program_startup", "compile", "checkpoint_restore", "checkpoint_save",
                       "evaluation", "wasted_progress", "paused", "paused_for_inference", "other")
    assert [str(k) for k in EventKind] == ["startup", "restore", "checkpoint", "final_save", "evaluation",
                                           "pause", "pause_inference", "compile"]
    # events read back from SQLite are plain strings: they land in the same buckets
    g = account([Span(1, 0.0, 10.0)], [Event(1, "final_save", 1.0, 3.0), Event(1, EventKind.PAUSE, 3.0, 4.0)], [])
    assert g.buckets[Bucket.CHECKPOINT_SAVE] == g.buckets["checkpoint_save"] == 2.0
    assert g.buckets["paused"] == 1.0 and g.buckets[Bucket.OTHER] == 7.0


def test_compile_seconds_leave_the_step_that_paid_them():
    """A compile inside a step is the bucket `compile`: out of productive time for a step that
    survived, out of wasted progress for one that was lost; the wall-clock still adds up."""
    steps = [Step(1, 1, 12.0, 0.5, False), Step(1, 2, 2.0, 0.5, False), Step(2, 2, 9.0, 0.0, True)]
    events = [Event(1, EventKind.COMPILE, 1.0, 11.0, 1), Event(2, "compile", 30.0, 37.0, 2)]
    g = account([Span(1, 0.0, 20.0), Span(2, 25.0, 40.0)], events, steps)
    assert g.buckets[Bucket.COMPILE] == 17.0
    assert g.buckets[Bucket.PRODUCTIVE] == (12.0 - 0.5 - 10.0) + (2.0 - 0.5)
    assert g.buckets[Bucket.WASTED_PROGRESS] == 9.0 - 7.0
    assert sum(g.buckets.values()) == g.wall_seconds
