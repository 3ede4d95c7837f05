"""The service's HTTP API in-process: the token, and bad requests answered with a 4xx that
change nothing."""

import contextlib
import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ember.events import Events
from ember.ledger import job_rows as rows
from ember.sched.owner_rules import OwnerRules
from ember.sched.service import Service
from ember.web.api import create_app
from ember.web.server import ensure_token, is_loopback
from tests.helpers import post_and_leave, run_ember, write_recipe


@pytest.fixture
def service(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    rules = OwnerRules()
    rules.service.allowed = [str(tmp_path / "allowed")]
    rules.service.max_body_bytes = 4096
    (tmp_path / "allowed").mkdir()
    return Service(rules, "sim:2x1GiB", Events(), tmp_path / "ledger.db")


def client(service, loopback=True, open_reads=False):
    # Bound to loopback the service answers only to loopback host names (DNS rebinding): not "testserver".
    return TestClient(create_app(service, "s3cret", loopback, None, open_reads=open_reads),
                      base_url="http://127.0.0.1")


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
        assert r.status_code == 401 and "token" in r.json()["error"]["message"]
        r = c.post(path, json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    assert c.get("/api/jobs", headers=AUTH).status_code == 200
    assert rows.all_jobs(service.con) == []


def test_on_loopback_every_request_needs_the_token_unless_the_owner_opens_reading(service):
    """Reading and inference on loopback were open to every local user and program (issue 24,
    item 3): now every route but signing in and the static files needs the token or the session;
    a browser asking for a page is sent to sign in. `[service] open_on_loopback = true` (the owner's
    explicit choice) opens reading and /v1 again, never a change."""
    c = client(service)
    for method, path in (("GET", "/api/jobs"), ("GET", "/api/runs"), ("GET", "/api/explain"), ("GET", "/health"),
                         ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/runs"),
                         ("GET", "/openapi.json")):
        r = c.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 401 and "token" in r.json()["error"]["message"], (method, path, r.status_code,
                                                                                 r.text[:200])
    page = c.get("/queue", headers={"accept": "text/html,application/xhtml+xml"}, follow_redirects=False)
    assert (page.status_code, page.headers["location"]) == (303, "/login")
    assert c.get("/login").status_code == 200 and c.get("/static/ember.css").status_code == 200
    assert c.get("/api/jobs", headers=AUTH).status_code == 200 and c.get("/runs", headers=AUTH).status_code == 200
    opened = client(service, open_reads=True)
    assert opened.get("/api/jobs").status_code == 200 and opened.get("/runs").status_code == 200
    assert opened.get("/v1/models").status_code == 503  # reached: inference is off in this service
    assert opened.post("/api/jobs", json={}).status_code == 401  # changes still need the token
    off_loopback = client(service, loopback=False, open_reads=True)  # the setting is for loopback only
    assert off_loopback.get("/api/jobs").status_code == 401
    assert rows.all_jobs(service.con) == []


def test_off_loopback_every_request_needs_the_token(service):
    c = client(service, loopback=False)
    assert c.get("/api/jobs").status_code == 401
    assert c.get("/health").status_code == 401
    assert c.get("/api/jobs", headers=AUTH).status_code == 200


def test_bad_requests_get_a_4xx_and_change_nothing(service, tmp_path, monkeypatch):
    c = client(service)
    outside = tmp_path / "elsewhere.toml"
    outside.write_text("")
    # A relative path is not resolved against the service's folder: whoever sent it meant their own.
    write_recipe(tmp_path / "allowed")
    monkeypatch.chdir(tmp_path / "allowed")
    cases = [
        (c.post("/api/jobs", content=b"{not json", headers=AUTH), 400, "not valid JSON"),
        (c.post("/api/jobs", json=[1, 2], headers=AUTH), 400, "JSON object"),
        (c.post("/api/jobs", json={}, headers=AUTH), 400, "recipe"),
        (c.post("/api/jobs", json={"recipe": "x.toml", "bogus": 1}, headers=AUTH), 400, "unknown field"),
        (c.post("/api/jobs", json={"recipe": "x.toml", "priority": "high"}, headers=AUTH), 400, "priority"),
        (c.post("/api/jobs", json={"recipe": str(outside)}, headers=AUTH), 403, "outside the folders"),
        (c.post("/api/jobs", json={"recipe": str(tmp_path / "allowed" / "none.toml")}, headers=AUTH), 400,
         "no such file"),
        (c.post("/api/jobs", json={"recipe": "recipe.toml"}, headers=AUTH), 400, "'recipe': 'recipe.toml' is relative"),
        (c.post("/api/jobs", json={"recipe": str(tmp_path / "allowed" / "recipe.toml"), "out": "runs/x"}, headers=AUTH),
         400, "'out': 'runs/x' is relative"),
        (c.post("/api/jobs", content=b"x" * 5000, headers=AUTH), 413, "over 4096 bytes"),
        (c.post("/api/jobs/nope/pause", json={}, headers=AUTH), 404, "no job 'nope'"),
        (c.post("/api/jobs/7/cancel", headers=AUTH), 404, "no job"),
        (c.get("/api/jobs/7/logs", headers=AUTH), 404, "no job"),
        (c.post("/api/yield", json={"seconds": -5}, headers=AUTH), 400, "seconds"),
        (c.post("/api/yield", json={"seconds": "soon"}, headers=AUTH), 400, "seconds"),
        (c.get("/v1/models", headers=AUTH), 503, "inference is off"),
    ]
    for r, status, words in cases:
        assert r.status_code == status, (r.status_code, r.text)
        assert words in r.json()["error"]["message"], r.json()
    assert rows.all_jobs(service.con) == [] and service.yield_until is None


def test_a_finished_job_cannot_be_paused_or_cancelled(service, tmp_path):
    job = rows.insert(service.con, "done", "/x.toml", str(tmp_path / "run"), [], 0, {"memory": 1}, "queued")
    c = client(service)
    assert c.post(f"/api/jobs/{job.id}/cancel", headers=AUTH).json()["state"] == "cancelled"
    r = c.post("/api/jobs/done/pause", json={}, headers=AUTH)
    assert r.status_code == 409 and "cancelled" in r.json()["error"]["message"]
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
    message = r.json()["error"]["message"]
    assert "can never fit here" in message and "largest device offers 0.00 GiB" in message
    assert "`ember plan` says: local" in message
    assert rows.all_jobs(service.con) == []


@pytest.mark.parametrize("name", ["../../x", "..", ".hidden", "a/b", "a\\b", "x" * 65, "", "sp ace", "ünï"])
def test_a_job_name_outside_the_grammar_is_refused_before_anything(service, tmp_path, name):
    """A name becomes the default run folder $EMBER_HOME/runs/NAME: '../../x' wrote outside every
    allowed root, and a 5,000-character one broke the queue page. Refused with a 400 showing the
    grammar, before the recipe is even planned."""
    recipe = tmp_path / "allowed" / "r.toml"
    recipe.write_text("")
    r = client(service).post("/api/jobs", json={"recipe": str(recipe), "name": name}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert "[A-Za-z0-9][A-Za-z0-9._-]{0,63}" in r.json()["error"]["message"]
    assert rows.all_jobs(service.con) == [] and not (tmp_path / "x").exists()


def test_the_cli_refuses_a_bad_name_as_a_usage_error(tmp_path):
    from tests.helpers import run_ember
    for name in ("../../x", "y" * 5000):
        r = run_ember("submit", tmp_path / "r.toml", "--name", name)
        assert r.returncode == 2 and "{0,63}" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr) < 2000  # the name is shortened in the message


def test_a_default_run_folder_that_is_a_link_out_of_the_runs_folder_is_refused(tmp_path, monkeypatch):
    from ember.errors import Refused
    from ember.paths import default_run_folder, name_from
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "runs").mkdir(parents=True)
    (tmp_path / "home" / "runs" / "j").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Refused, match="outside"):  # answered 403 (ember.web.error_responses)
        default_run_folder("j")
    assert default_run_folder("k") == (tmp_path / "home" / "runs" / "k").resolve()
    assert name_from("../my recipe (v2)", "7") == "my-recipe-v2-7"
    assert name_from("...", "7") == "job-7" and len(name_from("z" * 200, "12")) == 64


