"""The service's HTTP API in-process: the token, and bad requests answered with a 4xx that
change nothing."""

import os
import stat

import pytest
from fastapi.testclient import TestClient

from ember.events import Events
from ember.ledger import jobs as rows
from ember.sched.owner import OwnerRules
from ember.sched.service import Service
from ember.web.api import create_app
from ember.web.server import ensure_token, is_loopback


@pytest.fixture
def service(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    rules = OwnerRules()
    rules.service.allowed = [str(tmp_path / "allowed")]
    rules.service.max_body_bytes = 4096
    (tmp_path / "allowed").mkdir()
    return Service(rules, "sim:2x1GiB", Events(), tmp_path / "ledger.db")


def client(service, loopback=True):
    # Bound to loopback the service answers only to loopback host names (DNS rebinding): not "testserver".
    return TestClient(create_app(service, "s3cret", loopback, None), base_url="http://127.0.0.1")


AUTH = {"Authorization": "Bearer s3cret"}


def test_the_token_file_is_private_and_stable(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    first = ensure_token()
    assert len(first) >= 32 and ensure_token() == first
    mode = stat.S_IMODE(os.stat(tmp_path / "serve" / "token").st_mode)
    assert mode == 0o600
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_mutations_need_the_token(service):
    c = client(service)
    for path in ("/api/jobs", "/api/jobs/1/pause", "/api/jobs/1/cancel", "/api/yield"):
        r = c.post(path, json={})
        assert r.status_code == 401 and "token" in r.json()["error"]
        r = c.post(path, json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    assert c.get("/api/jobs").status_code == 200  # reading on loopback needs none
    assert rows.all_jobs(service.con) == []


def test_off_loopback_every_request_needs_the_token(service):
    c = client(service, loopback=False)
    assert c.get("/api/jobs").status_code == 401
    assert c.get("/health").status_code == 401
    assert c.get("/api/jobs", headers=AUTH).status_code == 200


def test_bad_requests_get_a_4xx_and_change_nothing(service, tmp_path):
    c = client(service)
    outside = tmp_path / "elsewhere.toml"
    outside.write_text("")
    cases = [
        (c.post("/api/jobs", content=b"{not json", headers=AUTH), 400, "not valid JSON"),
        (c.post("/api/jobs", json=[1, 2], headers=AUTH), 400, "JSON object"),
        (c.post("/api/jobs", json={}, headers=AUTH), 400, "recipe"),
        (c.post("/api/jobs", json={"recipe": "x.toml", "bogus": 1}, headers=AUTH), 400, "unknown field"),
        (c.post("/api/jobs", json={"recipe": "x.toml", "priority": "high"}, headers=AUTH), 400, "priority"),
        (c.post("/api/jobs", json={"recipe": str(outside)}, headers=AUTH), 403, "outside the folders"),
        (c.post("/api/jobs", json={"recipe": str(tmp_path / "allowed" / "none.toml")}, headers=AUTH), 400,
         "no such file"),
        (c.post("/api/jobs", content=b"x" * 5000, headers=AUTH), 413, "over 4096 bytes"),
        (c.post("/api/jobs/nope/pause", json={}, headers=AUTH), 404, "no job 'nope'"),
        (c.post("/api/jobs/7/cancel", headers=AUTH), 404, "no job"),
        (c.get("/api/jobs/7/logs"), 404, "no job"),
        (c.post("/api/yield", json={"seconds": -5}, headers=AUTH), 400, "seconds"),
        (c.post("/api/yield", json={"seconds": "soon"}, headers=AUTH), 400, "seconds"),
        (c.get("/v1/models"), 503, "inference is off"),
    ]
    for r, status, words in cases:
        assert r.status_code == status, (r.status_code, r.text)
        assert words in r.json()["error"], r.json()
    assert rows.all_jobs(service.con) == [] and service.yield_until is None


def test_a_finished_job_cannot_be_paused_or_cancelled(service, tmp_path):
    job = rows.insert(service.con, "done", "/x.toml", str(tmp_path / "run"), [], 0, {"memory": 1}, "queued")
    c = client(service)
    assert c.post(f"/api/jobs/{job.id}/cancel", headers=AUTH).json()["state"] == "cancelled"
    r = c.post("/api/jobs/done/pause", json={}, headers=AUTH)
    assert r.status_code == 409 and "cancelled" in r.json()["error"]
    assert [t["to_state"] for t in rows.transitions(service.con, job.id)] == ["queued", "cancelled"]


def test_a_job_that_can_never_fit_is_refused_at_submit_with_the_plans_verdict(tmp_path, monkeypatch):
    from tests.helpers import write_recipe
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    rules = OwnerRules()
    rules.service.allowed = [str(tmp_path)]
    service = Service(rules, "sim:2x1MiB", Events(), tmp_path / "ledger.db")
    recipe = write_recipe(tmp_path / "r")
    r = client(service).post("/api/jobs", json={"recipe": str(recipe)}, headers=AUTH)
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert "can never fit here" in message and "largest device offers 0.00 GiB" in message
    assert "`ember plan` says: local" in message
    assert rows.all_jobs(service.con) == []
