"""The owner's rules as a running service applies them, alone (ember.sched.owner_watch.OwnerWatch):
read again only when owner.toml's bytes change, a file that does not validate changing nothing,
the holds taken from an observation, and paths checked against [service] allowed."""

import pytest

from ember.errors import BadInput, Refused
from ember.events import collect
from ember.sched.owner_rules import load_rules
from ember.sched.owner_watch import OwnerWatch


@pytest.fixture
def owner(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    path = tmp_path / "owner.toml"
    path.write_text(f"[service]\nallowed = ['{tmp_path / 'ok'}']\n")
    return path


def test_rules_are_read_again_only_when_the_file_changes_and_only_when_valid(owner):
    events, seen = collect()
    watch = OwnerWatch(load_rules(owner), events)
    assert not watch.reload()  # unchanged
    owner.write_text("[schedule]\nmon = []\ntue = []\nwed = []\nthu = []\nfri = []\nsat = []\nsun = []\n")
    assert watch.observe(lambda: set(), force=True)
    assert [h.kind for h in watch.holds if h.rule.startswith("schedule.")] == ["hard"]  # no window today
    assert watch.observation is not None and not watch.observe(lambda: set(), force=True)
    rules = watch.rules
    owner.write_text("[pause]\nhard_after_minutes = -1\n")
    assert not watch.reload() and watch.rules is rules  # does not validate: nothing changes
    assert "hard_after_minutes" in watch.status.error and watch.report()["notes"]
    assert seen[-1].kind == "warning" and "stay as they were" in seen[-1].message


def test_a_path_outside_the_allowed_folders_is_refused(owner, tmp_path):
    watch = OwnerWatch(load_rules(owner), collect()[0])
    (tmp_path / "ok").mkdir()
    assert watch.allowed(str(tmp_path / "ok" / "r.toml"), "recipe") == tmp_path / "ok" / "r.toml"
    with pytest.raises(Refused, match="outside the folders the owner allowed"):
        watch.allowed(str(tmp_path / "elsewhere.toml"), "recipe")
    with pytest.raises(BadInput, match="not a usable path"):
        watch.allowed(str(tmp_path / "ok" / "x\0y"), "recipe")
