"""Who may do what over HTTP, and the headers every answer carries.

    Authorization: Bearer TOKEN     the commands (ember submit, pause, ...) and scripts
    the dashboard's session         GET /login?token=TOKEN (the link `ember ui` prints) sets an
                                    HttpOnly, SameSite=Strict cookie; pages then carry a CSRF
                                    value that the dashboard's scripts send back in X-Ember-CSRF.
                                    A change needs both: a page of another site can send neither
                                    (the cookie stays home, the header needs CORS, which is off)
    Host                            bound to loopback, only loopback names are answered (a DNS
                                    rebinding page cannot read the dashboard under its own name)
    Sec-Fetch-Site, Origin          a change a browser says comes from a page of another origin is
                                    refused, whatever it carries: a page of any site can make the
                                    browser POST a body (a form, fetch in no-cors mode) to
                                    127.0.0.1, with no credential where the owner opened /v1 on
                                    loopback, and with the session cookie from a page of the same
                                    site (another port of localhost: SameSite does not count ports)

Reading needs the token or the session too, on every interface, unless the owner set
`[service] open_on_loopback = true` (ember.sched.owner_rules).

The cookie and the CSRF value are HMACs of the token, so they change when the token does and
nothing more is stored. Every answer carries a Content-Security-Policy that allows scripts, styles
and connections from the dashboard itself only: no inline script, no CDN.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from urllib.parse import urlsplit

from starlette.requests import Request

SESSION_COOKIE = "ember_session"
WORKER_TOKEN_ENV = "EMBER_WORKER_TOKEN"  # the built-in inference worker's token, from the service
CSRF_HEADER = "x-ember-csrf"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cross-Origin-Opener-Policy": "same-origin",
           "Cross-Origin-Resource-Policy": "same-origin"}


def _mac(token: str, purpose: str) -> str:
    return hmac.new(token.encode(), purpose.encode(), hashlib.sha256).hexdigest()


def session_value(token: str) -> str:
    return _mac(token, "ember dashboard session")


def csrf_value(token: str) -> str:
    return _mac(token, "ember dashboard csrf")


def _equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer_ok(request: Request, token: str) -> bool:
    return _equal(request.headers.get("authorization"), f"Bearer {token}")


def session_ok(request: Request, token: str) -> bool:
    return _equal(request.cookies.get(SESSION_COOKIE), session_value(token))


def csrf_ok(request: Request, token: str) -> bool:
    return _equal(request.headers.get(CSRF_HEADER), csrf_value(token))


def may_change(request: Request, token: str) -> bool:
    """A request that changes something: the token, or the dashboard's session with its CSRF value."""
    return bearer_ok(request, token) or (session_ok(request, token) and csrf_ok(request, token))


def may_read(request: Request, token: str) -> bool:
    """Reading (pages, /api GETs, /metrics) and inference: the token or the session."""
    return bearer_ok(request, token) or session_ok(request, token)


def from_another_origin(request: Request) -> bool:
    """Whether a browser says `request` comes from a page of another origin than the service's:
    Sec-Fetch-Site (every current browser sends it), else an Origin naming another host. Programs
    (the commands, OpenAI clients, curl) send neither."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site not in ("same-origin", "none")  # "none": the user's own action, no page behind it
    origin = request.headers.get("origin")
    return origin is not None and urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower()


def wants_page(request: Request) -> bool:
    """A browser asking for a page (it is sent to sign in), not a script asking for data."""
    return "text/html" in request.headers.get("accept", "")


def loopback_host(request: Request) -> bool:
    """Whether the Host header names this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    host = request.headers.get("host", "")
    name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 \
        else host
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
