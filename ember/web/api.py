"""The service's HTTP API: a thin layer over ember.sched.service.Service (its verbs: `service.control`).

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
answered. A change (/v1 included) that a browser says comes from a page of another origin is
refused with 403, whatever it carries. A path with a '.' or '..' segment or an encoded separator (%2F, %5C) is
refused with 400 before routing (ember.web.guard). Bad requests get a 4xx and change nothing; every error answer,
here, from the dashboard's routes and from /v1, has the one shape of ember.web.error_responses, which maps
the library's errors to statuses. /openapi.json (ember.web.openapi) documents the bodies, the
token and the errors.
`ember ui` makes the app without a service: the dashboard alone, no /api/jobs and no /v1.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from ember import __version__
from ember.errors import BadInput
from ember.paths import NAME_GRAMMAR
from ember.sched.service import Service
from ember.sched.yield_hold import MAX_SECONDS as MAX_YIELD_SECONDS
from ember.web import dashboard, error_responses as errors, security
from ember.web.dashboard import Dashboard
from ember.web.disconnect import unless_left
from ember.web.error_responses import error_response, responses
from ember.web.guard import BodyLimit, refusal
from ember.web.openapi import document
from ember.web.views import Views

# The OpenAI routes the proxy forwards; nothing else of the engine's (docs, tokenize, slots,
# metrics, ...) is reachable through the service.
V1_ROUTES = {("GET", "models"), ("POST", "completions"), ("POST", "chat/completions"), ("POST", "embeddings")}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host", "content-length"}
# The service's own credentials stay here: its token and the dashboard's session cookie are keys to
# the whole service, and the engine may be another program on another host ([inference] upstream);
# nor may the engine set a cookie under the service's origin (it could replace the session).
NOT_FORWARDED = HOP_BY_HOP | {"authorization", "cookie"}
# Date and Server are the answering server's own: uvicorn sends them, and the engine's would be a second pair.
NOT_RETURNED = HOP_BY_HOP | {"set-cookie", "date", "server"}


def create_app(service: Service | None, token: str, loopback: bool, engine_url: str | None,
               ledger: Path | None = None, max_body_bytes: int = 1 << 20, open_reads: bool = False,
               engine_token: str | None = None) -> FastAPI:
    """The app; `engine_url`: where /v1 requests go (upstream or the built-in worker), or None.
    Without a service (`ember ui`): the dashboard over `ledger` alone. `open_reads` (loopback
    only: `[service] open_on_loopback`): reading and /v1 need no token. `engine_token`: the
    built-in worker's own token, sent with every request forwarded to it (the caller's is not)."""
    open_reads = open_reads and loopback
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               headers={"Authorization": f"Bearer {engine_token}"} if engine_token else None,
                               cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])))  # keeps none:
    # the client is every caller's, and an engine's cookie would go back with everyone's requests

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
        response = refusal(request, token, loopback, open_reads, limit) or await call_next(request)
        response.headers.update(security.HEADERS)
        return response

    app.add_middleware(BodyLimit, limit=limit)  # outermost: a body is cut at the limit however it is framed
    app.state.dashboard = Dashboard.over(Views(service.ledger_path if service is not None else ledger, service),
                                         token)
    app.router.routes.extend(dashboard.ROUTES)
    if service is not None:
        app.state.backend = Backend(service, engine_url, client)
        app.router.routes.extend(ROUTES)
    return app


class SubmitBody(BaseModel):
    """POST /api/jobs: a recipe to queue (what `ember submit` sends)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    recipe: str = Field(min_length=1, description="the recipe's path, under a folder of [service] allowed")
    name: str | None = Field(None, description=f"the job's name, {NAME_GRAMMAR}, not digits alone "
                                                "(default RECIPE-ID)")
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
    seconds: float | None = Field(None, gt=0, le=MAX_YIELD_SECONDS, description="hold all training this long; null: until "
                                                                        "released")
    release: bool = Field(False, description="end a yield now (`seconds` is then not read)")


