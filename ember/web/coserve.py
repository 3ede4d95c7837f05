"""Co-serving's HTTP side: the inference worker's OpenAI-compatible app (ember.web.infer_worker:
/v1/completions, /v1/chat/completions, /v1/models, /health, streaming) over the training job's
own model (ember.infer.coserve), run by uvicorn in a thread of the training process.

The server listens before the first step, on `[serve] host` and `port` (loopback and a free port
by default), and answers only requests that carry its token (`Authorization: Bearer`, 401
otherwise): $EMBER_SERVE_TOKEN if set, else a new random one. Where it listens and the token
are in OUT/serve.json (`{"url", "token", "pid"}`, readable by its owner alone) while the run
serves; the file goes when the run ends. A handler only queues its request and waits: the
training thread generates in its gaps (ember.train.between), so nothing here runs the model.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Any

from ember.errors import EmberError
from ember.infer.coserve import COMMITTED, LIVE, CoEngine, Gaps
from ember.web.infer_worker import STOP_GRACE_SECONDS, create_app
from ember.web.sockets import listen

TOKEN_ENV = "EMBER_SERVE_TOKEN"
START_SECONDS = 30.0  # uvicorn's start-up in a thread: milliseconds, unless the machine is swamped


class CoServing:
    """What the loop holds (ember.train.between.Serving): the gaps, and the server to stop."""

    def __init__(self, gaps: Gaps, server: Any, thread: threading.Thread, job: Any):
        self.gaps, self.server, self.thread, self.job = gaps, server, thread, job
        self.closed = False

    def gap(self) -> float:
        return self.gaps.gap()

    def close(self, drain: bool) -> None:
        """Finish (or refuse) the requests, stop the server, remove OUT/serve.json; once."""
        if self.closed:
            return
        self.closed = True
        self.gaps.close(drain)
        self.server.should_exit = True  # answers under way get STOP_GRACE_SECONDS to be sent
        self.thread.join(timeout=STOP_GRACE_SECONDS + 1.0)
        self.job.run.serving_ended()
        g = self.gaps
        self.job.events.info(f"co-serving: {g.engine.requests} requests, {g.turns} decode turns, "
                         f"{g.seconds:.2f} s of gaps", requests=g.engine.requests, serve_seconds=g.seconds)


def start(job: Any) -> CoServing:
    """Listen, serve in a thread, write OUT/serve.json; raise EmberError if it cannot listen."""
    import uvicorn
    cfg = job.recipe.serve
    sock = listen(cfg.host, cfg.port, f"[serve] host = {cfg.host!r}, port = {cfg.port}")
    engine = CoEngine(job)
    token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    config = uvicorn.Config(create_app(engine, token), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=STOP_GRACE_SECONDS)
    server = uvicorn.Server(config)  # in a thread, it installs no signal handler: the loop's stay
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ember-coserve", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_SECONDS
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        server.should_exit = True
        raise EmberError(f"co-serving: the HTTP server on {cfg.host}:{sock.getsockname()[1]} did not start "
                         f"within {START_SECONDS:.0f} s; see the log above, or set [serve] coserve = false")
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    file = job.run.announce_serving({"url": url, "token": token, "pid": os.getpid()})
    job.events.info(f"co-serving on {url}/v1 (models {LIVE!r}" + (f", {COMMITTED!r}, 'base'" if engine.lora else "")
                    + f"; the token is in {file})", url=url)
    return CoServing(Gaps(engine, cfg.gap_share, cfg.burst_seconds), server, thread, job)