class Recorder:
    """A real HTTP server on loopback standing in for the inference engine: it records every
    request that reaches it and answers 200 with a JSON body."""

    def __init__(self, extra_headers: dict[str, str] | None = None):
        import http.server
        import threading
        seen = self.seen = []
        headers = self.headers = []  # each request's headers, in seen's order

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self):
                length = int(self.headers.get("content-length") or 0)
                seen.append((self.command, self.path, self.rfile.read(length)))
                headers.append({k.lower(): v for k, v in self.headers.items()})
                body = b'{"ok": true}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                for k, v in (extra_headers or {}).items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            do_GET = do_POST = answer

            def log_message(self, *args):
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_explain_says_why_each_waiting_job_waits(service):
    """`ember queue --explain` and the queue page read this: a hand's hold (which --explain did
    not see), memory, and the owner's yield, each in words with the way out (issue 24, item 11)."""
    gib = 2**30
    rows.insert(service.con, "big", "/x.toml", "/tmp/big", [], 0, {"memory": 4 * gib}, "queued")
    rows.insert(service.con, "held", "/x.toml", "/tmp/held", [], 5, {"memory": 4 * gib}, "queued")
    service.control.pause("held", hard=True)  # also one scheduling pass
    why = {row["job"]: row["waiting"] for row in service.explain()}
    assert why["held"] == ["held by hand (a hard pause): `ember resume held` lets it start again"]
    (big,) = why["big"]
    assert big.startswith("memory: it needs 4.00 GiB per device and no device may give a job more than 1.00 GiB"), big
    service.yield_devices(None, timeout=5)
    why = {row["job"]: row["waiting"] for row in service.explain()}
    assert why["big"] == ["yield: ember yield"] and why["held"][0].startswith("held by hand"), why
    assert [v.waiting for v in service.queue() if v.name == "big"] == [why["big"]]  # what the page shows


def test_the_inference_proxy_forwards_only_the_openai_routes(service):
    """`/v1/..%2F..%2Fsecret` reached the engine as `/secret`: dot segments and encoded separators
    are refused before routing (on every path), and only the documented routes are forwarded."""
    engine = Recorder()
    try:
        c = TestClient(create_app(service, "s3cret", True, engine.url), base_url="http://127.0.0.1")
        refused = [
            ("GET", "/v1/..%2F..%2Fsecret", 400, "encoded separator"),
            ("GET", "/v1/..%2f..%2fsecret", 400, "encoded separator"),
            ("GET", "/v1/models%5C..%5Csecret", 400, "encoded separator"),
            ("GET", "/v1/%2e%2e/secret", 400, "'..' segment"),
            ("GET", "/api/..%2Fv1%2Fmodels", 400, "encoded separator"),
            ("POST", "/v1/tokenize", 404, "not an inference route"),
            ("GET", "/v1/docs", 404, "not an inference route"),
            ("GET", "/v1/completions", 404, "not an inference route"),
            ("POST", "/v1/models", 404, "not an inference route"),
            ("POST", "/v1/slots/0?action=save", 404, "not an inference route"),
        ]
        for method, path, status, says in refused:
            r = c.request(method, path, json={} if method == "POST" else None, headers=AUTH)
            assert (r.status_code, says in r.json()["error"]["message"]) == (status, True), \
                (path, r.status_code, r.text)
        assert engine.seen == []  # nothing reached the engine
        assert c.get("/v1/models", headers=AUTH).status_code == 200
        assert c.post("/v1/chat/completions", json={"messages": []}, headers=AUTH).status_code == 200
        assert [(m, p) for m, p, _ in engine.seen] == [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]
    finally:
        engine.close()