class PurgeBody(BaseModel):
    """POST /api/jobs/purge (no body: every finished job)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    jobs: list[str | int] = Field(default_factory=list, description="these finished jobs (names or ids); "
                                                                   "empty: every finished job")
    states: list[Literal["completed", "failed", "cancelled"]] | None = Field(
        None, min_length=1, description="only jobs that ended so (default: all three; [] names none, and "
                                        "is refused rather than read as all)")
    older_than_seconds: float | None = Field(None, ge=0, description="only jobs that ended this long ago or more")
    dry_run: bool = Field(False, description="say what would be removed, remove nothing")


def body_of(model: type[BaseModel], required: bool) -> dict[str, Any]:
    """The requestBody of a route that reads `model` itself (any content type, as curl sends it)."""
    return {"requestBody": {"required": required, "content": {"application/json": {
        "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


@dataclass(frozen=True)
class Backend:
    """What the service's handlers call, kept on the app (`app.state.backend`): the service, and
    where /v1 requests go (None: inference is off) with the client that sends them."""
    service: Service
    engine_url: str | None
    client: httpx.AsyncClient


def backend(request: Request) -> Backend:
    """The service behind the app answering `request`."""
    return request.app.state.backend


async def read(request: Request, model: type[BaseModel]) -> Any:
    """The body as `model`; an empty body is {}. Any content type is read as JSON."""
    raw = await request.body()  # BodyLimit stopped it at `limit`
    try:
        return model.model_validate_json(raw if raw.strip() else b"{}")
    except ValidationError as e:  # answered 400 with FastAPI's own validation errors
        raise RequestValidationError(e.errors()) from None


# ---- the queue's verbs and the inference endpoint, one handler each, taking the request -----
# The service's errors say their meaning (ember.errors): ember.web.error_responses answers them.
# Without docstrings: FastAPI would publish them in /openapi.json. The module docstring says what each is.

async def jobs(request: Request) -> Any:
    service = backend(request).service
    return [asdict(v) for v in await run_in_threadpool(service.queue)]


async def submit(request: Request) -> Any:
    service = backend(request).service
    data = await read(request, SubmitBody)
    for key, path in (("recipe", data.recipe), ("out", data.out)):
        # '~' and '~user' count as absolute; the library expands them (and refuses an unknown user's).
        if path is not None and not (path.startswith("~") or Path(path).is_absolute()):
            raise BadInput(f"'{key}': {path!r} is relative, and the service cannot know the folder it is "
                           f"relative to; send an absolute path (`ember submit` resolves it against the "
                           f"folder you run it in)")
    job = await run_in_threadpool(service.control.submit, data.recipe, data.name, data.priority, data.out,
                                  data.overrides)
    return JSONResponse(asdict(service.view(job)), status_code=201)


async def one(ref: str, request: Request) -> Any:
    service = backend(request).service
    job = await run_in_threadpool(service.control.find, ref)
    return asdict(service.view(job))


async def pause(ref: str, request: Request) -> Any:
    service = backend(request).service
    hard = (await read(request, PauseBody)).hard
    return asdict(service.view(await run_in_threadpool(service.control.pause, ref, hard)))


async def resume(ref: str, request: Request) -> Any:
    service = backend(request).service
    return asdict(service.view(await run_in_threadpool(service.control.resume, ref)))


async def cancel(ref: str, request: Request) -> Any:
    service = backend(request).service
    return asdict(service.view(await run_in_threadpool(service.control.cancel, ref)))


async def requeue(ref: str, request: Request) -> Any:
    service = backend(request).service
    return asdict(service.view(await run_in_threadpool(service.control.requeue, ref)))


async def purge(request: Request) -> Any:
    service = backend(request).service
    data = await read(request, PurgeBody)
    removed = await run_in_threadpool(service.control.purge, [str(r) for r in data.jobs], data.states,
                                      data.older_than_seconds, data.dry_run)
    views = await run_in_threadpool(lambda: [asdict(service.view(j)) for j in removed])
    return {"removed": views, "dry_run": data.dry_run}


async def logs(ref: str, request: Request, offset: int = Query(0, le=2**63 - 1)) -> Any:  # past it: no seek
    service = backend(request).service
    data, end = await run_in_threadpool(service.logs, ref, offset)
    return Response(data, media_type="text/plain", headers={"X-Ember-Offset": str(end)})


async def yield_(request: Request) -> Any:
    service = backend(request).service
    data = await read(request, YieldBody)
    if data.release:
        await run_in_threadpool(service.release_yield)
        return {"released": True}
    return await run_in_threadpool(service.yield_devices, data.seconds)


async def explain(request: Request) -> Any:
    return await run_in_threadpool(backend(request).service.explain)


async def owner_rules(request: Request) -> Any:
    return await run_in_threadpool(backend(request).service.owner_status)


async def stats(request: Request) -> Any:
    b = backend(request)
    return {"inference": b.service.gate.stats(), "engine": b.engine_url}


async def health(request: Request) -> Any:
    b = backend(request)
    engine_url, client = b.engine_url, b.client
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


async def v1(path: str, request: Request) -> Response:
    """An OpenAI-compatible request, forwarded as it is to the engine (its own documents describe it)."""
    b = backend(request)
    service, engine_url, client = b.service, b.engine_url, b.client
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
    headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
    await run_in_threadpool(service.inference_begin)
    try:
        upstream, left = await unless_left(request, client.send(client.build_request(
            request.method, f"{engine_url}/v1/{path}", content=raw, headers=headers,
            params=request.query_params), stream=True))
    except httpx.HTTPError as e:
        service.inference_end()
        return error_response(502, f"the inference engine at {engine_url} failed: {e}")
    if left:  # the engine's request is cancelled (its connection closed): the engine stops generating
        if upstream is not None:  # it answered just as the client left
            await upstream.aclose()
        service.inference_end()
        return error_response(499, "the client left before the inference engine answered")  # to nobody

    ended = False

    async def done() -> None:  # once: after the last byte, or as the engine fails mid-answer
        nonlocal ended
        if not ended:
            ended = True
            try:
                await upstream.aclose()
            finally:
                service.inference_end()

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except BaseException:
            # The engine failed mid-answer (its process died), or the relay was cancelled: the
            # status is sent, so the answer is cut. Starlette runs no background task after a
            # failed body: without this the request stayed in flight for good, and training on
            # the device stayed paused.
            await done()
            raise

    out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in NOT_RETURNED}
    return StreamingResponse(body(), status_code=upstream.status_code, headers=out_headers,
                             background=BackgroundTask(done))


# The service's routes, mounted by create_app after the dashboard's when a service runs.
GET, POST = {"methods": ["GET"]}, {"methods": ["POST"]}
ROUTES = [
    APIRoute("/api/jobs", jobs, **GET),
    APIRoute("/api/jobs", submit, **POST, status_code=201, openapi_extra=body_of(SubmitBody, True),
             responses=responses(403, 409)),
    APIRoute("/api/jobs/{ref}", one, **GET),
    APIRoute("/api/jobs/{ref}/pause", pause, **POST, openapi_extra=body_of(PauseBody, False),
             responses=responses(409)),
    APIRoute("/api/jobs/{ref}/resume", resume, **POST, responses=responses(409)),
    APIRoute("/api/jobs/{ref}/cancel", cancel, **POST, responses=responses(409)),
    APIRoute("/api/jobs/{ref}/requeue", requeue, **POST, responses=responses(409)),
    APIRoute("/api/jobs/purge", purge, **POST, openapi_extra=body_of(PurgeBody, False), responses=responses(409)),
    APIRoute("/api/jobs/{ref}/logs", logs, **GET),
    APIRoute("/api/yield", yield_, **POST, openapi_extra=body_of(YieldBody, False), responses=responses(503)),
    APIRoute("/api/explain", explain, **GET),
    APIRoute("/api/owner", owner_rules, **GET),
    APIRoute("/api/stats", stats, **GET),
    APIRoute("/health", health, **GET, responses=responses(503)),
    APIRoute("/v1/{path:path}", v1, methods=["GET", "POST"], include_in_schema=False),
]
