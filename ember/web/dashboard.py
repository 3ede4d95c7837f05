"""The dashboard: HTML pages, the JSON API behind them, live steps (server-sent events) and
Prometheus metrics. One handler per route, each taking the request; `ROUTES` lists them, and
ember.web.api.create_app mounts them on the service's app (or `ember ui`'s) beside the
`Dashboard` they share (app.state.dashboard).

    GET /runs, /runs/{id}, /queue, /machine, /plan      pages (server-rendered, a little JavaScript)
    GET /api/runs?status=&match=&sort=&desc=            the runs table           (ember runs)
    GET /api/runs/{id}                                   the run's report         (ember report --json)
    GET /api/runs/{id}/record                            its run.json: recipe, manifest, data fingerprint
    GET /api/runs/{id}/diagnosis                         its newest `ember doctor RUN`, or 404
    GET /api/runs/{id}/curves?fields=&start=&end=&buckets=   per-step curves, min/max-downsampled
    GET /api/runs/{id}/live                              text/event-stream of the steps as they come
    GET /api/compare?a=&b=&tolerance=                    ember compare A B --json
    GET /api/machine?since=                              devices, duty cycle, rent/reserve/own (ember capacity)
    GET /api/plan?run=|job=&device_memory=&target_micro_batch=   ember plan --json
    GET /metrics                                         Prometheus text format (ember.metrics.exposition)
    GET /login?token=                                    the dashboard's session (ember.web.security)

A run is named by its ledger id alone: nothing outside the ledger's runs is reachable.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, select_autoescape
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool

from ember.errors import NotFound
from ember.metrics.capacity import CapacityReport
from ember.metrics.compare import Comparison
from ember.metrics.exposition import LedgerCollector
from ember.metrics.listing import SORT_KEYS, RunEntry, run_live
from ember.metrics.report import RunReport
from ember.metrics.series import DEFAULT_BUCKETS, Curves, follow
from ember.ledger.job_states import LOCAL, LOCAL_FINAL as FINAL
from ember.web import security
from ember.web.error_responses import LIBRARY, status_of
from ember.web.views import MachinePage, Views
from ember.paths import ascii_digits

HERE = Path(__file__).parent
STATIC = {p.name: p for p in (HERE / "static").iterdir() if p.is_file()}  # the only files served
MEDIA = {".js": "text/javascript", ".css": "text/css", ".txt": "text/plain", ".svg": "image/svg+xml"}
PAGE_ROWS = 100  # runs per page of the Runs page
LIVE_POLL_SECONDS = 1.0
LIVE_MAX_SECONDS = 600.0  # a stream ends after this; the browser's EventSource reconnects from its offset
STATUSES = ("completed", "running", "interrupted", "failed", "crashed", "killed", "unknown", "folder missing")


def as_json(value: Any) -> Any:
    """A library answer as JSON: dataclasses as `asdict` (what `--json` prints), and the floats JSON
    cannot carry (an infinite step time, NaN) as null."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def size(n: float | None) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point."""
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def reply(value: Any) -> JSONResponse:
    """A library answer as the JSON route's answer."""
    return JSONResponse(as_json(value))


@dataclass
class Dashboard:
    """What the dashboard's handlers share, kept on the app (`app.state.dashboard`): the library
    calls behind the pages, the token that signs in, the page templates, the metrics registry."""
    views: Views
    token: str
    templates: Environment
    registry: CollectorRegistry

    @classmethod
    def over(cls, views: Views, token: str) -> Dashboard:
        """The dashboard over `views`, signed in to with `token`."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(LedgerCollector(views.con, LOCAL.states))
        return cls(views, token, templates(), registry)


def templates() -> Environment:
    """The pages' templates, with the filters they format numbers with."""
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = lambda v, spec=",.1f": "-" if v is None else format(v, spec)
    env.filters["ms"] = lambda v: "-" if v is None else f"{v * 1000:,.1f} ms"
    env.filters["pct"] = lambda v: "-" if v is None else f"{v:.1%}"
    env.filters["when"] = lambda t: "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
    env.filters["gib"] = size
    env.filters["tojson_attr"] = lambda v: json.dumps(v, default=str)
    return env


def dashboard(request: Request) -> Dashboard:
    """The dashboard of the app answering `request`."""
    return request.app.state.dashboard


def views(request: Request) -> Views:
    """The library calls behind the pages of the app answering `request`."""
    return request.app.state.dashboard.views


def page(request: Request, template: str, title: str, **data: Any) -> HTMLResponse:
    """`template` rendered for `request`: signed in or not, and the CSRF value its scripts send back."""
    d = dashboard(request)
    signed_in = security.session_ok(request, d.token)
    html = d.templates.get_template(template).render(
        title=title, nav=title, signed_in=signed_in, service=d.views.service is not None,
        csrf=security.csrf_value(d.token) if signed_in else "", **data)
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