def test_the_dashboards_session_cookie_never_crosses_the_inference_proxy(service):
    """A browser signed in to the dashboard sends its session cookie with every request to the
    service, /v1 included, and the proxy passed it on to the engine: with [inference] upstream,
    another program, possibly on another host, then held the key to the whole service (the
    proxy dropped the bearer token already). A Set-Cookie from the engine reached the browser
    under the service's origin, where it could replace that session; and the proxy's one HTTP
    client kept it, sending it with every later request, whoever made it. None of it crosses now."""
    from ember.web.security import SESSION_COOKIE, session_value
    engine = Recorder({"Set-Cookie": f"{SESSION_COOKIE}=forged; Path=/"})
    try:
        c = TestClient(create_app(service, "s3cret", True, engine.url), base_url="http://127.0.0.1")
        c.cookies.set(SESSION_COOKIE, session_value("s3cret"))
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            r = c.request(method, path, json={"prompt": "In"} if method == "POST" else None)
            assert r.status_code == 200, r.text  # the session is what let it in
            assert "set-cookie" not in r.headers, r.headers
            sent = engine.headers[-1]
            assert "cookie" not in sent and "authorization" not in sent, sent
            assert session_value("s3cret") not in str(sent)
        assert engine.headers[0]["content-type"] == "application/json"  # what the engine needs still goes
        assert c.cookies.get(SESSION_COOKIE) == session_value("s3cret")
    finally:
        engine.close()


def test_a_page_of_another_origin_cannot_make_the_browser_use_inference(service):
    """POST /v1 needs no CSRF value (inference is a read), and any content type is read as JSON: a
    page of any site could make the owner's browser send `fetch("http://127.0.0.1:8765/v1/completions",
    {method: "POST", mode: "no-cors", body: "{...}"})` (text/plain, no preflight). With
    `[service] open_on_loopback` it reached the engine (200) with no credential at all, and with
    the session cookie from a page of another port of localhost (SameSite does not count ports);
    each such request soft-pauses the jobs on the inference device. Now a change a browser says
    comes from another origin is refused (403) before anything, and programs are answered as before."""
    from ember.web.security import CSRF_HEADER, SESSION_COOKIE, csrf_value, session_value
    engine = Recorder()
    body, plain = b'{"prompt": "In", "max_tokens": 512}', {"content-type": "text/plain;charset=UTF-8"}
    try:
        opened = TestClient(create_app(service, "s3cret", True, engine.url, open_reads=True),
                            base_url="http://127.0.0.1:8765")
        r = opened.post("/v1/completions", content=body, headers={
            **plain, "origin": "https://evil.example", "sec-fetch-site": "cross-site", "sec-fetch-mode": "no-cors"})
        assert r.status_code == 403 and "another origin" in r.json()["error"]["message"], (r.status_code, r.text)
        signed = TestClient(create_app(service, "s3cret", True, engine.url), base_url="http://localhost:8765")
        signed.cookies.set(SESSION_COOKIE, session_value("s3cret"))
        for headers in ({"origin": "http://localhost:3000", "sec-fetch-site": "same-site"},
                        {"origin": "http://localhost:3000"}):  # a browser without Sec-Fetch-*: its Origin
            r = signed.post("/v1/chat/completions", content=body, headers={**plain, **headers})
            assert r.status_code == 403, (headers, r.status_code, r.text)
        assert engine.seen == [] and service.gate.stats()["requests"] == 0  # nothing reached the engine
        assert opened.post("/v1/completions", content=body, headers=plain).status_code == 200  # a program
        own = {"origin": "http://localhost:8765", "sec-fetch-site": "same-origin", CSRF_HEADER: csrf_value("s3cret")}
        assert signed.post("/v1/completions", json={"prompt": "In"}, headers=own).status_code == 200
        assert signed.post("/api/yield", json={"release": True}, headers=own).status_code == 200  # the dashboard
        assert len(engine.seen) == 2
    finally:
        engine.close()


def test_an_adapter_asked_of_the_upstream_engine_is_refused_not_answered_by_its_base(service, tmp_path):
    """With [inference] upstream, a request naming one of ember's LoRA runs went to llama.cpp, which
    answered with its base model as if it were the adapter (issue 24, item 9). Now it is a 404
    saying what is missing and what to do, and never forwarded; other names still go."""
    engine = Recorder()
    try:
        service.rules.inference.upstream = engine.url
        recipe = write_recipe(tmp_path / "recipe", method={"kind": "lora", "rank": 4}, train={"max_steps": 1})
        out = Path(os.environ["EMBER_HOME"]) / "runs" / "bible-lora"  # where the service's jobs train
        done = run_ember("run", recipe, "--out", out, "--no-ledger")
        assert done.returncode == 0, done.stderr
        c = TestClient(create_app(service, "s3cret", True, engine.url), base_url="http://127.0.0.1", headers=AUTH)
        for path, body in (("/v1/completions", {"model": "bible-lora", "prompt": "In"}),
                           ("/v1/chat/completions", {"model": "bible-lora", "messages": []})):
            r = c.post(path, json=body)
            assert r.status_code == 404, (r.status_code, r.text)
            message = r.json()["error"]["message"]
            assert "LoRA run" in message and "ember export" in message, r.json()
        assert engine.seen == []
        for model in ("base", "gpt-4o", None):  # the upstream engine's own model, under any name
            assert c.post("/v1/completions", json={"model": model, "prompt": "In"}).status_code == 200
        assert len(engine.seen) == 3
    finally:
        engine.close()


