"""Errors over HTTP (issue 24, item 13): one JSON shape for every error answer of both apps
(`ember serve`'s and `ember ui`'s), /api and /v1 alike, with one status per meaning: 400 bad
input (never 409), 401, 403, 404, 405, 409 only for a state conflict, 413, 503; and an
/openapi.json that documents the bodies, the token and the errors."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from ember.ledger import job_rows as rows
from ember.web.api import create_app
from tests.helpers import write_recipe
from tests.web.conftest import AUTH, TOKEN

# The one shape's vocabulary: `type` by status (OpenAI's names, which /v1 clients know).
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "method_not_allowed", 409: "conflict_error", 413: "request_too_large", 421: "misdirected_request",
         500: "server_error", 503: "service_unavailable"}


def one_shape(r, status: int, says: str = "") -> dict:
    """`r` is the one error answer with `status`: {"error": {message, type, param, code}} and nothing else."""
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text[:300])
    assert r.headers["content-type"] == "application/json", (r.request.url, r.headers["content-type"])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert (error["code"], error["type"]) == (status, TYPES[status]), body
    assert isinstance(error["message"], str) and error["message"] and says in error["message"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    return error


def test_a_bad_value_is_400_not_409(client, ledger_dir):
    """A recipe or run folder path with a NUL byte made Path.resolve raise ValueError, which the
    API answered 409 Conflict, as if the queue's state were at fault."""
    base, _, _ = ledger_dir
    error = one_shape(client.post("/api/jobs", json={"recipe": f"{base}/recipe\x00.toml"}), 400, "not a usable path")
    assert error["message"].startswith("recipe ")
    error = one_shape(client.post("/api/jobs", json={"recipe": "x.toml", "priority": "high"}), 400, "priority")
    assert error["param"] == "priority"


def test_a_state_conflict_is_409_and_an_unknown_job_404(client, service, ledger_dir):
    base, _, _ = ledger_dir
    busy = rows.insert(service.con, "taken", "/x.toml", str(base / "busy"), [], 0, {"memory": 1}, "queued")
    before = len(rows.all_jobs(service.con))  # the ledger is the package's: other tests' jobs are in it
    recipe = write_recipe(base / "conflict")  # planned once (a child process), then the name and folder checked
    # The run folder's path is checked after the plan: a NUL byte in it was a 409 too (above).
    one_shape(client.post("/api/jobs", json={"recipe": str(recipe), "out": f"{base}/out\x00"}), 400,
              "run folder")
    # A name in use and a run folder another job holds were answered 400, as if the request were malformed.
    one_shape(client.post("/api/jobs", json={"recipe": str(recipe), "name": "taken"}), 409, "job name 'taken' is taken")
    one_shape(client.post("/api/jobs", json={"recipe": str(recipe), "name": "other", "out": busy.out}), 409,
              "belongs to job taken")
    assert client.post(f"/api/jobs/{busy.id}/cancel").json()["state"] == "cancelled"
    for verb, says in (("pause", "nothing to pause"), ("resume", "nothing to resume"), ("cancel", "already cancelled")):
        one_shape(client.post(f"/api/jobs/{busy.id}/{verb}"), 409, says)
    for method, path in (("GET", "/api/jobs/nope"), ("POST", "/api/jobs/nope/pause"), ("POST", "/api/jobs/nope/resume"),
                         ("POST", "/api/jobs/nope/cancel"), ("GET", "/api/jobs/nope/logs")):
        one_shape(client.request(method, path), 404, "no job 'nope'")
    assert len(rows.all_jobs(service.con)) == before  # nothing was queued


