"""`ember serve` as one library call: lock, token, scheduler thread, inference engine, HTTP.

    serve(options, events)
      lock        $EMBER_HOME/serve/serve.lock: one service per machine; a second one is refused,
                  naming the first's PID
      token       $EMBER_HOME/serve/token, created at the first start with mode 0600
      recover     adopt the jobs whose process still runs, queue again those that died
      engine      the upstream of [inference] upstream, or the built-in worker (its own process:
                  python -m ember.web.infer_worker), started here and stopped on exit; it gets
                  SIGKILL from the kernel if the service dies (ember.proc), and one an earlier
                  service left (engine.json: PID and start time) is stopped before a new one starts
      HTTP        uvicorn on [service] host:port; address, port, PID and its start time in serve.json
                  for clients (`ember ui`: ui.json), written atomically once it listens, removed at
                  exit; a reader trusts it only while that process runs (`announced`)
      SIGTERM     preempt every job (checkpoint, exit 75), wait for them, exit
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ember.durable import write_durable
from ember.errors import EmberError
from ember.events import Events
from ember.lock import acquire
from ember.proc import dies_with_us
from ember.sched.owner_rules import OwnerRules, load_rules
from ember.sched.process import signal_job, start_time
from ember.sched.service import Service
from ember.web.announce import announced, serve_dir, token_path, withdraw
from ember.web.security import WORKER_TOKEN_ENV
from ember.web.sockets import listen

STOP_TIMEOUT = 120.0   # seconds the jobs get to checkpoint and exit when the service stops
GRACE_SECONDS = 3      # open requests (a dashboard's live stream) get this long when the server stops
ENGINE_FILE = "engine.json"  # in the service folder: the built-in engine's PID and start time


@dataclass
class ServeOptions:
    host: str | None = None           # None: [service] host
    port: int | None = None           # None: [service] port
    devices: str | None = None        # simulated devices (EMBER_DEVICES), e.g. sim:2x8GiB
    ledger: Path | None = None
    extra_runs: list[str] = field(default_factory=list)


def ensure_token() -> str:
    """The service's token, created (mode 0600, never readable by others) at the first start."""
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)
    return path.read_text().strip()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def announce_access(host: str, loopback: bool, rules: OwnerRules, events: Events) -> None:
    """Who may use the service, said at its start: the token for everything, or the owner's
    explicit opening of reading and inference on loopback."""
    if loopback and rules.service.open_on_loopback:
        events.warn(f"[service] open_on_loopback = true: on {host}, every program and user of this machine "
                    f"may read the queue, the runs and /metrics and use /v1 without the token; changes "
                    f"still need it ({token_path()})")
    elif not loopback:
        events.warn(f"listening on {host}, not loopback: every request needs the token ({token_path()})")
    else:
        events.info(f"every request needs the token ({token_path()}): the commands read it, OpenAI "
                    f"clients pass it as their API key, the dashboard signs in with the link `ember ui` "
                    f"prints ([service] open_on_loopback opens reading and /v1 on loopback)")


def reap_engine(events: Events) -> None:
    """Stop the built-in engine an earlier service left running (it dies with its service; this is
    for one that did not: started by an older ember, or a death the kernel did not signal)."""
    path = serve_dir() / ENGINE_FILE
    try:
        seen = json.loads(path.read_text())
        pid, started = int(seen["pid"]), str(seen["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if signal_job(pid, started, signal.SIGKILL):
        events.warn(f"stopped the inference engine an earlier service left running (PID {pid})")
    path.unlink(missing_ok=True)


def start_engine(service: Service, events: Events) -> tuple[str | None, subprocess.Popen | None, str | None]:
    """The URL /v1 requests go to, the built-in worker's process if one was started, and the
    token it was given (its port is on loopback: without one, any local program could use the
    model past the service's token)."""
    inf = service.rules.inference
    if not inf.enabled:
        return None, None, None
    if inf.upstream:
        events.info(f"inference: forwarding /v1 to {inf.upstream}")
        return inf.upstream.rstrip("/"), None, None
    reap_engine(events)
    runs = [str(r) for r in service.inference_roots()]
    argv = [sys.executable, "-m", "ember.web.infer_worker", "--model", inf.model, "--host", "127.0.0.1",
            "--port", "0", "--seed", str(inf.seed)]
    for r in runs:
        argv += ["--runs", r]
    log = open(serve_dir() / "engine.log", "ab")
    engine_token = secrets.token_urlsafe(32)
    worker = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                              start_new_session=True, env={**os.environ, WORKER_TOKEN_ENV: engine_token},
                              preexec_fn=dies_with_us(signal.SIGKILL))  # a service SIGKILLed takes it along
    line = worker.stdout.readline().decode().strip()  # "listening on http://127.0.0.1:PORT"
    if not line.startswith("listening on "):
        worker.kill()
        raise EmberError(f"the built-in inference engine did not start ({line or 'no output'}); see "
                         f"{serve_dir() / 'engine.log'}")
    url = line.split()[-1]
    write_durable(serve_dir() / ENGINE_FILE, json.dumps({"pid": worker.pid, "start": start_time(worker.pid)}))
    events.info(f"inference: built-in engine ({inf.model}) at {url}, PID {worker.pid}")
    return url, worker, engine_token


def serve(opt: ServeOptions, events: Events) -> int:
    """Run the service until SIGTERM or SIGINT; see the module docstring."""
    import uvicorn

    from ember.web.api import create_app
    rules = load_rules()
    host = opt.host or rules.service.host
    port = rules.service.port if opt.port is None else opt.port
    d = serve_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = acquire(d / "serve.lock", "ember serve")
    (d / "serve.json").unlink(missing_ok=True)  # an earlier service's, which died: the lock is ours
    sock = listen(host, port, "ember serve ([service] host and port in owner.toml, or --host and --port)")
    token = ensure_token()
    loopback = is_loopback(host)
    announce_access(host, loopback, rules, events)
    service = Service(rules, opt.devices, events, opt.ledger)
    service.recover()
    engine_url, worker, engine_token = start_engine(service, events)
    app = create_app(service, token, loopback, engine_url, open_reads=rules.service.open_on_loopback,
                     engine_token=engine_token)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=GRACE_SECONDS))
    server.install_signal_handlers = lambda: None  # ours below: preempt the jobs first
    stop_requested = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.set()
        server.should_exit = True

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    scheduler = threading.Thread(target=service.run, name="scheduler", daemon=True)
    scheduler.start()
    announced = threading.Thread(target=_announce, args=(server, host, d, events), daemon=True)
    announced.start()
    try:
        server.run(sockets=[sock])
    finally:
        events.info("stopping: preempting jobs (checkpoint, exit 75)")
        service.shutdown(STOP_TIMEOUT)
        if worker is not None:
            worker.terminate()
            try:
                worker.wait(10)
            except subprocess.TimeoutExpired:
                worker.kill()
            worker.wait()
            (d / ENGINE_FILE).unlink(missing_ok=True)
        withdraw("serve")
        lock.release()
    return 0