@contextlib.contextmanager
def served(app) -> Iterator[int]:
    """`app` served by a real uvicorn on a port of loopback (in a thread of this process); its port."""
    import threading

    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(600):  # started within 60 s
            if server.started:
                break
            threading.Event().wait(0.1)
        assert server.started, "uvicorn did not start within 60 s"
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(service):
    """A chunked body has no Content-Length: it was read whole before the 413 (400 MB took the
    service from 71 to 472 MiB). Now reading stops at the limit: 500 MB sent in 1 MiB chunks to a
    real server gets a 413, and the process grows by less than 20 MB."""
    import select
    import socket

    import psutil
    engine = Recorder()  # so that /v1 reads its body: with inference off it answers 503 first
    with served(create_app(service, "s3cret", True, engine.url)) as port:
        me = psutil.Process()
        try:
            for path in ("/api/jobs", "/v1/completions"):
                before = me.memory_info().rss
                chunk = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
                with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                              f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
                    sent = 0
                    for _ in range(500):  # at most 500 MiB
                        if select.select([s], [], [], 0)[0]:
                            break  # the answer came
                        try:
                            s.sendall(chunk)
                        except OSError:
                            break  # the server closed its side
                        sent += 1
                    answer = s.recv(4096).decode("latin-1")
                grown = me.memory_info().rss - before
                assert answer.startswith("HTTP/1.1 413"), (path, sent, answer[:300])
                assert grown < 20 * 2**20, f"{path}: grew by {grown / 2**20:.1f} MiB after {sent} MiB sent"
                assert sent < 100, f"{path}: {sent} MiB went in before the 413"
            assert rows.all_jobs(service.con) == [] and engine.seen == []
        finally:
            engine.close()


