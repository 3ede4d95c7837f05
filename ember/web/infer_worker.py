"""The inference worker: an OpenAI-compatible HTTP server over one ember.infer.Engine.

`ember serve` runs it as a child process and forwards requests to it, as it would to llama.cpp:

    python -m ember.web.infer_worker --model SPEC [--runs DIR ...] [--host 127.0.0.1]
                                     [--port P] [--device cpu] [--seed N]

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
means `base`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ember.errors import EXIT_ERROR, EXIT_OK, EmberError
from ember.events import Event, Events
from ember.infer.engine import BASE, Engine, Generation, RequestError, Sampling
from ember.web.error_responses import error_response
from ember.web.security import WORKER_TOKEN_ENV, bearer_ok
from ember.web.sockets import listen

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

    @app.exception_handler(EmberError)
    async def ember_error(request: Request, e: EmberError) -> JSONResponse:
        return error_response(getattr(e, "status", 400), str(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception) -> JSONResponse:  # Starlette logs the traceback too
        return error_response(500, f"{type(e).__name__}: {e}")

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
        body = await read_json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError("prompt: required, a string")
        if body.get("echo") or body.get("logprobs") or body.get("suffix"):
            raise RequestError("echo, logprobs and suffix are not supported by ember's engine")
        return await respond(engine, body, prompt, sampling(body, 16), completion_chunk)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await read_json(request)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise RequestError("messages: required, a list of {\"role\": str, \"content\": str}")
        if body.get("logprobs") or body.get("tools"):
            raise RequestError("logprobs and tools are not supported by ember's engine")
        return await respond(engine, body, messages, sampling(body, None), chat_chunk)

    return app


async def read_json(request: Request) -> dict[str, Any]:
    """The request's JSON object, refused past MAX_BODY bytes without reading the rest."""
    length = request.headers.get("content-length", "")
    too_big = RequestError(f"the request body is over {MAX_BODY} bytes; send a shorter prompt", 413)
    if length.isdigit() and int(length) > MAX_BODY:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise too_big
    try:
        data = json.loads(body)
    except ValueError as e:  # UnicodeDecodeError is one
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    return data


def sampling(body: dict[str, Any], default_max: int | None) -> Sampling:
    """The sampling settings of an OpenAI request, type-checked (Sampling.check does ranges)."""
    def number(key: str, kind: type, default: Any) -> Any:
        value = body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            what = "a number" if kind is float else "an integer"
            raise RequestError(f"{key}: expected {what}, got {value!r:.40}")
        return kind(value)
    if number("n", int, 1) != 1:
        raise RequestError("n: only 1 is supported")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop: a string or a list of strings")
    max_tokens = number("max_tokens", int, None)
    if max_tokens is None:  # the chat API's newer name for it
        max_tokens = number("max_completion_tokens", int, default_max)
    return Sampling(max_tokens=max_tokens, temperature=number("temperature", float, 1.0),
                    top_p=number("top_p", float, 1.0), stop=tuple(stop), seed=number("seed", int, None))


async def respond(engine: Engine, body: dict[str, Any], prompt: Any, how: Sampling,
                  chunk: Callable[..., dict[str, Any]]) -> Any:
    """Run one generation and answer with it whole, or as server-sent events."""
    model = body.get("model") or BASE
    if not isinstance(model, str):
        raise RequestError("model: a string")
    gen = engine.generate(model, prompt, how)  # refuses a bad request before anything runs
    try:
        await anyio.to_thread.run_sync(next, gen)  # waits its turn, activates the adapter (may refuse)
    except BaseException:  # cancelled while waiting: release the engine now, not at garbage collection
        gen.close()
        raise
    head = {"id": f"{'chatcmpl' if chunk is chat_chunk else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()), "model": model}
    if not body.get("stream"):
        text = await anyio.to_thread.run_sync(gen.text)
        return {**chunk(head, text, gen.usage.finish_reason, whole=True), "usage": usage(gen)}
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(events(gen, head, chunk, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def events(gen: Generation, head: dict[str, Any], chunk: Callable[..., dict[str, Any]],
                 include_usage: bool) -> AsyncIterator[str]:
    """The generation as OpenAI stream chunks; the engine is released however the stream ends."""
    try:
        yield sse(chunk(head, "", None, first=True))
        while (piece := await anyio.to_thread.run_sync(next, gen, _END)) is not _END:
            if piece:
                yield sse(chunk(head, piece, None))
        yield sse(chunk(head, "", gen.usage.finish_reason))
        if include_usage:
            yield sse({**chunk(head, "", None), "choices": [], "usage": usage(gen)})
        yield "data: [DONE]\n\n"
    except Exception as e:  # after the 200 header: the stream carries the error, and ends
        yield sse({"error": {"message": str(e) if isinstance(e, EmberError) else f"{type(e).__name__}: {e}",
                             "type": "server_error", "param": None, "code": 500}})
    finally:
        with anyio.CancelScope(shield=True):  # also when the client left and the task is cancelled
            await anyio.to_thread.run_sync(gen.close)


def completion_chunk(head: dict[str, Any], text: str, finish: str | None, whole: bool = False,
                     first: bool = False) -> dict[str, Any]:
    return {**head, "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(head: dict[str, Any], text: str, finish: str | None, whole: bool = False,
               first: bool = False) -> dict[str, Any]:
    if whole:
        return {**head, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
    delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
    return {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage(gen: Generation) -> dict[str, int]:
    u = gen.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def sse(data: dict[str, Any]) -> str:
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
    args = parser.parse_args(argv)
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
