"""The app's shape: each route one module-level handler, mounted from the plain lists of
ember.web.dashboard and ember.web.api; and the guard's decision before routing
(ember.web.guard.refusal), request by request."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from starlette.requests import Request

from ember.events import Events
from ember.sched.owner_rules import OwnerRules
from ember.sched.service import Service
from ember.web import api, dashboard
from ember.web.api import create_app
from ember.web.guard import refusal
from ember.web.security import csrf_value, session_value

TOKEN = "s3cret-token"
LIMIT = 1000


@pytest.fixture
def service(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    return Service(OwnerRules(), "sim:1x1GiB", Events(), tmp_path / "ledger.db")


def test_each_route_is_a_module_level_handler_mounted_from_a_plain_list(service, tmp_path):
    app = create_app(service, TOKEN, True, None)
    mounted = [r for r in app.routes if isinstance(r, APIRoute)]
    assert mounted == dashboard.ROUTES + api.ROUTES
    assert all("<locals>" not in r.endpoint.__qualname__ for r in mounted), \
        [r.endpoint.__qualname__ for r in mounted if "<locals>" in r.endpoint.__qualname__]
    assert app.state.backend.service is service and app.state.dashboard.views.service is service
    ui = create_app(None, TOKEN, True, None, tmp_path / "ui-ledger.db")  # `ember ui`: no queue, no /v1
    assert [r for r in ui.routes if isinstance(r, APIRoute)] == dashboard.ROUTES
    assert not hasattr(ui.state, "backend")


def request(method: str = "GET", path: str = "/api/jobs", host: str = "127.0.0.1:8765", raw: str | None = None,
            **headers: str) -> Request:
    pairs = [(b"host", host.encode())] + [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": method, "path": path, "raw_path": (raw or path).encode(),
                    "query_string": b"", "headers": pairs, "scheme": "http"})


BEARER = {"authorization": f"Bearer {TOKEN}"}
SESSION = {"cookie": f"ember_session={session_value(TOKEN)}"}


@pytest.mark.parametrize("asked, loopback, open_reads, status", [
    (request(**BEARER), True, False, None),
    (request(path="/api/runs/../jobs", **BEARER), True, False, 400),              # a dot segment
    (request(path="/static/a/b", raw="/static/a%2Fb", **BEARER), True, False, 400),  # an encoded separator
    (request(host="evil.example:8765", **BEARER), True, False, 421),             # DNS rebinding
    (request(host="evil.example:8765", **BEARER), False, False, None),           # not bound to loopback
    (request(), True, False, 401),
    (request(accept="text/html"), True, False, 303),                             # a browser: sign in
    (request(), True, True, None),                                               # the owner opened reading
    (request("POST"), True, True, 401),                                          # never a change
    (request("POST", **SESSION), True, False, 401),                              # the session alone: no CSRF
    (request("POST", **SESSION, x_ember_csrf=csrf_value(TOKEN)), True, False, None),
    (request("POST", "/v1/completions"), True, True, None),                      # inference is a read
    # A page of another origin can make the browser POST a body (a form, fetch in no-cors mode):
    (request("POST", "/v1/completions", origin="https://evil.example", sec_fetch_site="cross-site"),
     True, True, 403),                                                           # any site, /v1 opened
    (request("POST", "/v1/completions", origin="http://127.0.0.1:3000", sec_fetch_site="same-site", **SESSION),
     True, False, 403),                                                          # another port: the cookie goes
    (request("POST", "/v1/completions", origin="http://127.0.0.1:3000", **SESSION), True, False, 403),  # no Sec-Fetch
    (request("POST", **SESSION, x_ember_csrf=csrf_value(TOKEN), origin="http://127.0.0.1:8765",
             sec_fetch_site="same-origin"), True, False, None),                  # the dashboard's own
    (request("POST", **SESSION, x_ember_csrf=csrf_value(TOKEN), origin="http://127.0.0.1:8765"), True, False, None),
    (request("GET", "/login"), True, False, None),
    (request("GET", "/static/ember.css"), True, False, None),
    (request("POST", content_length=str(LIMIT + 1), **BEARER), True, False, 413),
    (request("POST", content_length="12x", **BEARER), True, False, 413),
])
def test_the_guard_refuses_before_routing(asked, loopback, open_reads, status):
    answer = refusal(asked, TOKEN, loopback, open_reads, LIMIT)
    assert (answer and answer.status_code) == status
    if status == 401:
        assert answer.headers["www-authenticate"] == 'Bearer realm="ember"'
    if status == 303:
        assert answer.headers["location"] == "/login"
