"""`ember yield` alone (ember.sched.yield_hold.YieldHold): durable in the service's folder, found
again by a new holder, ended by its time or a release, and an unreadable file holding until
released."""

import math

from ember.events import collect
from ember.sched.yield_hold import YIELD_FILE, YieldHold

NOW = 1_000_000.0


def test_a_yield_is_found_again_and_ends_at_its_time(tmp_path):
    events, seen = collect()
    held = YieldHold(tmp_path / "serve", events)
    assert held.until is None and held.hold(NOW) is None and held.shown() is None
    held.set(NOW + 60)
    again = YieldHold(tmp_path / "serve", events)  # what a restarted service finds
    assert again.until == NOW + 60
    hold = again.hold(NOW)
    assert (hold.rule, hold.kind, hold.devices, hold.detail) == ("yield", "hard", None, "ember yield, for 60 s more")
    assert again.shown().detail == "ember yield"
    assert again.hold(NOW + 60) is None and again.until is None  # over: released, and the file gone
    assert not (tmp_path / "serve" / YIELD_FILE).exists() and seen == []


def test_until_released_holds_for_ever_and_a_release_ends_it(tmp_path):
    held = YieldHold(tmp_path / "serve", collect()[0])
    held.set(math.inf)
    assert YieldHold(tmp_path / "serve", collect()[0]).until == math.inf
    assert held.hold(NOW * 1000).detail == "ember yield, until released"
    held.set(None)
    assert YieldHold(tmp_path / "serve", collect()[0]).until is None


def test_an_unreadable_yield_file_holds_all_training_and_says_so(tmp_path):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / YIELD_FILE).write_text("{not json")
    events, seen = collect()
    held = YieldHold(tmp_path / "serve", events)
    assert held.until == math.inf and held.hold(NOW) is not None
    assert [e.kind for e in seen] == ["warning"] and "ember yield --release" in seen[0].message