def test_an_engine_that_breaks_off_its_answer_ends_the_request_for_the_pause_gate(service):
    """Before: when the engine's answer broke off (its process died mid-stream), Starlette ran no
    background task after the failed body, so the request was counted in flight for good: training
    on the inference device stayed paused until the service restarted."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", "1000")  # and 10 bytes of it, then the connection closes
            self.end_headers()
            self.wfile.write(b"data: {}\n\n")
            self.close_connection = True

        def log_message(self, *args):
            pass
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        c = TestClient(create_app(service, "s3cret", True, f"http://127.0.0.1:{engine.server_address[1]}"),
                       base_url="http://127.0.0.1", raise_server_exceptions=False)
        r = c.post("/v1/completions", json={"prompt": "In", "stream": True}, headers=AUTH)
        assert (r.status_code, r.content) == (200, b"data: {}\n\n")  # what the engine sent before it broke off
        assert service.gate.requests == 1
        assert service.gate.in_flight == 0 and service.gate.stats()["in_flight"] == 0
    finally:
        engine.shutdown()
        engine.server_close()


def test_a_client_that_leaves_before_the_engine_answers_closes_the_request_to_the_engine(service):
    """Before: the proxy waited for the engine's answer whatever its client did: an answer not
    streamed (sent whole at its end) was generated to the last of max_tokens for nobody, counted in
    flight, and training on the inference device paused, all along."""
    import http.server
    import threading
    arrived, closed = threading.Event(), threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):  # an engine that takes its time to answer
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            arrived.set()
            if self.rfile.read(1) == b"":  # no more bytes, ever: the proxy closed the connection
                closed.set()

        def log_message(self, *args):
            pass
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        app = create_app(service, "s3cret", True, f"http://127.0.0.1:{engine.server_address[1]}")
        leaving = threading.Thread(target=post_and_leave, args=(app, "/v1/completions", {"prompt": "In"}, AUTH,
                                                                arrived.is_set), daemon=True)
        leaving.start()
        leaving.join(60)
        assert not leaving.is_alive(), "the proxy still waited for the engine 60 s after its client left"
        assert closed.wait(60), "the engine's connection stayed open"
        assert (service.gate.requests, service.gate.in_flight) == (1, 0)
    finally:
        engine.shutdown()
        engine.server_close()


def test_an_answer_through_the_inference_proxy_has_one_date_and_one_server(service):
    """The proxy returned the engine's Date and Server headers and uvicorn added its own: every
    /v1 answer had two of each (RFC 9110 allows one Date; clients that keep the last saw the
    engine's clock and name). Only the service's own are sent now."""
    import http.client
    engine = Recorder()  # Python's http.server: it sends Server and Date as llama.cpp's does
    try:
        with served(create_app(service, "s3cret", True, engine.url)) as port:
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                con = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                con.request(method, path, body=b'{"prompt": "In"}' if method == "POST" else None,
                            headers={"Authorization": "Bearer s3cret", "Content-Type": "application/json"})
                r = con.getresponse()
                r.read()
                con.close()
                names = [k.lower() for k, _ in r.getheaders()]
                assert r.status == 200 and names.count("date") == 1 and names.count("server") == 1, \
                    (method, path, r.status, r.getheaders())
                assert "BaseHTTP" not in r.getheader("server"), r.getheaders()  # uvicorn's, not the engine's
            assert len(engine.seen) == 2
    finally:
        engine.close()


def test_ember_yield_outlives_a_restart_of_the_service(service, tmp_path):
    """A yielded job trained 591 steps in the 30 s after a SIGKILL and restart of the service:
    the yield lived in the service's memory. It is written (fsynced) before it is answered and a
    new service over the same home starts with it, `--for`'s end included; release removes it."""
    def restarted() -> Service:  # what a restart after SIGKILL finds: the home, nothing in memory
        return Service(service.rules, "sim:2x1GiB", Events(), tmp_path / "ledger.db")
    c = client(service)
    assert c.post("/api/yield", json={}, headers=AUTH).status_code == 200
    assert restarted().yield_until == float("inf")
    assert c.post("/api/yield", json={"release": True}, headers=AUTH).status_code == 200
    assert restarted().yield_until is None
    r = c.post("/api/yield", json={"seconds": 3600}, headers=AUTH).json()
    assert restarted().yield_until == pytest.approx(r["until"])
    # A job queued now is held by it in the restarted service (no tick here: nothing is started).
    job = rows.insert(service.con, "j", "/x.toml", str(tmp_path / "run"), [], 0, {"memory": 1}, "queued")
    assert [h.rule for h in restarted().holds_on(job)] == ["yield"]


def finished(service, name: str, state: str, out: Path, recipe: str = "/x.toml") -> rows.JobRow:
    """A job that trained into `out` and ended `state` (by the ledger's own compare-and-set)."""
    job = rows.insert(service.con, name, recipe, str(out), [], 0, {"memory": 1}, "queued")
    assert rows.set_state(service.con, job.id, "queued", "starting", "admitted", {})
    assert rows.set_state(service.con, job.id, "starting", state, "ended", {"cause": f"it {state}"})
    return rows.get(service.con, job.id)


def snapshot(folders: list[Path], ledger: Path) -> tuple:
    """Every byte of the run folders and every row of the ledger's run tables."""
    import sqlite3
    files = {p: p.read_bytes() for f in folders for p in sorted(f.rglob("*")) if p.is_file()}
    con = sqlite3.connect(ledger)
    tables = {t: sorted(map(repr, con.execute(f"SELECT * FROM {t}")))
              for t in ("runs", "attempts", "events", "checkpoints", "summaries")}
    con.close()
    return files, tables


def test_purge_removes_finished_jobs_rows_never_their_runs_and_never_an_active_job(service, tmp_path):
    """Finished jobs piled up in the queue for ever (issue 24, item 12). `POST /api/jobs/purge`
    (what `ember queue purge` calls) removes their rows, logs and control files, chosen by name,
    state or age; the run folders and the ledger's runs, attempts, events, checkpoints and
    summaries stay byte for byte; a queued or running job is never removed, and naming one
    removes nothing; the purged ids are never given again."""
    from tests.web.runs import make_run
    runs = tmp_path / "allowed" / "runs"
    ids = {n: make_run(service.con, runs / n, 12) for n in ("done", "broke", "stopped")}
    jobs = {n: finished(service, n, s, runs / n) for n, s in
            (("done", "completed"), ("broke", "failed"), ("stopped", "cancelled"))}
    waiting = rows.insert(service.con, "waiting", "/x.toml", str(runs / "waiting"), [], 0, {"memory": 1}, "queued")
    training = rows.insert(service.con, "training", "/x.toml", str(runs / "done"), [], 0, {"memory": 1}, "queued")
    assert rows.set_state(service.con, training.id, "queued", "running", "test", {})
    for job in jobs.values():
        service.log_path(job).parent.mkdir(parents=True, exist_ok=True)
        service.log_path(job).write_text("its output\n")
        service.ctl(job)
    before = snapshot([runs], tmp_path / "ledger.db")
    c = client(service)

    def names() -> set[str]:
        return {j["name"] for j in c.get("/api/jobs", headers=AUTH).json()}

    # Each job names its run folder and, once it trained, its run.
    view = c.get("/api/jobs/done", headers=AUTH).json()
    assert (view["out"], view["run"]) == (str(runs / "done"), ids["done"])
    assert c.get("/api/jobs/waiting", headers=AUTH).json()["run"] is None

    r = c.post("/api/jobs/purge", json={"dry_run": True}, headers=AUTH)
    assert r.status_code == 200 and r.json()["dry_run"] is True
    assert {j["name"] for j in r.json()["removed"]} == {"done", "broke", "stopped"}
    assert names() == {"done", "broke", "stopped", "waiting", "training"}  # a dry run removes nothing
    for refused, status, says in (({"jobs": ["done", "waiting"]}, 409, "job waiting is queued"),
                                  ({"jobs": [training.id]}, 409, "job training is running"),
                                  ({"states": ["running"]}, 400, "states"),
                                  ({"older_than_seconds": -1}, 400, "older_than_seconds"),
                                  ({"jobs": ["nope"]}, 404, "no job 'nope'")):
        r = c.post("/api/jobs/purge", json=refused, headers=AUTH)
        assert r.status_code == status and says in r.json()["error"]["message"], (refused, r.text)
        assert names() == {"done", "broke", "stopped", "waiting", "training"}

    r = c.post("/api/jobs/purge", json={"states": ["failed"]}, headers=AUTH).json()
    assert [j["name"] for j in r["removed"]] == ["broke"] and names() == {"done", "stopped", "waiting", "training"}
    service.con.execute("UPDATE jobs SET updated = updated - 3600 WHERE name = 'done'")  # it ended an hour ago
    r = c.post("/api/jobs/purge", json={"older_than_seconds": 600}, headers=AUTH).json()
    assert [j["name"] for j in r["removed"]] == ["done"]
    r = c.post("/api/jobs/purge", json={"jobs": ["stopped"]}, headers=AUTH).json()
    assert [(j["name"], j["run"]) for j in r["removed"]] == [("stopped", ids["stopped"])]
    assert names() == {"waiting", "training"}
    assert c.post("/api/jobs/purge", json={}, headers=AUTH).json()["removed"] == []

    assert snapshot([runs], tmp_path / "ledger.db") == before  # run folders and the ledger's runs untouched
    for job in jobs.values():
        assert not service.log_path(job).exists() and not (service.dir / "control" / str(job.id)).exists()
        assert rows.transitions(service.con, job.id)[-1]["to_state"] == "purged"  # its history stays
    assert rows.get(service.con, waiting.id).state == "queued" and rows.get(service.con, training.id).state == "running"
    newest = rows.insert(service.con, "next", "/x.toml", str(runs / "next"), [], 0, {"memory": 1}, "queued")
    assert newest.id > max(j.id for j in [*jobs.values(), waiting, training])


def test_requeue_takes_back_a_failed_or_cancelled_job_and_refuses_what_it_cannot_resume(service, tmp_path):
    """A failed job could not be queued again (issue 24, item 12). `POST /api/jobs/JOB/requeue`
    (`ember requeue JOB`, the queue page's button) queues a failed or cancelled job again, its
    hold, pause and cause cleared, to resume the same run; a job that never trained starts from
    the beginning. Refused, changing nothing: an unfinished or completed job, a run folder that
    is gone while the ledger knows its run, a folder another unfinished job owns now."""
    from tests.web.runs import make_run
    allowed = tmp_path / "allowed"
    recipe = allowed / "r.toml"
    recipe.write_text("")
    make_run(service.con, allowed / "runs" / "broke", 12, completed=False)
    make_run(service.con, allowed / "runs" / "gone", 12, completed=False)
    broke = finished(service, "broke", "failed", allowed / "runs" / "broke", str(recipe))
    gone = finished(service, "gone", "failed", allowed / "runs" / "gone", str(recipe))
    import shutil
    shutil.rmtree(allowed / "runs" / "gone")
    never = rows.insert(service.con, "never", str(recipe), str(allowed / "runs" / "never"), [], 0, {"memory": 1},
                        "queued")
    service.control.cancel("never")
    done = finished(service, "done", "completed", allowed / "runs" / "done", str(recipe))
    c = client(service)
    for ref, status, says in (("gone", 404, "its run folder " + str(allowed / "runs" / "gone") + " is gone"),
                              ("done", 409, "job done is completed: only a failed or cancelled job is requeued"),
                              ("nope", 404, "no job 'nope'")):
        r = c.post(f"/api/jobs/{ref}/requeue", headers=AUTH)
        assert r.status_code == status and says in r.json()["error"]["message"], (ref, r.text)
    assert "ember submit" in c.post("/api/jobs/gone/requeue", headers=AUTH).json()["error"]["message"]
    assert (rows.get(service.con, gone.id).state, rows.get(service.con, done.id).state) == ("failed", "completed")

    r = c.post("/api/jobs/broke/requeue", headers=AUTH)
    assert r.status_code == 200, r.text
    job = r.json()
    assert (job["state"], job["hold"], job["cause"]) == ("queued", None, None)
    assert job["out"] == str(allowed / "runs" / "broke")
    assert rows.transitions(service.con, broke.id)[-1]["why"] == "requeued by hand"
    r = c.post("/api/jobs/broke/requeue", headers=AUTH)  # now queued: not again
    message = r.json()["error"]["message"]
    assert r.status_code == 409 and "job broke is queued" in message and "ember resume" in message, r.text
    assert c.post("/api/jobs/never/requeue", headers=AUTH).json()["state"] == "queued"  # never trained: from the start

    rival = finished(service, "rival", "cancelled", allowed / "runs" / "broke", str(recipe))  # broke's folder, queued
    r = c.post("/api/jobs/rival/requeue", headers=AUTH)
    assert r.status_code == 409 and "belongs to job broke (queued)" in r.json()["error"]["message"], r.text
    assert rows.get(service.con, rival.id).state == "cancelled"
    r = c.post("/api/jobs/done/resume", headers=AUTH)
    assert r.status_code == 409 and "requeue" not in r.json()["error"]["message"]  # a completed job is not requeued
    service.control.cancel("broke")
    assert "`ember requeue broke`" in c.post("/api/jobs/broke/resume", headers=AUTH).json()["error"]["message"]


def test_a_path_too_long_for_the_file_system_is_400_not_500(service, tmp_path):
    """A 4,000-character recipe name, a 300-character folder name and a 6,000-character path
    were answered 500 (OSError: File name too long, raised while the path was checked)."""
    service.rules.service.max_body_bytes = 65536  # the bodies below are up to ~6 KB
    c = TestClient(create_app(service, "s3cret", True, None), base_url="http://127.0.0.1",
                   raise_server_exceptions=False)
    allowed = tmp_path / "allowed"
    for recipe in (str(allowed / ("x" * 4000 + ".toml")), str(allowed / ("d" * 300) / "r.toml"),
                   "/" + "a/" * 3000 + "r.toml"):
        r = c.post("/api/jobs", json={"recipe": recipe}, headers=AUTH)
        assert r.status_code == 400 and "File name too long" in r.json()["error"]["message"], r.text
    assert c.get("/api/jobs", headers=AUTH).json() == []


def test_a_path_under_an_unknown_users_home_is_400_not_500(service, tmp_path):
    """'~nosuchuser/r.toml' as the recipe or the run folder was answered 500: the check that a path
    is absolute expanded '~user' first, and Path.expanduser raised RuntimeError ("Could not
    determine home directory"). Now it is a 400 saying the path is not usable, and nothing is queued."""
    c = TestClient(create_app(service, "s3cret", True, None), base_url="http://127.0.0.1",
                   raise_server_exceptions=False)
    recipe = tmp_path / "allowed" / "r.toml"
    recipe.write_text("")
    for body, key in (({"recipe": "~nosuchuser/r.toml"}, "recipe"),
                      ({"recipe": str(recipe), "out": "~nosuchuser/run"}, "run folder")):
        r = c.post("/api/jobs", json=body, headers=AUTH)
        assert r.status_code == 400, r.text
        assert f"{key} '~nosuchuser/" in r.json()["error"]["message"] and "not a usable path" in r.text, r.text
    assert c.get("/api/jobs", headers=AUTH).json() == []


class Stub:
    """What the stand-in service saw (method, path, body) and what it answers, by path without the
    query: (status, JSON body); any other path is a 404 in the service's error shape."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []
        self.answers: dict[str, tuple[int, object]] = {}


@pytest.fixture
def announced_stub(tmp_path, monkeypatch):
    """A stand-in for a running service, announced in $EMBER_HOME/serve/serve.json as the commands
    find one (a Stub: it records each request and answers as told)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from ember.sched.process import start_time
    stub = Stub()

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            stub.seen.append((self.command, self.path, body))
            status, answer = stub.answers.get(self.path.split("?")[0], (404, {"error": {
                "message": "stub: no such job", "type": "not_found_error", "param": None, "code": 404}}))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        do_GET = do_POST = answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "stub-home"))
    serve = tmp_path / "stub-home" / "serve"
    serve.mkdir(parents=True)
    (serve / "serve.json").write_text(json.dumps({"pid": os.getpid(), "start": start_time(os.getpid()),
                                                  "url": f"http://127.0.0.1:{server.server_port}"}))
    (serve / "token").write_text("s3cret\n")
    yield stub
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("argv", [["cancel", "²"], ["pause", "sp ace", "--hard"], ["resume", "x?hard=1"],
                                  ["cancel", "a#b"], ["logs", "é"]])