def test_every_error_answer_of_both_apps_has_the_one_shape(client, anon, service, ledger_dir):
    """The guard's 401/413/421/400, FastAPI's own 404, 405 and validation errors (422 before),
    the library's errors and the /v1 proxy's answered in three shapes: {"detail"}, {"error": str}
    and OpenAI's. Now every one is OpenAI's."""
    base, ledger, ids = ledger_dir
    done = rows.insert(service.con, "finished", "/x.toml", str(base / "finished"), [], 0, {"memory": 1}, "cancelled")
    before = len(rows.all_jobs(service.con))  # the ledger is the package's: other tests' jobs are in it
    limit = service.rules.service.max_body_bytes
    serve = [
        (anon.get("/api/jobs"), 401), (anon.post("/api/jobs", json={}), 401), (anon.get("/openapi.json"), 401),
        (client.get("/api/runs", headers={"host": "evil.example"}), 421),
        (client.get("/api/..%2Fjobs"), 400), (client.get("/api/runs/%2e%2e/x"), 400),
        (client.get("/no/such/route"), 404), (client.get("/static/nope.js"), 404),
        (client.delete("/api/jobs"), 405), (client.put("/api/runs"), 405),
        (client.post("/api/jobs", content=b"x" * (limit + 1)), 413),
        (client.post("/api/jobs", content=b"{"), 400), (client.post("/api/jobs", json=[1]), 400),
        (client.post("/api/jobs", json={"recipe": "x", "bogus": 1}), 400),
        (client.post("/api/yield", json={"seconds": -1}), 400),
        (client.post("/api/jobs/1/pause", json={"hard": "yes"}), 400),
        (client.get(f"/api/runs/{ids['tiny']}/curves", params={"buckets": 0}), 400),
        (client.get(f"/api/runs/{ids['tiny']}/curves", params={"fields": "secret"}), 400),
        (client.get("/api/runs", params={"sort": "nope"}), 400),
        (client.get("/api/capacity", params={"since": "x"}), 400),
        (client.get("/api/plan"), 400), (client.get("/api/plan", params={"job": "17"}), 404),
        (client.get("/api/runs/nope"), 404), (client.get("/api/runs/nope/curves"), 404),
        (client.get(f"/api/compare?a={ids['tiny']}&b=nope"), 404),
        (client.post("/api/jobs", json={"recipe": "/etc/passwd"}), 403),
        (client.post(f"/api/jobs/{done.id}/resume"), 409),
        (client.get("/health"), 503), (client.get("/v1/models"), 503), (client.post("/v1/tokenize", json={}), 404),
    ]
    ui = TestClient(create_app(None, TOKEN, True, None, ledger), base_url="http://127.0.0.1")
    alone = [
        (ui.get("/api/runs"), 401), (ui.get("/api/jobs", headers=AUTH), 404), (ui.get("/v1/models", headers=AUTH), 404),
        (ui.get("/api/runs/nope", headers=AUTH), 404), (ui.get("/api/runs?sort=nope", headers=AUTH), 400),
        (ui.delete("/api/runs", headers=AUTH), 405), (ui.get("/api/plan?device_memory=-1", headers=AUTH), 400),
    ]
    for r, status in serve + alone:
        one_shape(r, status)
    assert anon.get("/api/jobs").headers["www-authenticate"].startswith("Bearer")
    assert "GET" in client.delete("/api/jobs").headers["allow"]
    assert len(rows.all_jobs(service.con)) == before  # nothing was queued


