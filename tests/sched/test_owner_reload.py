"""A running service and an edited owner.toml, in-process: live keys hold at once, keys read at
start are reported as waiting for a restart, and a file that does not validate changes nothing
and is reported through the API and on the Queue page until it is fixed (issue 24, item 10)."""

import pytest
from fastapi.testclient import TestClient

from ember.events import Events
from ember.sched.owner_rules import load_rules
from ember.sched.service import Service
from ember.web.api import create_app

AUTH = {"Authorization": "Bearer s3cret"}
GOOD = "[service]\nallowed = ['{root}']\n[inference]\nenabled = false\n"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    owner = tmp_path / "home" / "owner.toml"
    owner.write_text(GOOD.format(root=tmp_path))
    return owner


def started(owner) -> tuple[Service, TestClient]:
    """What `ember serve` does: read the rules, then make the service and its app."""
    service = Service(load_rules(owner), "sim:1x1GiB", Events(), owner.parent / "ledger.db")
    return service, TestClient(create_app(service, "s3cret", True, None), base_url="http://127.0.0.1")


def test_live_keys_hold_at_once_and_keys_read_at_start_wait_for_a_restart(home, tmp_path):
    service, c = started(home)
    assert c.get("/api/owner", headers=AUTH).json()["notes"] == []
    home.write_text(f"[service]\nallowed = ['{tmp_path}', '/srv']\nport = 9100\n[pause]\nhard_after_minutes = 2\n"
                    f"[inference]\nenabled = false\nidle_gap_seconds = 7\nmodel = 'builtin:other'\n")
    service.observe(force=True)
    assert service.rules.pause.hard_after_minutes == 2 and service.rules.service.allowed == [str(tmp_path), "/srv"]
    assert service.rules.inference.idle_gap_seconds == 7 and service.gate.idle_gap == 7
    assert c.get("/api/stats", headers=AUTH).json()["inference"]["idle_gap_seconds"] == 7
    assert service.rules.service.port == 8765 and service.rules.inference.model == "builtin:tiny"  # as started
    got = c.get("/api/owner", headers=AUTH).json()
    assert got["error"] is None and [w["key"] for w in got["restart"]] == ["service.port", "inference.model"]
    assert got["rules"]["pause"]["hard_after_minutes"] == 2 and got["rules"]["service"]["port"] == 8765
    (note,) = got["notes"]
    assert "service.port = 9100 (in force: 8765)" in note and "restart it" in note, note
    assert "service.port = 9100" in c.get("/queue", headers=AUTH).text  # the Queue page says so too


def test_a_file_that_does_not_validate_keeps_the_rules_and_is_reported_until_fixed(home, tmp_path):
    service, c = started(home)
    home.write_text(GOOD.format(root=tmp_path) + "[pause]\nhard_after_minutes = 3\n")
    service.observe(force=True)
    assert service.rules.pause.hard_after_minutes == 3
    home.write_text(GOOD.format(root=tmp_path) + "[pause]\nhard_after_minutes = 1\n[cpu]\nmax_other_load = 2\n")
    service.observe(force=True)
    assert service.rules.pause.hard_after_minutes == 3 and service.rules.cpu.max_other_load == 0  # as before
    got = c.get("/api/owner", headers=AUTH).json()
    assert f"{home}:8: [cpu] max_other_load = 2.0: must be <= 1" in got["error"], got
    (note,) = got["notes"]
    assert note.startswith("owner.toml does not validate, so the service keeps the rules it loaded at"), note
    page = c.get("/queue", headers=AUTH).text
    assert 'id="owner-rules"' in page and "max_other_load = 2.0: must be &lt;= 1" in page
    home.write_text(GOOD.format(root=tmp_path) + "[pause]\nhard_after_minutes = 1\n")
    service.observe(force=True)
    assert service.rules.pause.hard_after_minutes == 1
    assert c.get("/api/owner", headers=AUTH).json()["notes"] == [] and "does not validate" not in c.get(
        "/queue", headers=AUTH).text


def test_an_auto_idle_gap_holds_at_once_and_says_how_it_was_chosen(home, tmp_path):
    service, c = started(home)
    home.write_text(GOOD.format(root=tmp_path) + "idle_gap_seconds = 'auto'\n")
    service.observe(force=True)
    assert service.rules.inference.idle_gap_seconds == "auto" and service.gate.idle_gap == "auto"
    stats = c.get("/api/stats", headers=AUTH).json()["inference"]
    assert stats["idle_gap_seconds"] == 2.0 and stats["idle_gap_rule"].startswith("auto (default until 8"), stats
    home.write_text(GOOD.format(root=tmp_path) + "idle_gap_seconds = 'soon'\n")
    service.observe(force=True)
    assert service.gate.idle_gap == "auto"  # kept: the file does not validate
    assert "idle_gap_seconds = 'soon': must be one of 'auto' or a number" in \
        c.get("/api/owner", headers=AUTH).json()["error"]