def test_a_job_named_with_any_characters_reaches_the_service_quoted(announced_stub, capsys, argv):
    """`ember cancel ²` and `ember logs é` ended in a UnicodeEncodeError traceback (the job was put
    in the request's path as it was); `ember pause 'sp ace'` said the service did not answer ("is
    `ember serve` running?"); '?' and '#' cut the path short. The job is quoted into the path now,
    and the service's answer is printed."""
    from urllib.parse import quote
    from ember.cli.main import main
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "stub: no such job (HTTP 404)" in err and "Traceback" not in err, err
    assert [path for _, path, _ in announced_stub.seen] == [f"/api/jobs/{quote(argv[1], safe='')}/"
                                                       f"{'logs?offset=0' if argv[0] == 'logs' else argv[0]}"]


@pytest.mark.parametrize("argv", [["queue", "purge", "--older-than", ""], ["yield", "--for", ""]])
def test_an_empty_duration_is_refused_not_read_as_none(announced_stub, capsys, argv):
    """`ember queue purge --older-than ""` (a script's unset variable) sent no age at all, and the
    service removed every finished job; `ember yield --for ""` held training until released. An
    empty duration is refused like any malformed one, before anything is sent."""
    from ember.cli.main import main
    assert main(argv) == 1
    assert "write a duration like 90s, 30m, 2h or 1d" in capsys.readouterr().err
    assert announced_stub.seen == []