def _announce(server, host: str, d: Path, events: Events, name: str = "serve") -> None:
    """Once uvicorn listens: write NAME.json (address, port, PID) and say where."""
    for _ in range(600):
        if server.started and server.servers:
            port = server.servers[0].sockets[0].getsockname()[1]
            url = f"http://{host if ':' not in host else '[' + host + ']'}:{port}"
            write_durable(d / f"{name}.json", json.dumps({"url": url, "pid": os.getpid(),
                                                          "start": start_time(os.getpid()), "host": host,
                                                          "port": port}))
            # The service's output may go to a shared log (the journal): the sign-in link, which
            # holds the token, is printed by `ember ui` to the owner's terminal only.
            sign_in = login_link(url, ensure_token()) if name == "ui" else "`ember ui` prints the link"
            events.info(f"ember {name}: listening on {url} (PID {os.getpid()}; token in {token_path()}); "
                        f"dashboard {url}/ ; sign in to change jobs: {sign_in}", url=url)
            return
        time.sleep(0.05)


def login_link(url: str, token: str) -> str:
    """The link that signs a browser in to the dashboard (ember.web.security)."""
    return f"{url}/login?token={token}"


def running_service() -> str | None:
    """The URL of the service running on this machine, or None."""
    info = announced("serve")
    return info["url"] if info else None


@dataclass
class UiOptions:
    host: str | None = None           # None: [service] host
    port: int | None = None           # None: [service] port
    ledger: Path | None = None


def ui(opt: UiOptions, events: Events) -> int:
    """`ember ui`: the dashboard alone (no queue, no inference) until SIGTERM or SIGINT; when a
    service runs, its dashboard already does this: say where, and sign in there."""
    import uvicorn

    from ember.web.api import create_app
    url = running_service()
    if url is not None:
        events.info(f"ember serve runs here and serves the dashboard: {url}/ ; sign in to change jobs: "
                    f"{login_link(url, ensure_token())}", url=url)
        return 0
    if (other := announced("ui")) is not None:
        events.info(f"ember ui already runs here (PID {other['pid']}): {other['url']}/ ; sign in to change "
                    f"jobs: {login_link(other['url'], ensure_token())}", url=other["url"])
        return 0
    rules = load_rules()
    host = opt.host or rules.service.host
    port = rules.service.port if opt.port is None else opt.port
    d = serve_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    (d / "ui.json").unlink(missing_ok=True)  # a crashed one's: it names a server that is gone
    sock = listen(host, port, "ember ui ([service] host and port in owner.toml, or --host and --port)")
    token = ensure_token()
    loopback = is_loopback(host)
    announce_access(host, loopback, rules, events)
    app = create_app(None, token, loopback, None, opt.ledger, rules.service.max_body_bytes,
                     open_reads=rules.service.open_on_loopback)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=GRACE_SECONDS))
    threading.Thread(target=_announce, args=(server, host, d, events, "ui"), daemon=True).start()
    # uvicorn stops on SIGTERM or SIGINT, then raises the signal again with the handler it found:
    # the default one would end the process before ui.json is removed.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda _signum, _frame: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        withdraw("ui")
    return 0
