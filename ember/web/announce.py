"""Where clients find a running `ember serve` or `ember ui`: serve.json / ui.json under
$EMBER_HOME/serve, and the service's token. Light on purpose: the commands that only talk HTTP to
the service (`ember queue`, `submit`, `logs`, ...) import this, not the service (ember.web.server),
so they start in a fraction of the time (bench/README.md, start-up)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ember.errors import EmberError
from ember.paths import home
from ember.sched.process import start_time


def serve_dir() -> Path:
    return home().serve


def token_path() -> Path:
    return home().serve_token


def announced(name: str) -> dict | None:
    """What NAME.json ("serve" or "ui") says, while the process that wrote it runs: the same PID
    *and* start time (a crashed server leaves its file; its PID may since name another process)."""
    try:
        info = json.loads((serve_dir() / f"{name}.json").read_text())
        pid, started = int(info["pid"]), info.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(info.get("url"), str):
        return None
    if started is None:  # written by an older ember, without the start time
        return info if start_time(pid) is not None else None
    return info if start_time(pid) == started else None


def withdraw(name: str) -> None:
    """Remove NAME.json at exit if it is this process's."""
    path = serve_dir() / f"{name}.json"
    try:
        ours = json.loads(path.read_text()).get("pid") == os.getpid()
    except (OSError, ValueError, AttributeError):
        return
    if ours:
        path.unlink(missing_ok=True)


def client_target() -> tuple[str, str]:
    """The running service's URL and token, for the commands that talk to it."""
    info = announced("serve")
    if info is None:
        raise EmberError(f"no service is running ({serve_dir() / 'serve.json'} is missing or names a process "
                         f"that has ended); start one with `ember serve` (or `systemctl --user start ember`)")
    try:
        token = token_path().read_text().strip()
    except OSError as e:
        raise EmberError(f"cannot read the service's token {token_path()}: {e}") from None
    return info["url"], token
