"""What every request passes before it is routed (ember serve's and ember ui's app), in order:

    path        a '.' or '..' segment or an encoded separator (%2F, %5C): 400
    host        bound to loopback, a host name other than loopback's: 421 (DNS rebinding)
    origin      a change (POST, /v1 and /login included) that a browser says comes from a page of
                another origin: 403, whatever credential it carries (ember.web.security)
    who         a change (POST, but /v1) needs the token, or the dashboard's session and its CSRF
                value; reading and /v1 need the token or the session, unless the owner opened
                them on loopback (`[service] open_on_loopback`): 401, or a browser asking for a
                page is sent to /login (303). /login and /static/ are open: signing in checks
                the token itself
    size        a Content-Length over [service] max_body_bytes: 413; a body with none (chunked) is
                stopped at the limit as it is read (`BodyLimit`)

`refusal` is the one decision, request -> the error answer or None; ember.web.security says what
the token, the session and the CSRF value are.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import RedirectResponse, Response
from starlette.requests import Request

from ember.web import security
from ember.web.error_responses import error_response
from ember.paths import ascii_digits

MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
NEEDS_TOKEN = "this request needs the service's token: Authorization: Bearer <contents of $EMBER_HOME/serve/token>"
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="ember"'}


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Stops reading a request body past `limit` bytes, however it is framed (a chunked body has
    no Content-Length to refuse it by) and answers 413; the rest of the body is never read, so
    memory stays bounded."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen, started = 0, False

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge()
            return message

        async def watched(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, limited, watched)
        except* BodyTooLarge:  # raised in the route's read; middlewares' task groups wrap it
            if started:
                raise
            response = error_response(413, f"request body over {self.limit} bytes ([service] max_body_bytes)")
            response.headers.update(security.HEADERS)
            await response(scope, receive, send)


def unsafe_path(request: Request) -> str | None:
    """Why a request's path is refused before routing: a dot segment or an encoded separator,
    which a proxy or a file lookup behind the route could resolve to somewhere else."""
    raw = request.scope.get("raw_path", b"").decode("latin-1").split("?", 1)[0].lower()
    if "%2f" in raw or "%5c" in raw:
        return "the path has an encoded separator (%2F or %5C); write paths plainly"
    if any(seg in (".", "..") for seg in request.url.path.split("/")):
        return "the path has a '.' or '..' segment; write paths plainly"
    return None


def refusal(request: Request, token: str, loopback: bool, open_reads: bool, limit: int) -> Response | None:
    """The answer that refuses `request` before routing (the module docstring's order), or None to route it."""
    path = request.url.path
    if why := unsafe_path(request):
        return error_response(400, why)
    if loopback and not security.loopback_host(request):
        return error_response(421, "bound to loopback, this service answers only to localhost, 127.0.0.1 "
                                   "or [::1]")
    if request.method in MUTATING and security.from_another_origin(request):
        said = request.headers.get("origin") or f"Sec-Fetch-Site: {request.headers.get('sec-fetch-site')}"
        return error_response(403, f"a change from a page of another origin ({said[:200]}) is refused: "
                                   f"changes and inference come from the dashboard itself or from programs")
    # Changing anything needs the token (or the dashboard's session and its CSRF value);
    # reading and inference need the token or the session, unless the owner opened them on
    # loopback. Signing in checks the token itself.
    if path == "/login" or path.startswith("/static/"):
        pass
    elif request.method in MUTATING and not path.startswith("/v1/"):
        if not security.may_change(request, token):
            return error_response(401, f"{NEEDS_TOKEN} (the dashboard: sign in with the link `ember ui` "
                                       f"prints)", headers=CHALLENGE)
    elif not open_reads and not security.may_read(request, token):
        if request.method == "GET" and security.wants_page(request):
            return RedirectResponse("/login", status_code=303)
        return error_response(401, f"{NEEDS_TOKEN} (OpenAI clients: it is the API key; the dashboard: "
                                   f"sign in with the link `ember ui` prints)", headers=CHALLENGE)
    size = request.headers.get("content-length")
    if size is not None and (not ascii_digits(size) or int(size) > limit):
        return error_response(413, f"request body over {limit} bytes ([service] max_body_bytes)")
    return None
