"""serve.json and ui.json, where clients find a running `ember serve` or `ember ui`: trusted only
while the process that wrote them runs (PID and start time), removed when it stops, and never
left pointing at a server that is gone (real `ember ui` processes, stopped by PID)."""

from __future__ import annotations

import json
import os
import subprocess

from ember.ledger import database as store
from tests.helpers import ROOT, ember_cmd, wait_until
from tests.web.test_browser import Ui


def test_a_server_that_is_gone_is_not_announced(tmp_path):
    home, ledger = tmp_path / "home", tmp_path / "ledger.db"
    (home / "serve").mkdir(parents=True)
    store.connect(ledger).close()
    env = {**os.environ, "EMBER_HOME": str(home)}

    def ember(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(ember_cmd(*args), capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)

    # A service that died left its serve.json; its PID now names another process (this one).
    (home / "serve" / "serve.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": os.getpid(),
                                                           "start": "1", "host": "127.0.0.1", "port": 9}))
    r = ember("queue")
    assert r.returncode == 1 and "no service is running" in r.stderr, r.stderr
    ui = Ui(home, ledger)  # not sent to the dead service's dashboard: it serves its own
    try:
        info = json.loads((home / "serve" / "ui.json").read_text())
        assert info["pid"] == ui.proc.pid and info["url"] == ui.url
        r = ember("ui", "--port", "0")  # a second one says where the first is
        assert r.returncode == 0 and f"ember ui already runs here (PID {ui.proc.pid}): {ui.url}/" in r.stderr, r.stderr
    finally:
        ui.proc.kill()  # a crash: its ui.json stays behind, naming a process that is gone
        ui.proc.wait()
    assert json.loads((home / "serve" / "ui.json").read_text())["pid"] == ui.proc.pid
    again = Ui(home, ledger)  # the restart is not told that the crashed one still runs
    try:
        assert again.url != ui.url or again.proc.pid != ui.proc.pid
    finally:
        again.stop()
    wait_until("ui.json removed at a clean exit", lambda: not (home / "serve" / "ui.json").exists(), 30)