@pytest.mark.parametrize("duration, says", [("10000d", "--for '10000d': at most 7d at once; for longer, run "
                                                         "`ember yield` without --for"),
                                              ("0s", "--for '0s': must be longer than 0")])
def test_a_yield_beyond_its_bounds_is_refused_naming_the_option(announced_stub, capsys, duration, says):
    """`ember yield --for 10000d` sent 864,000,000 s and printed the API's refusal, which names its
    JSON field ("seconds: Input should be less than or equal to 604800"), not the option the user
    typed; so did --for 0. Refused before anything is sent, saying the way to a longer hold."""
    from ember.cli.main import main
    assert main(["yield", "--for", duration]) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert announced_stub.seen == []


def test_an_engine_that_fails_mid_answer_leaves_no_request_in_flight(service):
    """The engine died (or was restarted) half-way through an answer: the relay's error skipped the
    response's background task, so the gate kept the request in flight for ever, and training on
    the inference device stayed paused for inference (a lease the service renews) until the
    service restarted. The request ends with the relay now, however it ends."""
    import socket
    import threading
    listener = socket.create_server(("127.0.0.1", 0))

    def engine() -> None:  # answers one request with half a chunked body, then hangs up
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n")
    threading.Thread(target=engine, daemon=True).start()
    try:
        c = TestClient(create_app(service, "s3cret", True, f"http://127.0.0.1:{listener.getsockname()[1]}"),
                       base_url="http://127.0.0.1", raise_server_exceptions=False)
        try:
            c.post("/v1/completions", json={"model": "base", "prompt": "hi"}, headers=AUTH)
        except Exception:  # the client may see the cut answer as an error of its own
            pass
    finally:
        listener.close()
    assert service.gate.in_flight == 0 and service.gate.requests == 1


