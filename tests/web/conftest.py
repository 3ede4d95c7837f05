"""One ledger for the dashboard's in-process tests: a real tiny run (trained here), a run with a
known spike, a run whose name is HTML, and a live run (its attempt is this process)."""

from __future__ import annotations

import os

import pytest
from fastapi.testclient import TestClient

from ember.events import Events
from ember.ledger import database as store
from ember.sched.owner_rules import OwnerRules
from ember.sched.service import Service
from ember.web.api import create_app
from tests.helpers import run_ember, warm_children_env, with_cpu_peak, write_recipe
from tests.web.runs import make_run

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="package")
def ledger_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("dash")
    ledger = base / "ledger.db"
    recipe = write_recipe(base / "recipe")
    r = run_ember("run", recipe, "--out", base / "runs" / "tiny", "--ledger", ledger, timeout=600)
    assert r.returncode == 0, r.stderr
    con = store.connect(ledger)
    ids = {
        "tiny": store.find_run(con, str(base / "runs" / "tiny"))["id"],
        "spiky": make_run(con, base / "runs" / "spiky", 2000, spike_at=1234),
        "html": make_run(con, base / "runs" / "html", 30, name='<script>alert("x")</script><b>'),
        "live": make_run(con, base / "runs" / "live", 10, completed=False),
    }
    con.close()
    return base, ledger, ids


@pytest.fixture
def service(ledger_dir, tmp_path, monkeypatch):
    base, ledger, _ = ledger_dir
    monkeypatch.setenv("EMBER_HOME", str(with_cpu_peak(tmp_path / "home")))
    for name, value in warm_children_env(dict(os.environ)).items():  # its jobs' training processes forked warm
        monkeypatch.setenv(name, value)
    rules = OwnerRules()
    rules.service.allowed = [str(base)]
    return Service(rules, "sim:2x1GiB", Events(), ledger)


@pytest.fixture
def client(service):
    """The dashboard's app with the token on every request, as the commands send it."""
    return TestClient(create_app(service, TOKEN, True, None), base_url="http://127.0.0.1", headers=AUTH)


@pytest.fixture
def anon(service):
    """The same app, asked without the token (the session, when a test signs in, is a cookie)."""
    return TestClient(create_app(service, TOKEN, True, None), base_url="http://127.0.0.1")