def test_the_openapi_document_describes_bodies_auth_and_errors(client):
    spec = client.get("/openapi.json").json()
    validate(spec)
    schemes = spec["components"]["securitySchemes"]
    assert schemes["token"] == {**schemes["token"], "type": "http", "scheme": "bearer"}
    assert (schemes["session"]["in"], schemes["session"]["name"]) == ("cookie", "ember_session")
    assert (schemes["csrf"]["in"], schemes["csrf"]["name"]) == ("header", "X-Ember-CSRF")
    bodies = {"/api/jobs": {"recipe", "name", "priority", "out", "overrides"}, "/api/jobs/{ref}/pause": {"hard"},
              "/api/yield": {"seconds", "release"}}
    for path, fields in bodies.items():
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(body["properties"]) == fields and body["additionalProperties"] is False, (path, body)
    submit = spec["paths"]["/api/jobs"]["post"]["requestBody"]
    assert submit["required"] is True and submit["content"]["application/json"]["schema"]["required"] == ["recipe"]
    error = spec["components"]["schemas"]["ErrorBody"]
    assert error["required"] == ["error"]
    assert error["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}
    assert set(spec["components"]["schemas"]["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            answers = op["responses"]
            assert "422" not in answers, (method, path)  # validation errors are 400s
            for status in ("400", "401") + (("404",) if "{" in path else ()) + (("413",) if method == "post" else ()):
                assert answers[status]["content"]["application/json"]["schema"] == ref, (method, path, status)
            security = op["security"]
            assert {"token": []} in security and {} not in security, (method, path)
            assert ({"session": [], "csrf": []} if method == "post" else {"session": []}) in security, (method, path)
    for verb in ("pause", "resume", "cancel"):
        assert "409" in spec["paths"][f"/api/jobs/{{ref}}/{verb}"]["post"]["responses"]
    assert {"403", "409"} <= set(spec["paths"]["/api/jobs"]["post"]["responses"])


def test_opened_reading_is_documented_as_needing_no_token(service):
    """With [service] open_on_loopback, reading needs no token; a change still does."""
    spec = TestClient(create_app(service, TOKEN, True, None, open_reads=True), base_url="http://127.0.0.1") \
        .get("/openapi.json").json()
    assert {} in spec["paths"]["/api/runs"]["get"]["security"]
    assert {} not in spec["paths"]["/api/jobs"]["post"]["security"]


def test_one_table_maps_each_meaning_to_its_status_and_exit_code():
    """ember.web.error_responses and ember.cli.main.exit_code, on a bare app that raises each kind."""
    from fastapi import FastAPI

    from ember.cli.main import exit_code
    from ember.errors import BadInput, Conflict, EmberError, NotFound, Refused, Unavailable
    from ember.web import error_responses as errors
    raised = {"bad": BadInput("b"), "missing": NotFound("n"), "state": Conflict("c"), "policy": Refused("r"),
              "later": Unavailable("u"), "recipe": EmberError("e"), "value": ValueError("v"), "defect": KeyError("k")}
    app = FastAPI()
    errors.install(app)

    @app.get("/{kind}")
    def fail(kind: str) -> None:
        raise raised[kind]
    c = TestClient(app, raise_server_exceptions=False)
    expected = {"bad": 400, "missing": 404, "state": 409, "policy": 403, "later": 503, "recipe": 400, "value": 400,
                "defect": 500}
    for kind, status in expected.items():
        message = one_shape(c.get(f"/{kind}"), status)["message"]
        assert message == str(raised[kind]) if status != 500 else "internal error (KeyError)" in message, message
    assert c.get("/defect").headers["content-security-policy"].startswith("default-src 'none'")
    assert [exit_code(e) for e in (BadInput("b"), NotFound("n"), Conflict("c"), Refused("r"), EmberError("e"))] == \
        [2, 1, 1, 1, 1]


@pytest.mark.e2e
def test_the_commands_say_the_services_message_and_exit_1(tmp_path):
    """`ember pause` and `ember submit` read the service's message out of the one shape."""
    from tests.serve_harness import Serve
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    s = Serve(tmp_path / "home", f'[service]\nallowed = ["{allowed}"]\n[inference]\nenabled = false\n').start()
    try:
        r = s.cli("pause", "nope")
        assert r.returncode == 1 and "error: no job 'nope'; `ember queue` lists them (HTTP 404)" in r.stderr, r.stderr
        outside = write_recipe(tmp_path / "outside")
        r = s.cli("submit", str(outside))
        assert r.returncode == 1 and "is outside the folders the owner allowed" in r.stderr and "(HTTP 403)" in r.stderr
        assert "Traceback" not in r.stderr and "'message'" not in r.stderr, r.stderr
    finally:
        s.stop()
