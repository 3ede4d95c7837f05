"""The service's HTTP API: a thin layer over ember.sched.service.Service.

    GET  /health                      200 when inference is ready, 503 while it loads (or is off)
    GET  /api/jobs                    the queue
    POST /api/jobs                    submit {recipe, name?, priority?, out?, overrides?}   token
                                      (recipe and out: absolute paths)
    GET  /api/jobs/{job}              one job (`out`: its run folder; `run`: its run's ledger id)
    POST /api/jobs/{job}/pause        {hard?: bool}                                           token
    POST /api/jobs/{job}/resume                                                               token
    POST /api/jobs/{job}/cancel                                                               token
    POST /api/jobs/{job}/requeue      a failed or cancelled job, to resume its run             token
    POST /api/jobs/purge              {jobs?: [job], states?: [state], older_than_seconds?,    token
                                      dry_run?: bool}: remove finished jobs from the queue
                                      (never their run folders or the ledger's runs); the
                                      answer lists them: {removed: [job], dry_run}
    GET  /api/jobs/{job}/logs?offset= its output from byte `offset`
    POST /api/yield                   {seconds?: number | null, release?: bool}               token
    GET  /api/explain                 which owner rule holds each job
    GET  /api/owner                   owner.toml as the service applies it: its error, the changes
                                      that wait for a restart, in words (notes), the rules in force
    GET  /api/stats                   inference requests and pause latencies
    GET  /v1/models, POST /v1/completions, /v1/chat/completions, /v1/embeddings
                                      OpenAI-compatible inference, forwarded to the engine; any
                                      other /v1 path is answered 404 here and never forwarded

The dashboard's pages, its JSON API and /metrics are ember.web.dashboard's.

Every request but /login and /static/ needs `Authorization: Bearer TOKEN` (the token file, mode
0600, is created at the service's first start; OpenAI clients pass it as their API key) or the
dashboard's session, and a change also its CSRF value (ember.web.security). A page asked for
without either is redirected to /login. Only the owner opens reading and /v1 on loopback, with
owner.toml's `[service] open_on_loopback = true`; bound to loopback, only loopback host names are
answered. A path with a '.' or '..' segment or an encoded separator (%2F, %5C) is
refused with 400 before routing. Bad requests get a 4xx with {"error": message} and change nothing.
`ember ui` makes the app without a service: the dashboard alone, no /api/jobs and no /v1.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from ember import __version__
from ember.errors import EmberError
from ember.sched.service import Service
from ember.web import security
from ember.web.dashboard import add_dashboard
from ember.web.views import BadRequest, Views

MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
# The OpenAI routes the proxy forwards; nothing else of the engine's (docs, tokenize, slots,
# metrics, ...) is reachable through the service.
V1_ROUTES = {("GET", "models"), ("POST", "completions"), ("POST", "chat/completions"), ("POST", "embeddings")}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host", "content-length", "authorization"}


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


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
            response = error(413, f"request body over {self.limit} bytes ([service] max_body_bytes)")
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


def create_app(service: Service | None, token: str, loopback: bool, engine_url: str | None,
               ledger: Path | None = None, max_body_bytes: int = 1 << 20, open_reads: bool = False,
               engine_token: str | None = None) -> FastAPI:
    """The app; `engine_url`: where /v1 requests go (upstream or the built-in worker), or None.
    Without a service (`ember ui`): the dashboard over `ledger` alone. `open_reads` (loopback
    only: `[service] open_on_loopback`): reading and /v1 need no token. `engine_token`: the
    built-in worker's own token, sent with every request forwarded to it (the caller's is not)."""
    open_reads = open_reads and loopback
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               headers={"Authorization": f"Bearer {engine_token}"} if engine_token else None)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="ember serve" if service is not None else "ember ui", version=__version__,
                  docs_url=None, redoc_url=None, lifespan=lifespan)
    limit = service.rules.service.max_body_bytes if service is not None else max_body_bytes

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        response = await checked(request, call_next)
        response.headers.update(security.HEADERS)
        return response

    app.add_middleware(BodyLimit, limit=limit)

    async def checked(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if why := unsafe_path(request):
            return error(400, why)
        if loopback and not security.loopback_host(request):
            return error(421, "bound to loopback, this service answers only to localhost, 127.0.0.1 or [::1]")
        # Changing anything needs the token (or the dashboard's session and its CSRF value);
        # reading and inference need the token or the session, unless the owner opened them on
        # loopback. Signing in checks the token itself.
        if path == "/login" or path.startswith("/static/"):
            pass
        elif request.method in MUTATING and not path.startswith("/v1/"):
            if not security.may_change(request, token):
                return error(401, "this request needs the service's token: Authorization: Bearer "
                                  "<contents of $EMBER_HOME/serve/token> (the dashboard: sign in with the "
                                  "link `ember ui` prints)")
        elif not open_reads and not security.may_read(request, token):
            if request.method == "GET" and security.wants_page(request):
                return RedirectResponse("/login", status_code=303)
            return error(401, "this request needs the service's token: Authorization: Bearer "
                              "<contents of $EMBER_HOME/serve/token> (OpenAI clients: it is the API key; "
                              "the dashboard: sign in with the link `ember ui` prints)")
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limit):
            return error(413, f"request body over {limit} bytes ([service] max_body_bytes)")
        try:
            return await call_next(request)
        except BadRequest as e:
            return error(e.status, str(e))

    add_dashboard(app, Views(service.ledger_path if service is not None else ledger, service), token)
    if service is not None:
        add_service_routes(app, service, engine_url, client)
    return app


def add_service_routes(app: FastAPI, service: Service, engine_url: str | None, client: httpx.AsyncClient) -> None:
    """The queue's verbs and the inference endpoint."""

    async def body(request: Request) -> dict:
        raw = await request.body()  # BodyLimit stopped it at `limit`
        if not raw:
            return {}
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise BadRequest(400, "the body must be a JSON object")
        return data

    async def call(fn: Any, *args: Any) -> Any:
        """A service verb in a worker thread, its errors as 4xx."""
        try:
            return await run_in_threadpool(fn, *args)
        except LookupError as e:
            raise BadRequest(404, str(e.args[0])) from None
        except PermissionError as e:
            raise BadRequest(403, str(e)) from None
        except ValueError as e:
            raise BadRequest(409, str(e)) from None
        except EmberError as e:
            raise BadRequest(400, str(e)) from None
        except TimeoutError as e:
            raise BadRequest(504, str(e)) from None

    def field(data: dict, key: str, kind: type | tuple, default: Any = None) -> Any:
        value = data.get(key, default)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is int):
            raise BadRequest(400, f"'{key}': expected {getattr(kind, '__name__', kind)}, got {value!r}")
        return value

    @app.get("/api/jobs")
    async def jobs() -> Any:
        return [asdict(v) for v in await call(service.queue)]

    @app.post("/api/jobs", status_code=201)
    async def submit(request: Request) -> Any:
        data = await body(request)
        unknown = set(data) - {"recipe", "name", "priority", "out", "overrides"}
        if unknown:
            raise BadRequest(400, f"unknown field(s) {sorted(unknown)}")
        recipe = field(data, "recipe", str)
        if not recipe:
            raise BadRequest(400, "'recipe': a recipe path is required")
        overrides = field(data, "overrides", list, [])
        if not all(isinstance(x, str) for x in overrides):
            raise BadRequest(400, "'overrides': a list of 'section.key=value' strings")
        name, priority, out = field(data, "name", str), field(data, "priority", int, 0), field(data, "out", str)
        for key, path in (("recipe", recipe), ("out", out)):
            if path is not None and not Path(path).expanduser().is_absolute():
                raise BadRequest(400, f"'{key}': {path!r} is relative, and the service cannot know the folder "
                                      f"it is relative to; send an absolute path (`ember submit` resolves "
                                      f"it against the folder you run it in)")
        job = await call(service.submit, recipe, name, priority, out, overrides)
        return JSONResponse(asdict(service.view(job)), status_code=201)

    @app.get("/api/jobs/{ref}")
    async def one(ref: str) -> Any:
        job = await call(service.find, ref)
        return asdict(service.view(job))

    @app.post("/api/jobs/{ref}/pause")
    async def pause(ref: str, request: Request) -> Any:
        hard = field(await body(request), "hard", bool, False)
        return asdict(service.view(await call(service.pause, ref, hard)))

    @app.post("/api/jobs/{ref}/resume")
    async def resume(ref: str) -> Any:
        return asdict(service.view(await call(service.resume, ref)))

    @app.post("/api/jobs/{ref}/cancel")
    async def cancel(ref: str) -> Any:
        return asdict(service.view(await call(service.cancel, ref)))

    @app.post("/api/jobs/{ref}/requeue")
    async def requeue(ref: str) -> Any:
        return asdict(service.view(await call(service.requeue, ref)))

    @app.post("/api/jobs/purge")
    async def purge(request: Request) -> Any:
        data = await body(request)
        unknown = set(data) - {"jobs", "states", "older_than_seconds", "dry_run"}
        if unknown:
            raise BadRequest(400, f"unknown field(s) {sorted(unknown)}")
        refs, states = field(data, "jobs", list, []), field(data, "states", list)
        if not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in refs):
            raise BadRequest(400, "'jobs': a list of job names or ids")
        if states is not None and not all(isinstance(x, str) for x in states):
            raise BadRequest(400, "'states': a list of 'completed', 'failed', 'cancelled'")
        older = field(data, "older_than_seconds", (int, float))
        dry_run = field(data, "dry_run", bool, False)
        removed = await call(service.purge, [str(r) for r in refs], states, older, dry_run)
        return {"removed": [asdict(v) for v in removed], "dry_run": dry_run}

    @app.get("/api/jobs/{ref}/logs")
    async def logs(ref: str, offset: int = 0) -> Any:
        data, end = await call(service.logs, ref, offset)
        return Response(data, media_type="text/plain", headers={"X-Ember-Offset": str(end)})

    @app.post("/api/yield")
    async def yield_(request: Request) -> Any:
        data = await body(request)
        if field(data, "release", bool, False):
            await call(service.release_yield)
            return {"released": True}
        seconds = field(data, "seconds", (int, float))
        if seconds is not None and not 0 < seconds <= 7 * 86400:
            raise BadRequest(400, "'seconds': between 0 and a week (604800), or null for until released")
        return await call(service.yield_devices, seconds)

    @app.get("/api/explain")
    async def explain() -> Any:
        return await call(service.explain)

    @app.get("/api/owner")
    async def owner_rules() -> Any:
        return await call(service.owner_status)

    @app.get("/api/stats")
    async def stats() -> Any:
        return {"inference": service.gate.stats(), "engine": engine_url}

    @app.get("/health")
    async def health() -> Any:
        if engine_url is None:
            return error(503, "inference is off ([inference] enabled = false)")
        for path in ("/health", "/v1/models"):
            try:
                r = await client.get(engine_url + path, timeout=5.0)
            except httpx.HTTPError as e:
                return error(503, f"the inference engine at {engine_url} does not answer: {e}")
            if r.status_code == 200:
                return {"status": "ok", "engine": engine_url}
            if r.status_code != 404:
                return error(503, f"the inference engine is loading ({r.status_code})")
        return error(503, "the inference engine is not ready")

    # The OpenAI-compatible API is forwarded as it is: its own documents describe it.
    @app.api_route("/v1/{path:path}", methods=["GET", "POST"], include_in_schema=False)
    async def v1(path: str, request: Request) -> Response:
        if (request.method, path) not in V1_ROUTES:
            return error(404, f"{request.method} /v1/{path[:200]}: not an inference route; the service "
                              f"forwards {', '.join(f'{m} /v1/{p}' for m, p in sorted(V1_ROUTES))}")
        if engine_url is None:
            return error(503, "inference is off ([inference] enabled = false)")
        raw = await request.body()  # BodyLimit stopped it at `limit`
        if request.method == "POST":  # ember is the front door: a malformed body stops here, not upstream
            try:
                parsed = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                return error(400, f"the body is not valid JSON: {e}")
            if not isinstance(parsed, dict):
                return error(400, "the body must be a JSON object")
            if why := await run_in_threadpool(service.adapter_elsewhere, parsed.get("model")):
                return error(404, why)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        await run_in_threadpool(service.inference_begin)
        try:
            upstream = await client.send(client.build_request(request.method, f"{engine_url}/v1/{path}",
                                                              content=raw, headers=headers,
                                                              params=request.query_params), stream=True)
        except httpx.HTTPError as e:
            service.inference_end()
            return error(502, f"the inference engine at {engine_url} failed: {e}")

        async def done() -> None:
            await upstream.aclose()
            service.inference_end()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=out_headers,
                                 background=BackgroundTask(done))
