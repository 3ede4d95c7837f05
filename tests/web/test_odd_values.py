"""Odd values that reach `ember serve`'s library through its HTTP surface: a --set override with
a newline, a plan's device memory of nan or inf, a log offset past any file, a purge that names
no state. Each is a 400 that
says which value was wrong (never a traceback's words, never part of it applied) and changes
nothing."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ember.events import Events
from ember.ledger import database as store
from ember.ledger import job_rows as rows
from ember.sched.owner_rules import OwnerRules
from ember.sched.service import Service
from ember.web.api import create_app
from tests.helpers import write_recipe
from tests.web.runs import make_run

AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture
def service(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    rules = OwnerRules()
    rules.service.allowed = [str(tmp_path / "allowed")]
    (tmp_path / "allowed").mkdir()
    return Service(rules, "sim:2x1GiB", Events(), tmp_path / "ledger.db")


@pytest.fixture
def client(service):
    return TestClient(create_app(service, "s3cret", True, None), base_url="http://127.0.0.1", headers=AUTH)


@pytest.mark.parametrize("override", ["train.max_steps=1\ntrain.seed=2", 'data.seq_len=16\n[train]\nseed=2'])
def test_an_override_that_holds_a_second_setting_is_refused_not_half_applied(client, service, tmp_path, override):
    """`--set` reads its value as TOML: "1\\ntrain.seed=2" parsed as v = 1 plus a second key, which
    was dropped without a word, and the job was queued with max_steps 1 (201)."""
    recipe = write_recipe(tmp_path / "allowed" / "r")
    r = client.post("/api/jobs", json={"recipe": str(recipe), "overrides": [override]})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    assert override.split("=", 1)[0] in message and "seed" in message, message
    assert rows.all_jobs(service.con) == []


@pytest.mark.parametrize("memory", ["nan", "inf"])
def test_a_plan_for_nan_or_infinite_device_memory_says_so_not_a_traceback(client, service, tmp_path, memory):
    """The plan page passes ?device_memory= to `ember plan --device-memory`, which crashed on nan
    (ValueError: cannot convert float NaN to integer) and inf (OverflowError); the page showed
    the exception's last line."""
    con = store.connect(service.ledger_path)
    run = make_run(con, tmp_path / "runs" / "a", 10)
    con.close()
    r = client.get("/plan", params={"run": run, "device_memory": memory}, headers={"accept": "text/html"})
    assert r.status_code == 200, r.text[:300]
    assert f"--device-memory {memory}: must be a finite number" in r.text, r.text[-2000:]
    assert "Error:" not in r.text and "cannot convert" not in r.text


def test_a_log_offset_past_any_file_names_the_offset(client, service):
    """?offset=2**63 reached f.seek, whose ValueError ("cannot fit 'int' into an offset-sized
    integer") was the whole answer: no word of which parameter."""
    job = rows.insert(service.con, "j", "/x.toml", "/tmp/j", [], 0, {"memory": 1}, "queued")
    log = service.log_path(job)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"step 1\n")
    r = client.get(f"/api/jobs/{job.id}/logs", params={"offset": 2**63})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "offset" and "offset" in r.json()["error"]["message"], r.json()
    r = client.get(f"/api/jobs/{job.id}/logs", params={"offset": 2})
    assert (r.status_code, r.content, r.headers["x-ember-offset"]) == (200, b"ep 1\n", "7")


def test_a_purge_that_names_no_state_removes_nothing(client, service):
    """`{"states": []}` read as no filter at all: it removed every finished job, as if the states
    had been left out. A client that builds the list from a user's choice of none got all."""
    for name, state in (("a", "completed"), ("b", "failed"), ("c", "cancelled")):
        rows.insert(service.con, name, "/x.toml", f"/tmp/{name}", [], 0, {"memory": 1}, state)
    r = client.post("/api/jobs/purge", json={"states": []})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "states", r.json()
    assert sorted(j.name for j in rows.all_jobs(service.con)) == ["a", "b", "c"]
    r = client.post("/api/jobs/purge", json={"states": ["failed"]})
    assert (r.status_code, [j["name"] for j in r.json()["removed"]]) == (200, ["b"]), r.text


@pytest.mark.parametrize("where", [{"headers": {"Last-Event-ID": "²".encode("latin-1")}}, {"headers": {"Last-Event-ID": "9" * 5000}},
                                   {"headers": {"Last-Event-ID": str(2 ** 63)}}, {"params": {"offset": 2 ** 63}}])
def test_a_live_chart_position_past_any_file_or_not_a_number_is_no_error(client, service, tmp_path, where):
    """The live chart resumes from the browser's Last-Event-ID, read with str.isdigit alone:
    5,000 digits passed it and int() refused them (past its limit), a 400 that quoted int()'s
    words ('²', which str.isdigit takes too, does the same over a socket). An ID that is not a number the stream could have sent is ignored (the
    offset asked for is used); a position past the file's end reads it from its start, as
    after a rewind."""
    con = store.connect(service.ledger_path)
    run = make_run(con, tmp_path / "allowed" / "runs" / "a", 3)
    con.close()
    with client.stream("GET", f"/api/runs/{run}/live", **where) as r:
        text = r.read().decode()
    assert r.status_code == 200, (r.status_code, text[:300])
    assert "event: end" in text and '"step": 3' in text, text[-500:]


def test_the_plans_the_dashboard_remembers_are_the_newest_few(client, service, tmp_path, monkeypatch):
    """Each `?device_memory=` or `?target_micro_batch=` asked of /api/plan is a question of its
    own, and every answer was kept for the service's life: a page or client trying values grew
    the service without bound. The newest PLANS_KEPT are kept."""
    from ember.web import views as views_module
    monkeypatch.setattr(views_module, "PLANS_KEPT", 2, raising=False)
    con = store.connect(service.ledger_path)
    run = make_run(con, tmp_path / "allowed" / "runs" / "p", 3)
    con.close()
    for batch in (1, 2, 3):
        r = client.get("/api/plan", params={"run": run, "target_micro_batch": batch})
        assert r.status_code == 200, r.text[:300]
    kept = client.app.state.dashboard.views.plans
    assert len(kept) == 2 and sorted(k[-1] for k in kept) == [2, 3], list(kept)
