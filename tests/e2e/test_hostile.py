"""Hostile input against a real `ember serve` (issue 24): 600 requests, seeded, mixing paths
(dot segments, encoded separators, NUL, long and non-ASCII names), methods, bodies (malformed,
deeply nested, wrong types, escaping names and folders), encodings and tokens (none, wrong,
malformed, right), over raw HTTP so that nothing normalises them on the way. No answer is a 5xx
(but the 503 of /v1 and /health while inference is off, which says so);
nothing without the token is answered with data; nothing is written outside the service's
folders; the service's memory stays bounded; and it still answers properly afterwards."""

from __future__ import annotations

import collections
import json
import os
import random
import socket
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from tests.helpers import write_recipe
from tests.serve_harness import Serve

pytestmark = pytest.mark.e2e

REQUESTS = 600
OWNER = """
[service]
allowed = ["{allowed}"]
[inference]
enabled = false
"""

PATHS = [
    "/api/jobs", "/api/jobs/1", "/api/jobs/1/pause", "/api/jobs/1/resume", "/api/jobs/1/cancel",
    "/api/jobs/1/logs?offset=-5", "/api/jobs/1/logs?offset=99999999999999999999999", "/api/jobs/%00",
    "/api/jobs/../../../etc/passwd", "/api/jobs/..%2F..%2Fetc%2Fpasswd", "/api/jobs/%2e%2e/%2e%2e/token",
    "/api/yield", "/api/explain", "/api/stats", "/api/runs", "/api/runs/" + "A" * 5000,
    "/api/runs/%2e%2e%2f%2e%2e%2fserve%2ftoken", "/api/plan?run=../../etc/passwd", "/api/plan?job=%00",
    "/api/machine?since=-1e309", "/api/capacity?since=nan", "/v1/models", "/v1/completions",
    "/v1/..%2F..%2Fsecret", "/v1/%2e%2e/docs", "/v1/tokenize", "/v1/slots/0?action=save",
    "/static/../../ember/web/api.py", "/static/%2e%2e%2f%2e%2e%2fserve%2ftoken", "/static/ember.css",
    "/static/" + "x" * 3000, "/runs", "/runs/\u00e9\u202e", "/queue", "/plan?device_memory=-1",
    "/machine", "/login?token=" + "t" * 10000, "/login", "/metrics", "/openapi.json", "/health",
    "//etc/passwd", "/%00", "/.%2e/.%2e/serve/token", "/api/jobs?" + "&".join(f"k{i}=v" for i in range(500)),
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


def bodies(allowed: Path, recipe: Path) -> list[bytes]:
    names = ["../../escaped", "a" * 5000, "\u202eevil", "con", ".hidden", "x/y", "ok-name", "", " ", "\x00"]
    outs = ["/tmp/escaped-out", str(allowed / ".." / "escaped"), "../../escaped", str(allowed / "runs" / "ok")]
    jsons = [{"recipe": str(recipe), "name": n} for n in names]
    jsons += [{"recipe": str(recipe), "out": o, "name": "n"} for o in outs]
    jsons += [{"recipe": "/etc/passwd"}, {"recipe": str(allowed / ".." / "x.toml")}, {"recipe": 5},
              {"recipe": str(recipe), "priority": 1e308}, {"recipe": str(recipe), "priority": "high"},
              {"recipe": str(recipe), "overrides": ["--evil", "train.max_steps=1e9", "a" * 3000]},
              {"seconds": -1}, {"seconds": float("inf")}, {"seconds": "1h"}, {"hard": "yes"},
              {"release": 1}, {"model": "../../x", "prompt": "hi"}, {"messages": [{"role": "bot"}]}]
    raw = [json.dumps(j, allow_nan=True).encode() for j in jsons]
    raw += [b"", b"{", b"[]", b"null", b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000,
            b'{"recipe": ' * 50_000 + b"1" + b"}" * 50_000, b"x" * (2 << 20), "{\"name\": \"\u00e9\"}".encode("latin-1")]
    return raw


def send(host: str, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """One request as raw bytes (UTF-8 path, Latin-1 headers, nothing normalised); the status, or
    0 when the server closed the connection without answering (h11 refusing the request line)."""
    name, port = host.rsplit(":", 1)
    head = f"{method} ".encode() + path.encode() + b" HTTP/1.1\r\n"
    for k, v in {**headers, "Connection": "close", "Content-Length": str(len(body))}.items():
        head += k.encode() + b": " + v.encode("latin-1", "replace") + b"\r\n"
    with socket.create_connection((name, int(port)), timeout=60) as sock:
        try:
            sock.sendall(head + b"\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):  # refused before the body was read
            pass
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    if not data.startswith(b"HTTP/1.1 "):
        return 0, data
    return int(data.split(b" ", 2)[1]), data


def test_six_hundred_hostile_requests_get_no_server_error_and_escape_nothing(tmp_path):
    allowed = tmp_path / "allowed"
    recipe = write_recipe(allowed / "project")
    s = Serve(tmp_path / "home", OWNER.format(allowed=allowed)).start()
    before_files = {p for p in tmp_path.rglob("*") if s.home not in p.parents and allowed not in p.parents}
    try:
        assert s.cli("yield", "--for", "1h").returncode == 0  # nothing a request queues may train
        service = psutil.Process(s.proc.pid)
        rss_before = service.memory_info().rss
        host = urlsplit(s.url).netloc
        rng = random.Random(24)
        auths = [None, "Bearer wrong", "Basic " + "a" * 20, "Bearer " + "x" * 10_000, f"Bearer {s.token}",
                 f"bearer {s.token}", f"Bearer {s.token} ", f"Bearer {s.token}"]
        hosts = [host, host, host, "evil.example", "127.0.0.1.evil.example", ""]
        kinds = ["application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
        all_bodies = bodies(allowed, recipe)
        answers: list[tuple[int, str, str, bool]] = []
        for _ in range(REQUESTS):
            method, path = rng.choice(METHODS), rng.choice(PATHS)
            auth, body = rng.choice(auths), rng.choice(all_bodies) if rng.random() < 0.7 else b""
            headers = {"Host": rng.choice(hosts), "Content-Type": rng.choice(kinds)}
            if auth is not None:
                headers["Authorization"] = auth
            status, data = send(host, method, path, headers, body)
            # (a header's trailing space is not part of its value: "Bearer TOKEN " is the token)
            answers.append((status, method, path[:80], (auth or "").rstrip() == f"Bearer {s.token}"))
            # 503 is the one 5xx by design: /v1 and /health while inference is off (as here).
            off = status == 503 and path.startswith(("/v1/", "/health")) and b"inference is off" in data
            assert status < 500 or off, (method, path[:200], headers.get("Authorization", "")[:40], body[:200],
                                         status, data[:500])
        print("answers by status:", sorted(collections.Counter(st for st, *_ in answers).items()))
        # Without the token (or with a mangled one) nothing but signing in and the static files
        # answers with data.
        leaked = [(st, m, p) for st, m, p, ok in answers
                  if not ok and st < 300 and not p.startswith(("/login", "/static/"))]
        assert not leaked, leaked[:20]
        # Nothing written outside the service's folder and the allowed one.
        after_files = {p for p in tmp_path.rglob("*") if s.home not in p.parents and allowed not in p.parents}
        assert after_files - before_files <= {s.home, allowed}, sorted(map(str, after_files - before_files))[:20]
        assert not Path("/tmp/escaped-out").exists() and not (tmp_path / "escaped").exists()
        for job in s.api("GET", "/api/jobs").json():  # whatever was queued lies inside an allowed root
            out = Path(job["out"]).resolve()
            assert allowed.resolve() in out.parents or (s.home / "runs").resolve() in out.parents, job
        grown = (service.memory_info().rss - rss_before) / 2**20
        assert grown < 50, f"the service grew by {grown:.0f} MiB over {REQUESTS} hostile requests"
        assert s.api("GET", "/api/jobs").status_code == 200 and s.cli("queue").returncode == 0  # still well
        assert sum(1 for st, *_ in answers if st < 300) > 0 and len(answers) == REQUESTS
    finally:
        s.stop()
        for p in (Path("/tmp/escaped-out"),):
            if p.exists() and not os.listdir(p):
                p.rmdir()