def error_page(request: Request, e: Exception) -> HTMLResponse:
    """A library error as a page, with the status the JSON API gives it (ember.web.error_responses)."""
    status = status_of(e)
    r = page(request, "error.html", "Error", status=status, message=str(e))
    r.status_code = status
    return r


# ---- pages: one handler each, taking the request ----------------------------------------------

def home(request: Request) -> RedirectResponse:
    """/ is the Runs page."""
    return RedirectResponse("/runs", status_code=303)


def runs_page(request: Request, status: str | None = None, match: str | None = None, sort: str = "created",
              desc: bool = True, page_: int = Query(1, alias="page", ge=1)) -> HTMLResponse:
    """The runs table, sorted and filtered, a page at a time."""
    try:
        rows = views(request).runs(status or None, match or None, sort, desc)
    except LIBRARY as e:
        return error_page(request, e)
    # Sorted and filtered over every run; shown a page at a time (a browser lays out 100 rows
    # in a blink, 1,000 in over a second on a small machine).
    pages = max(1, -(-len(rows) // PAGE_ROWS))
    at = min(page_, pages)
    return page(request, "runs.html", "Runs", rows=rows[(at - 1) * PAGE_ROWS:at * PAGE_ROWS], total=len(rows),
                first=(at - 1) * PAGE_ROWS + 1, at=at, pages=pages, status=status or "", match=match or "",
                sort=sort, desc=desc, statuses=STATUSES, sort_keys=SORT_KEYS)


def run_page(request: Request, run_id: str, compare: str | None = None) -> HTMLResponse:
    """One run: its report, record, diagnosis, curves, and a comparison with another."""
    v = views(request)
    try:
        data = v.run_page(run_id, compare or None)
    except LIBRARY as e:
        return error_page(request, e)
    return page(request, "run.html", "Runs", p=data, run_id=run_id, live=run_live(v.con(), run_id))


def queue_page(request: Request) -> HTMLResponse:
    """The service's queue (`ember ui` has none)."""
    v = views(request)
    data = v.queue() if v.service is not None else None
    return page(request, "queue.html", "Queue", q=data, final=FINAL)


def machine_page(request: Request, since: str | None = None) -> HTMLResponse:
    """The devices, their duty cycle, and rent, reserve or own."""
    try:
        data = views(request).machine(since or None)
    except LIBRARY as e:
        return error_page(request, e)
    return page(request, "machine.html", "Machine", m=data, since=since or "")


def plan_page(request: Request, run: str | None = None, job: str | None = None,
              device_memory: float | None = None, target_micro_batch: int | None = None) -> HTMLResponse:
    """The plan of a run's or a queued job's recipe, and the runs and jobs to choose from."""
    v = views(request)
    plan, error = None, None
    if run or job:
        try:
            plan = v.plan(run or None, job or None, device_memory, target_micro_batch)
        except LIBRARY as e:
            error = str(e)
    runs = v.runs(None, None, "created", True)
    jobs = v.service.queue() if v.service is not None else []
    return page(request, "plan.html", "Plan", plan=plan, error=error, run=run or "", job=job or "",
                device_memory=device_memory, target_micro_batch=target_micro_batch, runs=runs, jobs=jobs)


def login_form(request: Request, token_: str | None = Query(None, alias="token")) -> Response:
    """The sign-in form, or with ?token= (the link `ember ui` prints) the sign-in itself."""
    if token_ is not None:
        return sign_in(request, token_)
    return page(request, "login.html", "Sign in", failed=False)


async def login_post(request: Request) -> Response:
    """The sign-in form's answer."""
    form = parse_qs((await request.body()).decode(errors="replace"))
    return sign_in(request, (form.get("token") or [""])[0])


def sign_in(request: Request, given: str) -> Response:
    """The session cookie and the Runs page for the right token; the form again, 401, for a wrong one."""
    token = dashboard(request).token
    if not security._equal(given.strip(), token):
        r = page(request, "login.html", "Sign in", failed=True)
        r.status_code = 401
        return r
    r = RedirectResponse("/runs", status_code=303)
    r.set_cookie(security.SESSION_COOKIE, security.session_value(token), httponly=True, samesite="strict",
                 path="/")
    return r


def static(name: str) -> Response:
    """One of the files in static/, and nothing else."""
    path = STATIC.get(name)
    if path is None:
        raise NotFound(f"no static file {name[:200]!r}")
    return Response(path.read_bytes(), media_type=MEDIA.get(path.suffix, "application/octet-stream"),
                    headers={"Cache-Control": "max-age=3600"})


# ---- the JSON API ---------------------------------------------------------------------------
# Without docstrings: FastAPI would publish them in /openapi.json. The module docstring says what each is.

def api_runs(request: Request, status: str | None = None, match: str | None = None, sort: str = "created",
             desc: bool = False) -> Any:
    return reply(views(request).runs(status, match, sort, desc))


def api_run(request: Request, run_id: str) -> Any:
    return reply(views(request).report(run_id))


def api_record(request: Request, run_id: str) -> Any:
    return reply(views(request).record(run_id))


def api_diagnosis(request: Request, run_id: str) -> Any:
    found = views(request).diagnosis(run_id)
    if found is None:
        raise NotFound(f"run {run_id} has no diagnosis: `ember doctor RUN_FOLDER` makes one")
    return reply(found)


def api_curves(request: Request, run_id: str, fields: str | None = None, start: float | None = None,
               end: float | None = None, buckets: int = Query(DEFAULT_BUCKETS, ge=1, le=100_000)) -> Any:
    return reply(views(request).curves(run_id, fields, start, end, buckets))


async def api_live(run_id: str, request: Request, offset: int = Query(0, ge=0)) -> StreamingResponse:
    v = views(request)
    folder = await run_in_threadpool(v.folder, run_id)
    last = request.headers.get("last-event-id", "")  # what this stream sent as `id:`, or a client's own
    start = int(last) if ascii_digits(last) and len(last) <= 20 else offset
    return StreamingResponse(live_steps(request, v, run_id, folder, start), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store"})


async def live_steps(request: Request, v: Views, run_id: str, folder: Path, position: int) -> AsyncIterator[str]:
    """A run's steps from byte `position` of its steps file as server-sent events while it runs,
    then its last steps and `end`; at most LIVE_MAX_SECONDS (the browser reconnects from its offset)."""
    began = time.monotonic()
    yield "retry: 2000\n\n"
    while time.monotonic() - began < LIVE_MAX_SECONDS:
        steps, position = await run_in_threadpool(follow, folder, position)
        if steps:
            yield f"id: {position}\nevent: steps\ndata: {json.dumps(steps, allow_nan=False, default=str)}\n\n"
        elif not await run_in_threadpool(lambda: run_live(v.con(), run_id)):
            steps, position = await run_in_threadpool(follow, folder, position)  # its last lines
            if steps:
                yield f"id: {position}\nevent: steps\ndata: {json.dumps(steps, default=str)}\n\n"
            yield "event: end\ndata: {}\n\n"
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(LIVE_POLL_SECONDS)


def api_compare(request: Request, a: str, b: str, tolerance: float = Query(1e-3, ge=0)) -> Any:
    return reply(views(request).compare(a, b, tolerance))


def api_machine(request: Request, since: str | None = None) -> Any:
    return reply(views(request).machine(since))


def api_capacity(request: Request, since: str | None = None) -> Any:
    return reply(views(request).machine(since).capacity)


def api_plan(request: Request, run: str | None = None, job: str | None = None,
             device_memory: float | None = Query(None, gt=0, le=1e6),
             target_micro_batch: int | None = Query(None, ge=1, le=1_000_000)) -> Any:
    return reply(views(request).plan(run, job, device_memory, target_micro_batch))


def metrics(request: Request) -> Response:
    return Response(generate_latest(dashboard(request).registry), media_type=CONTENT_TYPE_LATEST)


# The dashboard's routes, mounted by ember.web.api.create_app. FastAPI's own kind of Starlette
# route: it validates the query (a bad one is a 400) and documents the route in /openapi.json.
PAGE = {"methods": ["GET"], "include_in_schema": False}
ROUTES = [
    APIRoute("/", home, **PAGE),
    APIRoute("/runs", runs_page, **PAGE),
    APIRoute("/runs/{run_id}", run_page, **PAGE),
    APIRoute("/queue", queue_page, **PAGE),
    APIRoute("/machine", machine_page, **PAGE),
    APIRoute("/plan", plan_page, **PAGE),
    APIRoute("/login", login_form, **PAGE),
    APIRoute("/login", login_post, methods=["POST"], include_in_schema=False),
    APIRoute("/static/{name}", static, **PAGE),
    APIRoute("/api/runs", api_runs, methods=["GET"], response_model=list[RunEntry]),
    APIRoute("/api/runs/{run_id}", api_run, methods=["GET"], response_model=RunReport),
    APIRoute("/api/runs/{run_id}/record", api_record, methods=["GET"]),
    APIRoute("/api/runs/{run_id}/diagnosis", api_diagnosis, methods=["GET"]),
    APIRoute("/api/runs/{run_id}/curves", api_curves, methods=["GET"], response_model=Curves),
    APIRoute("/api/runs/{run_id}/live", api_live, methods=["GET"], response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "`steps` events (JSON lists of new steps), then `end`"}}),
    APIRoute("/api/compare", api_compare, methods=["GET"], response_model=Comparison),
    APIRoute("/api/machine", api_machine, methods=["GET"], response_model=MachinePage),
    APIRoute("/api/capacity", api_capacity, methods=["GET"], response_model=CapacityReport),
    APIRoute("/api/plan", api_plan, methods=["GET"]),
    APIRoute("/metrics", metrics, methods=["GET"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}}),
]
