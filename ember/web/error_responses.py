"""HTTP errors, in one place: the one JSON shape of every error answer, and the one table from
an exception to its status, installed on ember's app (`ember serve`'s and `ember ui`'s) by
`install`; the inference worker answers in the same shape (`error_response`).

    {"error": {"message": "no job 'x'; `ember queue` lists them", "type": "not_found_error",
               "param": null, "code": 404}}

The shape is OpenAI's, which its clients parse from /v1, so /api/... and /v1/... answer alike:
`message` says what was wrong and what to do, `type` names the status's meaning, `param` is the
request field at fault (or null), `code` is the HTTP status.

    400 invalid_request_error   BadInput; a failed validation of the query, path or body (FastAPI's
                                own too: one status for a malformed request, whoever finds it);
                                another EmberError (a bad recipe); ValueError (never a conflict)
    401 authentication_error    no token, or a wrong one (ember.web.api's guard)
    403 permission_error        Refused: the owner's allowed folders, a link out of the runs folder;
                                a change from a page of another origin (ember.web.api's guard)
    404 not_found_error         NotFound; an unknown route
    405 method_not_allowed      a method the route does not take (the Allow header lists them)
    409 conflict_error          Conflict: the state forbids it now (a finished job paused, a name taken)
    413 request_too_large       a body over [service] max_body_bytes
    421 misdirected_request     a host name other than loopback's, while bound to loopback
    502 bad_gateway             the inference engine failed
    503 service_unavailable     Unavailable; inference off or loading
    500 server_error            anything else: a defect (the service's log has the traceback)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from ember.errors import BadInput, Conflict, EmberError, NotFound, Refused, Unavailable
from ember.web import security

# The first class an exception is an instance of gives its status: the subclasses before the base.
# A page (HTML) shows these as an error page with the same status (ember.web.dashboard).
STATUS: tuple[tuple[type[Exception], int], ...] = (
    (BadInput, 400), (Refused, 403), (NotFound, 404), (Conflict, 409), (Unavailable, 503),
    (EmberError, 400), (ValueError, 400))
LIBRARY = tuple(kind for kind, _ in STATUS)
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "method_not_allowed", 409: "conflict_error", 413: "request_too_large", 421: "misdirected_request",
         500: "server_error", 502: "bad_gateway", 503: "service_unavailable"}


class ErrorDetail(BaseModel):
    message: str = Field(description="what was wrong, where, and what to do")
    type: str = Field(description="the status's meaning: " + ", ".join(f"{k} {v}" for k, v in TYPES.items()))
    param: str | None = Field(None, description="the request field at fault, when one is")
    code: int = Field(description="the HTTP status")


class ErrorBody(BaseModel):
    """Every error answer's body, on /api/... and /v1/... alike."""
    error: ErrorDetail


def status_of(e: BaseException) -> int:
    """The HTTP status of an exception the library raised (the table above)."""
    return next((status for kind, status in STATUS if isinstance(e, kind)), 500)


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The one error answer: `status` and {"error": {message, type, param, code}}."""
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def invalid(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic's (and so FastAPI's) validation errors as one message and the first field at fault."""
    said, param = [], None
    for e in errors[:5]:
        loc = [str(p) for p in e.get("loc", ())]
        source = loc.pop(0) if loc and loc[0] in ("body", "query", "path", "header", "cookie") else "body"
        name = ".".join(loc)
        if e["type"] == "json_invalid":  # FastAPI puts the character's position in loc
            said.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
            continue
        param = param or name or None
        if e["type"] in ("model_type", "model_attributes_type", "dict_type") and not name:
            said.append("the body must be a JSON object")
        elif e["type"] == "extra_forbidden":
            said.append(f"'{name}': unknown field")
        else:
            got = f" (got {e['input']!r:.60})" if "input" in e and e["type"] != "missing" else ""
            said.append(f"{'' if source == 'body' else source + ' '}'{name}': {e['msg']}{got}")
    return "; ".join(said) or "the request is not valid", param


def install(app: FastAPI) -> None:
    """Answer every error `app` raises in the one shape, with the status of the table above."""

    async def library(request: Request, e: Exception) -> JSONResponse:
        return error_response(status_of(e), str(e))

    async def starlette(request: Request, e: HTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 404 and message == "Not Found":
            message = f"no route {request.url.path[:200]}; /openapi.json lists the API"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path[:200]}; " \
                      f"allowed: {(e.headers or {}).get('Allow', 'none')}"
        return error_response(e.status_code, message, headers=e.headers)

    async def validation(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = invalid(list(e.errors()))
        return error_response(400, message, param)

    async def defect(request: Request, e: Exception) -> JSONResponse:
        # Answered by Starlette's outermost middleware, which then re-raises for the server's log;
        # the guard that adds the security headers is inside it, so they are added here.
        r = error_response(500, f"internal error ({type(e).__name__}); the service's log has the traceback")
        r.headers.update(security.HEADERS)
        return r

    app.add_exception_handler(EmberError, library)
    app.add_exception_handler(ValueError, library)
    app.add_exception_handler(HTTPException, starlette)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(Exception, defect)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route documents in /openapi.json, beyond those every route has."""
    return {status: {"model": ErrorBody, "description": TYPES[status]} for status in statuses}
