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
refused with 400 before routing. Bad requests get a 4xx and change nothing; every error answer,
here, from the dashboard's routes and from /v1, has the one shape of ember.web.error_responses, which maps
the library's errors to statuses. /openapi.json (ember.web.openapi) documents the bodies, the
token and the errors.
`ember ui` makes the app without a service: the dashboard alone, no /api/jobs and no /v1.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from ember import __version__
from ember.errors import BadInput
from ember.paths import NAME_GRAMMAR
from ember.sched.service import Service
from ember.web import error_responses as errors, security
from ember.web.dashboard import add_dashboard
from ember.web.error_responses import error_response, responses
from ember.web.openapi import document
from ember.web.views import Views

MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
# The OpenAI routes the proxy forwards; nothing else of the engine's (docs, tokenize, slots,
# metrics, ...) is reachable through the service.
V1_ROUTES = {("GET", "models"), ("POST", "completions"), ("POST", "chat/completions"), ("POST", "embeddings")}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host", "content-length", "authorization"}
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
    errors.install(app)
    document(app, open_reads)
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
            return error_response(400, why)
        if loopback and not security.loopback_host(request):
            return error_response(421, "bound to loopback, this service answers only to localhost, 127.0.0.1 "
                                       "or [::1]")
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
        if size is not None and (not size.isdigit() or int(size) > limit):
            return error_response(413, f"request body over {limit} bytes ([service] max_body_bytes)")
        return await call_next(request)

    add_dashboard(app, Views(service.ledger_path if service is not None else ledger, service), token)
    if service is not None:
        add_service_routes(app, service, engine_url, client)
    return app


class SubmitBody(BaseModel):
    """POST /api/jobs: a recipe to queue (what `ember submit` sends)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    recipe: str = Field(min_length=1, description="the recipe's path, under a folder of [service] allowed")
    name: str | None = Field(None, description=f"the job's name, {NAME_GRAMMAR} (default RECIPE-ID)")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first and may preempt lower")
    out: str | None = Field(None, description="the run folder, under [service] allowed (default "
                                              "$EMBER_HOME/runs/NAME)")
    overrides: list[str] = Field(default_factory=list, description="'section.key=value' strings, as --set")


class PauseBody(BaseModel):
    """POST /api/jobs/{ref}/pause (no body: a soft pause)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    hard: bool = Field(False, description="checkpoint and exit, freeing the device, instead of pausing at the "
                                          "next step; stays queued until resumed")


class YieldBody(BaseModel):
    """POST /api/yield (no body: until released)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    seconds: float | None = Field(None, gt=0, le=7 * 86400, description="hold all training this long; null: until "
                                                                        "released")
    release: bool = Field(False, description="end a yield now (`seconds` is then not read)")


class PurgeBody(BaseModel):
    """POST /api/jobs/purge (no body: every finished job)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    jobs: list[str | int] = Field(default_factory=list, description="these finished jobs (names or ids); "
                                                                   "empty: every finished job")
    states: list[Literal["completed", "failed", "cancelled"]] | None = Field(
        None, description="only jobs that ended so (default: all three)")
    older_than_seconds: float | None = Field(None, ge=0, description="only jobs that ended this long ago or more")
    dry_run: bool = Field(False, description="say what would be removed, remove nothing")


