"""The owner's rules: validation like recipes, and which rules hold, by hand-made observations."""

import datetime as dt

import pytest

from ember.errors import EmberError
from ember.sched.owner import Hold, Observation, OwnerRules, applies, holds, in_window, load_rules

MONDAY_NOON = dt.datetime(2026, 11, 30, 12, 0)  # a Monday
QUIET = Observation(None, "no graphical session", 0.0, None)


def rules(tmp_path, text):
    (tmp_path / "owner.toml").write_text(text)
    return load_rules(tmp_path / "owner.toml")


def test_defaults_hold_nothing_on_a_quiet_machine():
    assert holds(OwnerRules(), QUIET, MONDAY_NOON) == []


def test_bad_files_are_refused_with_where_and_what(tmp_path):
    for text, words in [("[activty]\n", "did you mean 'activity'"),
                        ("[cpu]\nmax_other_load = 2\n", "max_other_load"),
                        ("[schedule]\nmon = ['9-17']\n", "HH:MM-HH:MM"),
                        ("[schedule]\nmon = ['17:00-09:00']\n", "start before the end"),
                        ("[accelerators]\nforeign_memory_max = 'lots'\n", "not a size"),
                        ("[inference]\nupstream = 'localhost:8080'\n", "URL"),
                        ("[service]\nport = 'x'\n", "integer")]:
        with pytest.raises(EmberError, match=words) as e:
            rules(tmp_path, text)
        assert "owner.toml" in str(e.value)


def test_weekday_windows(tmp_path):
    r = rules(tmp_path, "[schedule]\nmon = ['00:00-08:00', '18:00-24:00']\nsun = []\n")
    assert in_window(r.schedule, MONDAY_NOON)[0] is False
    assert in_window(r.schedule, MONDAY_NOON.replace(hour=19))[0] is True
    assert in_window(r.schedule, MONDAY_NOON + dt.timedelta(days=1))[0] is True  # tuesday: all day
    assert in_window(r.schedule, MONDAY_NOON - dt.timedelta(days=1))[0] is False  # sunday: never
    (h,) = holds(r, QUIET, MONDAY_NOON)
    assert (h.rule, h.kind) == ("schedule.mon", "hard") and "Mon 12:00" in h.detail


def test_activity_cpu_battery_programs_and_accelerators(tmp_path):
    r = rules(tmp_path, "[activity]\nidle_minutes = 3\n[cpu]\nmax_other_load = 0.5\n"
                        "[programs]\nsuspend_while = ['blender']\n")
    busy = Observation(30.0, "logind IdleHint", 0.75, True, frozenset({"blender"}), {1: (1, 10)})
    got = {h.rule: h for h in holds(r, busy, MONDAY_NOON)}
    assert set(got) == {"activity.accelerators_while_active", "cpu.max_other_load", "power.run_on_battery",
                        "programs.suspend_while", "accelerators.pause_on_foreign_process"}
    assert got["power.run_on_battery"].kind == "hard" and got["cpu.max_other_load"].kind == "soft"
    assert got["accelerators.pause_on_foreign_process"].devices == (1,)
    idle = Observation(600.0, "logind IdleHint", 0.1, False)
    assert holds(r, idle, MONDAY_NOON) == []


def test_which_jobs_a_hold_applies_to():
    accel_only = Hold("activity.accelerators_while_active", "soft", None, True, "")
    one_device = Hold("accelerators.pause_on_foreign_process", "soft", (1,), True, "")
    assert applies(accel_only, (0,), accelerator=True) and not applies(accel_only, (0,), accelerator=False)
    assert applies(one_device, (1,), True) and not applies(one_device, (0,), True)