def test_ember_queue_shows_a_cause_with_brackets_as_it_is(announced_stub, capsys, monkeypatch):
    """A failed job's cause is ember's own error, which names keys as '[train] max_steps': `ember
    queue` printed it as rich markup, so '[train]' and '[model]' vanished from the message (the
    very key to fix), and a '[/...]' in it ended the command with a MarkupError traceback."""
    from ember.cli.main import main
    from ember.sched.job_view import JobView
    cause = "error: /r.toml: [train] max_steps = -1: must be >= 1; [model] path; [/x] [bold]"
    failed = JobView(3, "j", "failed", 0, [], 0, 4, None, None, 0, cause, "/runs/j")
    announced_stub.answers = {"/api/jobs": (200, [dataclasses.asdict(failed)]), "/api/owner": (200, {"notes": []})}
    monkeypatch.setenv("COLUMNS", "400")  # one line a row
    assert main(["queue"]) == 0
    assert cause in capsys.readouterr().out


def test_a_yield_that_ends_before_a_job_leaves_answers_at_once_not_after_the_timeout(service, tmp_path):
    """`POST /api/yield {"seconds": 0.01}` while a job ran hung for the whole timeout (600 s), then
    answered a 503 saying 'the yield holds', though it had ended at once and the job trained on:
    the wait never looked at the yield. A job slow to checkpoint against `ember yield --for 5s`
    took the same path. It now answers 409 as soon as the yield has ended with a job still on the
    devices. (The job here is a process of this test's that ignores SIGTERM: a job that has not
    yet reached its checkpoint.)"""
    import signal
    import subprocess
    import sys
    from ember.errors import Conflict
    from ember.sched import process
    slow = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert slow.stdout.readline().strip() == "ready"
        job = rows.insert(service.con, "slow", "/x.toml", str(tmp_path / "allowed" / "run"), [], 0, {"memory": 1},
                          "queued")
        assert rows.set_state(service.con, job.id, "queued", "starting", "admitted",
                              {"pid": slow.pid, "pid_start": process.start_time(slow.pid)})
        assert rows.set_state(service.con, job.id, "starting", "running", "stepped", {})
        with pytest.raises(Conflict, match=r"the yield ended \(its time was up\).*slow still on them") as e:
            service.yield_devices(0.3, timeout=60)  # before the fix: Unavailable, 60 s later
        print(e.value)
        assert slow.poll() is None  # the job was asked (SIGTERM) and is still there
        service.release_yield()
        with pytest.raises(Conflict, match=r"the yield ended \(released\)"):  # released by another client meanwhile
            import threading
            threading.Timer(0.5, service.release_yield).start()
            service.yield_devices(None, timeout=60)
    finally:
        os.killpg(slow.pid, signal.SIGKILL)  # ours: its own group
        slow.wait()


def test_a_log_offset_past_the_largest_file_is_an_empty_answer_not_a_500(service, tmp_path):
    """`GET /api/jobs/J/logs?offset=17592186040321` (past ext4's largest file) was a 500
    ('internal error (OSError)'): the seek failed. An offset past the end reads nothing."""
    job = rows.insert(service.con, "j", "/x.toml", str(tmp_path / "allowed" / "run"), [], 0, {"memory": 1}, "queued")
    log = service.log_path(job)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"step 1\n")
    c = client(service)
    for offset in (7, 2**44 + 1, 2**63 - 1):
        r = c.get(f"/api/jobs/j/logs?offset={offset}", headers=AUTH)
        assert r.status_code == 200 and r.content == b"", (offset, r.status_code, r.text[:300])
        assert r.headers["X-Ember-Offset"] == str(offset)
    assert c.get("/api/jobs/j/logs?offset=0", headers=AUTH).content == b"step 1\n"


def test_a_file_given_as_the_run_folder_is_refused_at_submit(service, tmp_path):
    """A file as the job's `out` was queued (201), then failed: 'exists and is not a folder'."""
    recipe = write_recipe(tmp_path / "allowed")
    r = client(service).post("/api/jobs", json={"recipe": str(recipe), "out": str(recipe)}, headers=AUTH)
    assert r.status_code == 400 and "exists and is not a folder" in r.json()["error"]["message"], r.text
    assert rows.all_jobs(service.con) == []


def test_a_run_folder_is_checked_again_at_requeue(service, tmp_path):
    """A job requeued after the owner narrowed [service] allowed trained in the folder a new
    submit there was refused (the recipe was checked again, the folder not)."""
    recipe = write_recipe(tmp_path / "allowed")
    other = tmp_path / "other"
    other.mkdir()
    job = finished(service, "c", "cancelled", other / "c", recipe=str(recipe))
    r = client(service).post("/api/jobs/c/requeue", headers=AUTH)
    assert r.status_code == 403 and "outside the folders the owner allowed" in r.json()["error"]["message"], r.text
    assert rows.get(service.con, job.id).state == "cancelled"


def test_a_link_put_in_place_of_a_queued_jobs_run_folder_fails_it_at_its_start(service, tmp_path):
    """A link put at the folder's path after submit sent the whole run outside every allowed
    folder. The job now fails at its start with the reason, before any process."""
    recipe = write_recipe(tmp_path / "allowed")
    other = tmp_path / "other"
    other.mkdir()
    out = tmp_path / "allowed" / "e"
    queued = rows.insert(service.con, "e", str(recipe), str(out), [], 0, {"memory": 1}, "queued")
    out.symlink_to(other)
    service.dispatch.start(queued, (0,))
    try:
        failed = rows.get(service.con, queued.id)
        assert failed.state == "failed" and failed.pid is None, failed
        assert "outside the folders the owner allowed" in failed.cause
        assert list(other.iterdir()) == []
    finally:
        service.processes.kill(rows.get(service.con, queued.id))  # before the fix: the run it started