def body_of(model: type[BaseModel], required: bool) -> dict[str, Any]:
    """The requestBody of a route that reads `model` itself (any content type, as curl sends it)."""
    return {"requestBody": {"required": required, "content": {"application/json": {
        "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


def add_service_routes(app: FastAPI, service: Service, engine_url: str | None, client: httpx.AsyncClient) -> None:
    """The queue's verbs and the inference endpoint. The service's errors say their meaning
    (ember.errors): ember.web.error_responses answers them."""

    async def read(request: Request, model: type[BaseModel]) -> Any:
        """The body as `model`; an empty body is {}. Any content type is read as JSON."""
        raw = await request.body()  # BodyLimit stopped it at `limit`
        try:
            return model.model_validate_json(raw if raw.strip() else b"{}")
        except ValidationError as e:  # answered 400 with FastAPI's own validation errors
            raise RequestValidationError(e.errors()) from None

    @app.get("/api/jobs")
    async def jobs() -> Any:
        return [asdict(v) for v in await run_in_threadpool(service.queue)]

    @app.post("/api/jobs", status_code=201, openapi_extra=body_of(SubmitBody, True), responses=responses(403, 409))
    async def submit(request: Request) -> Any:
        data = await read(request, SubmitBody)
        for key, path in (("recipe", data.recipe), ("out", data.out)):
            if path is not None and not Path(path).expanduser().is_absolute():
                raise BadInput(f"'{key}': {path!r} is relative, and the service cannot know the folder it is "
                               f"relative to; send an absolute path (`ember submit` resolves it against the "
                               f"folder you run it in)")
        job = await run_in_threadpool(service.submit, data.recipe, data.name, data.priority, data.out, data.overrides)
        return JSONResponse(asdict(service.view(job)), status_code=201)

    @app.get("/api/jobs/{ref}")
    async def one(ref: str) -> Any:
        job = await run_in_threadpool(service.find, ref)
        return asdict(service.view(job))

    @app.post("/api/jobs/{ref}/pause", openapi_extra=body_of(PauseBody, False), responses=responses(409))
    async def pause(ref: str, request: Request) -> Any:
        hard = (await read(request, PauseBody)).hard
        return asdict(service.view(await run_in_threadpool(service.pause, ref, hard)))

    @app.post("/api/jobs/{ref}/resume", responses=responses(409))
    async def resume(ref: str) -> Any:
        return asdict(service.view(await run_in_threadpool(service.resume, ref)))

    @app.post("/api/jobs/{ref}/cancel", responses=responses(409))
    async def cancel(ref: str) -> Any:
        return asdict(service.view(await run_in_threadpool(service.cancel, ref)))

    @app.post("/api/jobs/{ref}/requeue", responses=responses(409))
    async def requeue(ref: str) -> Any:
        return asdict(service.view(await run_in_threadpool(service.requeue, ref)))

    @app.post("/api/jobs/purge", openapi_extra=body_of(PurgeBody, False), responses=responses(409))
    async def purge(request: Request) -> Any:
        data = await read(request, PurgeBody)
        removed = await run_in_threadpool(service.purge, [str(r) for r in data.jobs], data.states,
                                          data.older_than_seconds, data.dry_run)
        return {"removed": [asdict(v) for v in removed], "dry_run": data.dry_run}

    @app.get("/api/jobs/{ref}/logs")
    async def logs(ref: str, offset: int = 0) -> Any:
        data, end = await run_in_threadpool(service.logs, ref, offset)
        return Response(data, media_type="text/plain", headers={"X-Ember-Offset": str(end)})

    @app.post("/api/yield", openapi_extra=body_of(YieldBody, False), responses=responses(503))
    async def yield_(request: Request) -> Any:
        data = await read(request, YieldBody)
        if data.release:
            await run_in_threadpool(service.release_yield)
            return {"released": True}
        return await run_in_threadpool(service.yield_devices, data.seconds)

    @app.get("/api/explain")
    async def explain() -> Any:
        return await run_in_threadpool(service.explain)

    @app.get("/api/owner")
    async def owner_rules() -> Any:
        return await run_in_threadpool(service.owner_status)

    @app.get("/api/stats")
    async def stats() -> Any:
        return {"inference": service.gate.stats(), "engine": engine_url}

    @app.get("/health", responses=responses(503))
    async def health() -> Any:
        if engine_url is None:
            return error_response(503, "inference is off ([inference] enabled = false)")
        for path in ("/health", "/v1/models"):
            try:
                r = await client.get(engine_url + path, timeout=5.0)
            except httpx.HTTPError as e:
                return error_response(503, f"the inference engine at {engine_url} does not answer: {e}")
            if r.status_code == 200:
                return {"status": "ok", "engine": engine_url}
            if r.status_code != 404:
                return error_response(503, f"the inference engine is loading ({r.status_code})")
        return error_response(503, "the inference engine is not ready")

    # The OpenAI-compatible API is forwarded as it is: its own documents describe it.
    @app.api_route("/v1/{path:path}", methods=["GET", "POST"], include_in_schema=False)
    async def v1(path: str, request: Request) -> Response:
        if (request.method, path) not in V1_ROUTES:
            return error_response(404, f"{request.method} /v1/{path[:200]}: not an inference route; the "
                                       f"service forwards {', '.join(f'{m} /v1/{p}' for m, p in sorted(V1_ROUTES))}")
        if engine_url is None:
            return error_response(503, "inference is off ([inference] enabled = false)")
        raw = await request.body()  # BodyLimit stopped it at `limit`
        if request.method == "POST":  # ember is the front door: a malformed body stops here, not upstream
            try:
                parsed = json.loads(raw)
            except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
                return error_response(400, f"the body is not valid JSON: {e}")
            if not isinstance(parsed, dict):
                return error_response(400, "the body must be a JSON object")
            if why := await run_in_threadpool(service.adapter_elsewhere, parsed.get("model")):
                return error_response(404, why, "model")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        await run_in_threadpool(service.inference_begin)
        try:
            upstream = await client.send(client.build_request(request.method, f"{engine_url}/v1/{path}",
                                                              content=raw, headers=headers,
                                                              params=request.query_params), stream=True)
        except httpx.HTTPError as e:
            service.inference_end()
            return error_response(502, f"the inference engine at {engine_url} failed: {e}")

        async def done() -> None:
            await upstream.aclose()
            service.inference_end()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=out_headers,
                                 background=BackgroundTask(done))
