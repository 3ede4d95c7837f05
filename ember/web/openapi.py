"""/openapi.json: FastAPI's document of the routes, completed with what it cannot see from them:
who may call (ember.web.security: the token, or the dashboard's session and, for a change, its
CSRF value) and the one error shape of every error answer (ember.web.error_responses), in place of
FastAPI's 422 that this API never answers. The document itself needs the token, as every route."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ember.web import security
from ember.web.error_responses import TYPES, ErrorBody

MUTATING = {"post", "put", "patch", "delete"}
ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
SCHEMES = {
    "token": {"type": "http", "scheme": "bearer",
              "description": "the service's token: the contents of $EMBER_HOME/serve/token (mode 0600, made at "
                             "the service's first start); OpenAI clients pass it as their API key"},
    "session": {"type": "apiKey", "in": "cookie", "name": security.SESSION_COOKIE,
                "description": "the dashboard's session, set by GET /login?token=TOKEN (the link `ember ui` prints)"},
    "csrf": {"type": "apiKey", "in": "header", "name": "X-Ember-CSRF",
             "description": "with the session, a change also needs the CSRF value the dashboard's pages carry"},
}
# The error answers every operation may give, and why.
COMMON = {400: "the request is malformed: a path with a '.' or '..' segment or an encoded separator, a "
               "query or body the route does not take, a value out of range",
          401: "no token or session, or a wrong one (a change with the session alone: no CSRF value)",
          421: "bound to loopback, the service answers only to localhost, 127.0.0.1 or [::1]"}
DESCRIPTION = """Every error answer, on /api/... and /v1/... alike, is
`{"error": {"message", "type", "param", "code"}}` (the ErrorBody schema; OpenAI's shape) with
`code` the HTTP status: 400 a malformed request, 401 no token, 403 refused by the owner's rules
(or a change a browser says comes from a page of another origin),
404 not found, 409 a state that forbids it now, 413 a body over the limit, 503 not available yet.
Every request needs the token (`Authorization: Bearer`) or the dashboard's session; a change
(POST) with the session needs its CSRF value too. The OpenAI-compatible /v1 routes (GET /v1/models,
POST /v1/completions, /v1/chat/completions, /v1/embeddings) are forwarded to the inference engine
and described by OpenAI's own document."""


def document(app: FastAPI, open_reads: bool) -> None:
    """Have `app` serve the completed document at /openapi.json (built once, as FastAPI does).
    `open_reads`: the owner opened reading on loopback, so reading needs no token."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes)
            app.openapi_schema = complete(spec, open_reads)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def complete(spec: dict[str, Any], open_reads: bool) -> dict[str, Any]:
    """`spec` with the security schemes, each operation's security and its error answers."""
    components = spec.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    error = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error.pop("$defs", {}))
    schemas["ErrorBody"] = error
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    components["securitySchemes"] = SCHEMES
    read = [{"token": []}, {"session": []}] + ([{}] if open_reads else [])
    for path, operations in spec.get("paths", {}).items():
        for method, op in operations.items():
            answers = op.setdefault("responses", {})
            answers.pop("422", None)
            statuses = dict(COMMON)
            if "{" in path:
                statuses[404] = "nothing has the name the path gives"
            if method in MUTATING:
                statuses[413] = "a body over [service] max_body_bytes"
            for status, why in statuses.items():
                answers.setdefault(str(status), {"description": f"{TYPES[status]}: {why}",
                                                 "content": {"application/json": {"schema": ERROR_REF}}})
            op["security"] = [{"token": []}, {"session": [], "csrf": []}] if method in MUTATING else read
    return spec
