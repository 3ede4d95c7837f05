"""The inference worker: an OpenAI-compatible HTTP server over one ember.infer.Engine. This is
the HTTP glue (the app, the body, server-sent events, the process); the requests' and answers'
shapes are ember.infer.openai's.

`ember serve` runs it as a child process and forwards requests to it, as it would to llama.cpp:

    python -m ember.web.infer_worker --model SPEC [--runs DIR ...] [--host 127.0.0.1]
                                     [--port P] [--device cpu] [--seed N] [--threads N]

With --port 0 it binds a free port. The first line on stdout is `listening on http://HOST:PORT`
(flushed), and nothing else goes to stdout, so a parent that reads one line never blocks it. The
model loads in a background thread once the server listens: GET /health answers 503
{"status": "loading"} until then, 200 {"status": "ok"} after, and 500 {"status": "failed",
"message": ...} if loading failed. SIGTERM or SIGINT stops it: answers under way get
STOP_GRACE_SECONDS to finish, and the process is gone a second after that at the latest, even
with a generation still running (it started from a parent that dies with it: ember.proc).

    GET  /v1/models             base, and each LoRA run trained on this base (by folder name)
    POST /v1/completions        prompt, model, max_tokens, temperature, top_p, stop, seed, stream
    POST /v1/chat/completions   the same with messages instead of prompt

Started by the service, the worker gets a token in $EMBER_WORKER_TOKEN and answers only requests
that carry it (`Authorization: Bearer`; 401 otherwise): its port is on loopback, where any local
program could otherwise use the model past the service's own token.

`"stream": true` answers text/event-stream: `data: {chunk}` events, then `data: [DONE]`. Errors
are `{"error": {"message", "type", "param", "code"}}` (ember.web.error_responses, the service's one shape)
with a 4xx status when the request is at fault; a bad request changes nothing. A missing `model`
means the engine's `default_model` (`base`; a co-serving training run's: `live`, ember.web.coserve).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ember.errors import EXIT_ERROR, EXIT_OK, EmberError
from ember.events import Event, Events
from ember.infer.engine import Engine, Generation, RequestError
from ember.infer.openai import OpenAIRequest, chat_request, chunks, completion_request, whole
from ember.web.disconnect import unless_left
from ember.web.error_responses import error_response
from ember.web.security import WORKER_TOKEN_ENV, bearer_ok
from ember.web.sockets import listen
from ember.paths import ascii_digits

STOP_GRACE_SECONDS = 2.0  # after SIGTERM: the answers under way may finish, then the worker exits
MAX_BODY = 1 << 20  # bytes: a prompt beyond this is far past any context ember serves
_END = object()


def create_app(engine: Engine, token: str | None = None) -> FastAPI:
    """The worker's ASGI app; its start-up loads the engine's model in a thread unless loaded.
    With `token`, every request must carry it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine.status == "loading":  # failures are kept in engine.error for /health
            threading.Thread(target=engine.load, name="ember-load-model", daemon=True).start()
        yield

    app = FastAPI(title="ember inference worker", lifespan=lifespan)
    if token:
        @app.middleware("http")
        async def only_with_the_token(request: Request, call_next: Callable) -> Any:
            if not bearer_ok(request, token):
                return error_response(401, "this worker answers the ember service only: "
                                           "Authorization: Bearer <its token> is missing or wrong")
            return await call_next(request)
    app.add_exception_handler(EmberError, ember_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, crash)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = engine.status
        body = {"status": status} | ({"message": engine.error} if engine.error else {})
        return JSONResponse(body, status_code={"ok": 200, "loading": 503}.get(status, 500))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = await anyio.to_thread.run_sync(engine.models)  # reads each run's run.json
        return {"object": "list", "data": [{"id": m.pop("id"), "object": "model",
                                            "created": m.pop("created"), "owned_by": "ember", **m}
                                           for m in data]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await respond(engine, completion_request(await read_json(request), engine.default_model), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await respond(engine, chat_request(await read_json(request), engine.default_model), request)

    @app.post("/v1/embeddings")
    async def embeddings() -> Any:  # the service forwards it (an upstream engine may answer it)
        raise RequestError("/v1/embeddings: ember's built-in engine (and a co-serving run) generates text "
                           "and computes no embeddings; serve them from an engine that does (llama.cpp's "
                           "llama-server started with --embeddings), through `ember serve` with [inference] "
                           "upstream set to it", 404)

    return app


async def ember_error(request: Request, e: EmberError) -> JSONResponse:
    """A request the engine refuses, with its status (RequestError's; 400 for another EmberError)."""
    return error_response(getattr(e, "status", 400), str(e))


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown route, a method not allowed) in the one shape."""
    return error_response(e.status_code, str(e.detail))


async def crash(request: Request, e: Exception) -> JSONResponse:
    """A defect: 500 with what it was (Starlette logs the traceback too)."""
    return error_response(500, f"{type(e).__name__}: {e}")


async def read_json(request: Request) -> dict[str, Any]:
    """The request's JSON object, refused past MAX_BODY bytes without reading the rest."""
    length = request.headers.get("content-length", "")
    too_big = RequestError(f"the request body is over {MAX_BODY} bytes; send a shorter prompt", 413)
    if ascii_digits(length) and int(length) > MAX_BODY:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise too_big
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; deep nesting recurses
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    return data


async def respond(engine: Engine, asked: OpenAIRequest, request: Request) -> Any:
    """Run one generation and answer with it whole, or as server-sent events."""
    gen = engine.generate(asked.model, asked.prompt, asked.sampling)  # refuses a bad request before anything runs
    try:
        await anyio.to_thread.run_sync(next, gen)  # waits its turn, activates the adapter (may refuse)
    except BaseException:  # cancelled while waiting: release the engine now, not at garbage collection
        gen.close()
        raise
    head = asked.head()
    if not asked.stream:
        text = await whole_text(request, gen)
        if text is None:  # nginx's "client closed request": nobody reads it
            return error_response(499, "the client left before the answer was complete")
        return whole(asked, head, text, gen.usage)
    return StreamingResponse(events(gen, chunks(asked, head, gen)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def whole_text(request: Request, gen: Generation) -> str | None:
    """All of `gen`'s text, made a piece at a time in a thread; None if the client left meanwhile
    (one that gave up, or the service's proxy that closed its connection): the generation ends
    at the next piece, not after up to max_tokens more tokens for nobody (4096: minutes on a CPU,
    its place in the batch taken all along)."""
    pieces: list[str] = []
    try:
        while True:
            piece, left = await unless_left(request, anyio.to_thread.run_sync(next, gen, _END))
            if left:
                return None
            if piece is _END:
                return "".join(pieces)
            pieces.append(piece)
    finally:
        gen.close()  # only marks the job cancelled: the loop drops it before its next step


async def events(gen: Generation, stream: Iterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The chunks of `stream` (which iterates `gen`) as server-sent events, each made in a thread;
    the engine is released however the stream ends."""
    try:
        while (chunk := await anyio.to_thread.run_sync(next, stream, _END)) is not _END:
            yield sse(chunk)
        yield "data: [DONE]\n\n"
    except Exception as e:  # after the 200 header: the stream carries the error, and ends
        yield sse({"error": {"message": str(e) if isinstance(e, EmberError) else f"{type(e).__name__}: {e}",
                             "type": "server_error", "param": None, "code": 500}})
    finally:
        with anyio.CancelScope(shield=True):  # also when the client left and the task is cancelled
            await anyio.to_thread.run_sync(gen.close)


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying `data`."""
    return f"data: {json.dumps(data)}\n\n"


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, listen, say where, and serve until SIGTERM or SIGINT."""
    import uvicorn
    parser = argparse.ArgumentParser(prog="python -m ember.web.infer_worker",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True,
                        help="builtin:tiny, a model folder, a .gguf file, or package:DIST:FILE")
    parser.add_argument("--runs", action="append", default=[], type=Path, metavar="DIR",
                        help="a run folder, or a folder of run folders (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = a free port (default)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, auto")
    parser.add_argument("--seed", type=int, default=0, help="builtin:tiny's init seed: the runs' train.seed")
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="CPU threads for the model (default: half the cores, as llama.cpp)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        print(f"error: --threads {args.threads}: give 1 or more", file=sys.stderr)
        return EXIT_ERROR
    # Half the cores, not all: beside training (or any busy program), torch's threads spin at
    # each barrier while the others hold the cores; measured on 2 busy cores, 2 threads took
    # 2.0 s a token where 1 took 0.14 s (bench/README.md, the built-in engine).
    torch.set_num_threads(args.threads)
    try:
        engine = Engine(args.model, args.runs, device=args.device, seed=args.seed, events=Events(report))
        sock = listen(args.host, args.port, f"--host {args.host} --port {args.port}")
    except EmberError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(create_app(engine, os.environ.get(WORKER_TOKEN_ENV) or None), log_level="warning",
                            access_log=False, timeout_graceful_shutdown=STOP_GRACE_SECONDS)
    server = uvicorn.Server(config)
    server.handle_exit = lambda signum, frame: stop(server)  # uvicorn installs it for SIGTERM and SIGINT
    server.run(sockets=[sock])
    return EXIT_OK


def default_threads() -> int:
    """Half the CPU cores this process may use, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def stop(server) -> None:
    """Stop serving: the answers under way get STOP_GRACE_SECONDS to finish, then the process
    exits whatever still runs (a generation in a thread cannot be cancelled, and uvicorn alone
    would wait for it to the last token). Nothing here needs saving."""
    server.should_exit = True
    deadline = threading.Timer(STOP_GRACE_SECONDS + 1.0, os._exit, (EXIT_OK,))
    deadline.daemon = True  # it must not itself keep the process waiting
    deadline.start()


def report(event: Event) -> None:
    print(f"{event.kind}: {event.message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
