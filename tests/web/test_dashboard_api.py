"""The dashboard's JSON API in-process: every route answers what the library (and so the CLI)
answers, /metrics parses, the OpenAPI document validates, a fuzz pass from it finds no 5xx, and the pages are safe: escaped, no
inline script, a strict CSP, nothing outside the ledger's runs, changes only with token or
session and CSRF value."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import not_a_server_error

from ember.ledger import job_rows as job_rows
from ember.ledger import database as store
from ember.metrics.compare import compare_folders
from ember.metrics.listing import run_table
from ember.metrics.report import build_report
from ember.metrics.series import curves
from ember.web import security
from ember.web.api import create_app
from tests.web.conftest import AUTH, TOKEN
from tests.web.runs import loss_at, make_run, metrics_line


def same(api: object, library: object) -> None:
    """The API's JSON equals the library's dataclass, as JSON."""
    if is_dataclass(library):
        library = asdict(library)
    assert api == json.loads(json.dumps(library, default=str))


def test_runs_and_a_runs_report_are_the_librarys(client, ledger_dir):
    base, ledger, ids = ledger_dir
    con = store.connect(ledger)
    api, library = client.get("/api/runs").json(), [asdict(e) for e in run_table(con)]
    assert [e["id"] for e in api] == [e["id"] for e in library]
    # The live run's wall-clock (and so its goodput) grows between the two calls: the others are equal.
    same([e for e in api if e["status"] != "running"], [e for e in library if e["status"] != "running"])
    r = client.get("/api/runs", params={"status": "completed", "sort": "goodput", "desc": "true"}).json()
    assert [e["id"] for e in r] == [e.id for e in run_table(con, "completed", None, "goodput", True)]
    assert {e["id"] for e in r} == {ids["tiny"], ids["spiky"], ids["html"]}
    assert [e["id"] for e in client.get("/api/runs", params={"match": "SPIK"}).json()] == [ids["spiky"]]
    assert client.get("/api/runs", params={"sort": "nope"}).status_code == 400
    for name in ("tiny", "spiky"):
        report = client.get(f"/api/runs/{ids[name]}").json()
        same(report, build_report(base / "runs" / name, con))
    tiny = client.get(f"/api/runs/{ids['tiny']}").json()
    assert tiny["run"]["status"] == "completed" and tiny["run"]["steps"] == 24
    assert sum(tiny["step_histogram"]["counts"]) == tiny["step_time"]["count"] == 24
    assert client.get(f"/api/runs/{ids['tiny']}/record").json() == json.loads((base / "runs" / "tiny" / "run.json").read_text())


def test_curves_are_downsampled_on_the_server_keeping_the_spike(client, ledger_dir):
    base, _, ids = ledger_dir
    c = client.get(f"/api/runs/{ids['spiky']}/curves", params={"fields": "loss,lr", "buckets": 50}).json()
    same(c, curves(base / "runs" / "spiky", ids["spiky"], ("loss", "lr"), buckets=50))
    loss = c["curves"][0]
    assert c["points"] == 2000 and len(loss["steps"]) <= 100
    assert (1234, 40.0) in zip(loss["steps"], loss["values"])
    zoomed = client.get(f"/api/runs/{ids['spiky']}/curves", params={"fields": "loss", "start": 1200, "end": 1260}).json()
    assert zoomed["curves"][0]["steps"] == list(range(1200, 1261))  # the range, every step
    assert zoomed["curves"][0]["values"] == [loss_at(s, 1234) for s in range(1200, 1261)]
    assert client.get(f"/api/runs/{ids['spiky']}/curves", params={"fields": "secrets"}).status_code == 400
    assert client.get(f"/api/runs/{ids['spiky']}/curves", params={"buckets": 0}).status_code == 400  # not 422


def test_compare_machine_and_plan_are_the_librarys(client, ledger_dir):
    base, ledger, ids = ledger_dir
    c = client.get("/api/compare", params={"a": ids["tiny"], "b": ids["spiky"]}).json()
    same(c, compare_folders(base / "runs" / "tiny", base / "runs" / "spiky", 1e-3))
    assert c["verdict"] == "diverged" and "train.max_steps" in c["recipe_changes"]
    m = client.get("/api/machine").json()
    assert [d["name"] for d in m["devices"]] == ["sim:0", "sim:1"] and m["service"] is True
    devices = {d["use"]["device"] for d in m["capacity"]["devices"]}
    assert any(d.endswith("cpu") for d in devices)
    assert 0 < m["capacity"]["devices"][0]["use"]["duty_cycle"] <= 1
    assert client.get("/api/capacity", params={"since": "not a date"}).status_code == 400
    plan = client.get("/api/plan", params={"run": ids["tiny"], "device_memory": 4}).json()
    cli = json.loads(run_plan_cli(base / "runs" / "tiny", ledger))
    assert plan["memory"] == cli["memory"] and plan["recipe"] == cli["recipe"]
    assert plan["devices"][0]["free"] == 4 * 2**30 and plan["fits"] is True
    assert client.get("/api/plan").status_code == 400
    assert client.get("/api/plan", params={"job": "17"}).status_code == 404


def test_a_runs_diagnosis_is_the_doctors_newest(client, ledger_dir):
    from ember.doctor.diagnose import Figures, InputFigures, diagnose
    from ember.doctor.examine import DoctorReport, Headline, save_diagnosis, saved_diagnosis
    from markupsafe import escape

    from tests.doctor.test_diagnose import around, baseline, shape
    base, _, ids = ledger_dir
    figures = Figures(shape(), baseline(data=20, forward=2, backward=2.5, optimizer=0.5, checkpoint=0.5, other=0.5),
                      input=InputFigures(around(25.0), around(5.0, shift=4), 0.02, 50.0, 50.0, 2))
    findings = diagnose(figures)
    save_diagnosis(base / "runs" / "spiky", DoctorReport(Headline("run", 1.0, None, 0.02, 0.03, None), findings,
                                                         figures, None))
    got = client.get(f"/api/runs/{ids['spiky']}/diagnosis").json()
    assert got == saved_diagnosis(base / "runs" / "spiky") and got["findings"][0]["cause"] == "input-bound"
    page = client.get(f"/runs/{ids['spiky']}").text
    assert "The doctor's diagnosis" in page and str(escape(findings[0].remedy)) in page
    assert client.get(f"/api/runs/{ids['tiny']}/diagnosis").status_code == 404


def run_plan_cli(run: Path, ledger: Path) -> str:
    """`ember plan` of a run's recorded recipe, as a person would: the recipe written out, then the command."""
    from ember.recipe import to_toml
    from tests.helpers import run_ember
    recipe = run / "replan.toml"
    recipe.write_text(to_toml(json.loads((run / "run.json").read_text())["recipe"]))
    r = run_ember("plan", recipe, "--json", "--ledger", ledger, "--device-memory", "4")
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_metrics_exposes_the_ledgers_figures(client, ledger_dir, service):
    base, ledger, ids = ledger_dir
    job_rows.insert(service.con, "waiting", "/x.toml", str(base / "j"), [], 0, {"memory": 1}, "queued")
    before = build_report(base / "runs" / "live", store.connect(ledger)).goodput
    r = client.get("/metrics")
    after = build_report(base / "runs" / "live", store.connect(ledger)).goodput
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(r.text) for s in f.samples}
    tiny = ("run", ids["tiny"])
    assert samples[("ember_step_seconds_count", (tiny,))] == 24
    report = build_report(base / "runs" / "tiny", store.connect(ledger))
    assert abs(samples[("ember_tokens_per_second_per_device", (tiny,))]
               - report.throughput.tokens_per_second_per_device) < 1e-6
    assert samples[("ember_goodput_ratio", (tiny,))] == report.goodput.goodput
    assert samples[("ember_badput_seconds", (("bucket", "program_startup"), tiny))] == \
        report.goodput.buckets["program_startup"]
    assert samples[("ember_checkpoints_total", (tiny,))] == len(report.checkpoints)
    queued = service.con.execute("SELECT count(*) FROM jobs WHERE state = 'queued'").fetchone()[0]
    assert queued >= 1 and samples[("ember_jobs", (("state", "queued"),))] == queued
    assert samples[("ember_jobs", (("state", "running"),))] == 0
    # A live run's throughput is its current attempt's, read from the steps as they come.
    live = ("run", ids["live"])
    assert abs(samples[("ember_tokens_per_second_per_device", (live,))] - 128 / 0.02) < 1e-6
    # And its goodput so far, as `ember report` has it: its productive seconds over a wall-clock that
    # grows until the scrape, so between the report's before it and after it.
    assert after.goodput <= samples[("ember_goodput_ratio", (live,))] <= before.goodput < 1
    assert samples[("ember_badput_seconds", (("bucket", "program_startup"), live))] == \
        before.buckets["program_startup"] == 2.0


def test_the_openapi_document_validates_and_lists_every_json_route(client):
    spec = client.get("/openapi.json").json()
    validate(spec)
    paths = set(spec["paths"])
    assert {"/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/curves", "/api/runs/{run_id}/live",
            "/api/runs/{run_id}/record", "/api/runs/{run_id}/diagnosis", "/api/compare", "/api/machine",
            "/api/capacity", "/api/plan", "/metrics", "/api/jobs", "/api/jobs/{ref}/pause", "/api/jobs/{ref}/requeue",
            "/api/jobs/purge"} <= paths
    assert not any(p.startswith(("/runs", "/static", "/login")) for p in paths)  # pages are not the API


def test_live_steps_arrive_as_server_sent_events_until_the_run_ends(client, ledger_dir):
    base, ledger, ids = ledger_dir
    folder = base / "runs" / "live"
    offset = (folder / "metrics.jsonl").stat().st_size

    def train_on() -> None:
        time.sleep(1.5)
        with open(folder / "metrics.jsonl", "a") as f:
            for s in (11, 12):
                f.write(metrics_line(s, 1.5))
        time.sleep(1.5)
        con = store.connect(ledger)
        store.Ledger(con, ids["live"], 1, print).finish("completed")
        con.close()

    t = threading.Thread(target=train_on)
    t.start()
    with client.stream("GET", f"/api/runs/{ids['live']}/live", params={"offset": offset}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    t.join()
    events = [dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
              for block in text.split("\n\n") if block.strip()]
    steps = [s for e in events if e.get("event") == "steps" for s in json.loads(e["data"])]
    assert [(s["step"], s["loss"]) for s in steps] == [(11, 1.5), (12, 1.5)]
    assert events[-1]["event"] == "end"
    assert int([e for e in events if e.get("event") == "steps"][-1]["id"]) == (folder / "metrics.jsonl").stat().st_size


def test_a_step_whose_loss_is_not_finite_reaches_the_live_chart_as_a_gap(client, ledger_dir):
    """A step the stability guard skipped (loss NaN or inf, as json writes them into metrics.jsonl)
    broke the live stream: its steps were encoded with allow_nan=False, the generator raised at
    that step, and the browser, reconnecting from its last offset, met it again and again; the
    chart stopped for the rest of the run. Such a value is a gap (null) now, as the curves have it."""
    base, ledger, _ = ledger_dir
    folder = base / "runs" / "diverging"
    con = store.connect(ledger)
    run = make_run(con, folder, 3, completed=False)
    offset = (folder / "metrics.jsonl").stat().st_size
    with open(folder / "metrics.jsonl", "a") as f:
        for s, loss in ((4, float("nan")), (5, float("inf")), (6, 1.5)):
            f.write(metrics_line(s, loss))
    store.Ledger(con, run, 1, print).finish("completed")
    con.close()
    with client.stream("GET", f"/api/runs/{run}/live", params={"offset": offset}) as r:
        text = "".join(r.iter_text())
    events = [dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
              for block in text.split("\n\n") if block.strip()]
    steps = [s for e in events if e.get("event") == "steps" for s in json.loads(e["data"])]
    assert [(s["step"], s["loss"]) for s in steps] == [(4, None), (5, None), (6, 1.5)], text[-1000:]
    assert events[-1]["event"] == "end", text[-1000:]
    assert "NaN" not in text and "Infinity" not in text  # what JSON.parse in the page refuses


def page_is_strict(html: str) -> None:
    """No inline script or style, no event-handler attribute: the CSP would refuse them anyway."""
    for m in re.finditer(r"<script([^>]*)>(.*?)</script>", html, re.S):
        assert 'src="/static/' in m.group(1) and not m.group(2).strip(), m.group(0)
    assert not re.search(r"<style|\sstyle=|\son[a-z]+=", html, re.I)


def test_pages_escape_user_text_and_carry_a_strict_csp(client, ledger_dir):
    _, _, ids = ledger_dir
    pages = ["/runs", f"/runs/{ids['tiny']}", f"/runs/{ids['html']}", f"/runs/{ids['tiny']}?compare={ids['spiky']}",
             "/queue", "/machine", "/plan", "/login"]
    for path in pages:
        r = client.get(path)
        assert r.status_code == 200, (path, r.text[:300])
        assert r.headers["content-security-policy"].startswith("default-src 'none'; script-src 'self'")
        assert r.headers["x-frame-options"] == "DENY"
        page_is_strict(r.text)
    runs = client.get("/runs").text
    assert "<script>alert" not in runs and "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;&lt;b&gt;" in runs
    assert client.get("/api/runs").headers["content-security-policy"]


def test_nothing_outside_the_ledgers_runs_is_served(client, ledger_dir):
    base, _, ids = ledger_dir
    for path in [f"/api/runs/{base / 'runs' / 'tiny'}", "/api/runs/..%2F..%2Fetc%2Fpasswd", "/api/runs/%2Fetc",
                 f"/api/runs/{ids['tiny'][:6]}", "/runs/..%2Frun.json", "/static/..%2Fapi.py", "/static/%2e%2e/api.py",
                 "/static/../views.py", "/api/runs/%00/curves", f"/api/compare?a={ids['tiny']}&b=/etc"]:
        r = client.get(path)
        # An encoded separator or dot segment is refused before routing (400); the rest is not found.
        expected = (400,) if "%2f" in path.lower() or "%2e" in path.lower() else (404,)
        assert r.status_code in expected, (path, r.status_code, r.text[:200])
        assert "root:" not in r.text and "import" not in r.text
    assert client.get("/static/run.js").status_code == 200


def test_the_runs_page_sorts_every_run_and_shows_a_hundred_at_a_time(tmp_path):
    from fastapi.testclient import TestClient

    from tests.web.runs import make_run
    con = store.connect(tmp_path / "ledger.db")
    for i in range(230):
        make_run(con, tmp_path / "runs" / f"r{i:03d}", 3 + i % 7)
    ui = TestClient(create_app(None, TOKEN, True, None, tmp_path / "ledger.db"), base_url="http://127.0.0.1",
                    headers=AUTH)
    first = ui.get("/runs", params={"sort": "steps", "desc": "true"}).text
    rows = re.findall(r'<tr data-run="([^"]+)">', first)
    assert len(rows) == 100 and "1–100 of 230" in first and 'id="run-count">230<' in first
    by_steps = [e.id for e in run_table(con, None, None, "steps", True)]
    assert rows == by_steps[:100]
    last = ui.get("/runs", params={"sort": "steps", "desc": "true", "page": 3}).text
    assert re.findall(r'<tr data-run="([^"]+)">', last) == by_steps[200:] and "201–230 of 230" in last


def test_only_loopback_host_names_are_answered(client):
    assert client.get("/api/runs", headers={"host": "evil.example:8765"}).status_code == 421
    for host in ("localhost:8765", "127.0.0.1", "[::1]:8765", "127.0.0.5:1"):
        assert client.get("/api/runs", headers={"host": host}).status_code == 200, host


def test_changes_need_the_token_or_the_session_and_its_csrf_value(anon, service):
    job = job_rows.insert(service.con, "held", "/x.toml", "/tmp/x", [], 0, {"memory": 1}, "queued")
    pause = f"/api/jobs/{job.id}/pause"
    assert anon.get("/login", params={"token": "wrong"}).status_code == 401
    assert security.SESSION_COOKIE not in anon.cookies
    assert anon.post(pause, json={}).status_code == 401
    signed = anon.get("/login", params={"token": TOKEN}, follow_redirects=False)
    assert signed.status_code == 303
    cookie = signed.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and TOKEN not in cookie
    anon.cookies.set(security.SESSION_COOKIE, signed.cookies[security.SESSION_COOKIE])
    # The session alone is what a page of another site could make the browser send: refused.
    assert anon.post(pause, json={}).status_code == 401
    assert anon.post(pause, json={}, headers={security.CSRF_HEADER: "0" * 64}).status_code == 401
    csrf = re.search(r'name="ember-csrf" content="([0-9a-f]+)"', anon.get("/queue").text).group(1)
    r = anon.post(pause, json={}, headers={security.CSRF_HEADER: csrf})
    assert r.status_code == 200 and r.json()["hold"] == "user"
    anon.cookies.clear()
    assert 'content=""' in anon.get("/queue", headers=AUTH).text  # the token, no session: no CSRF value
    r = anon.post(f"/api/jobs/{job.id}/resume", headers=AUTH)  # the commands' way
    assert r.status_code == 200 and r.json()["hold"] is None


def test_the_queue_page_links_each_job_to_its_run_and_offers_requeue_for_a_failed_one(client, ledger_dir, service):
    """A job on the queue page named neither its run folder nor its run, and a failed job could
    only be submitted again (issue 24, item 12): its name now links to its run's page, its run
    folder is under it, and a failed one has a requeue button (and no pause, resume, cancel)."""
    base, _, ids = ledger_dir
    failed = job_rows.insert(service.con, "linked", "/x.toml", str(base / "runs" / "tiny"), [], 0, {"memory": 1},
                             "queued")
    assert job_rows.set_state(service.con, failed.id, "queued", "starting", "test", {})
    assert job_rows.set_state(service.con, failed.id, "starting", "failed", "test", {"cause": "exit 1"})
    fresh = job_rows.insert(service.con, "fresh", "/x.toml", str(base / "runs" / "fresh"), [], 0, {"memory": 1},
                            "queued")
    assert client.get("/api/jobs/linked").json()["run"] == ids["tiny"]
    html = client.get("/queue").text
    linked = re.search(rf'<tr data-job="{failed.id}">(.*?)</tr>', html, re.S).group(1)
    assert f'<a href="/runs/{ids["tiny"]}">linked</a><div class="sub">{base / "runs" / "tiny"}</div>' in linked, linked
    # a failed job: pause, resume and cancel shown off (requeue too here: this client is not signed in)
    assert re.findall(r'data-action="(\w+)"( disabled)?( title="the job is failed")?', linked) == [
        ("pause", " disabled", ' title="the job is failed"'), ("resume", " disabled", ' title="the job is failed"'),
        ("cancel", " disabled", ' title="the job is failed"'), ("requeue", " disabled", "")]
    waiting = re.search(rf'<tr data-job="{fresh.id}">(.*?)</tr>', html, re.S).group(1)
    assert "<a " not in waiting and str(base / "runs" / "fresh") in waiting  # no run yet: its folder, no link
    assert re.findall(r'data-action="(\w+)"', waiting) == ["pause", "resume", "cancel"]
    assert client.get(f"/runs/{ids['tiny']}").status_code == 200  # where the link goes


def test_ember_ui_without_a_service_serves_the_dashboard_alone(ledger_dir):
    from fastapi.testclient import TestClient
    _, ledger, ids = ledger_dir
    ui = TestClient(create_app(None, TOKEN, True, None, ledger), base_url="http://127.0.0.1", headers=AUTH)
    assert ids["tiny"] in ui.get("/runs").text
    assert "No service runs here" in ui.get("/queue").text
    assert ui.get("/api/jobs").status_code == 404 and ui.get("/api/machine").json()["service"] is False


# A fuzz pass over the service's JSON API from its own /openapi.json (schemathesis, driving
# hypothesis): whatever the request, the answer is never a 5xx. With the token, so every route is
# reached past the guard. /health and /v1 are left out: they answer 503 by design while inference
# is off. /api/yield too: with its body documented the fuzz releases a yield, which admits the
# ledger's queued jobs, and then yields again, which waits (up to 10 minutes) for them to leave
# the devices: the scheduler thread that would see them exit does not run here. Its bodies are
# checked in tests/web/test_errors.py and tests/sched/test_api.py. (Driven by hand, not by
# schemathesis' pytest plugin, which does not run under pytest 9.)
EXAMPLES = 20  # per operation


def with_real_runs(case, run_id):
    """Most cases name a run that exists (a finished one: a live run's stream lasts while it trains),
    so the fuzz reaches past the 404."""
    if run_id is not None:
        if case.path_parameters and "run_id" in case.path_parameters:
            case.path_parameters["run_id"] = run_id
        if case.query and "a" in case.query:
            case.query["a"] = run_id
    return case


def test_no_request_gets_a_server_error(service, ledger_dir):
    app = create_app(service, TOKEN, True, None)
    schema = schemathesis.openapi.from_dict(app.openapi())  # the document /openapi.json serves
    schema.app = app
    operations = [r.ok() for r in schema.exclude(path_regex=r"^/(health|v1|api/yield)").get_all_operations()]
    assert len(operations) >= 15
    seen: dict[str, set[int]] = {}
    for op in operations:
        @given(case=st.builds(with_real_runs, op.as_strategy(), st.sampled_from([None] + [v for k, v in ledger_dir[2].items() if k != "live"])))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            r = case.call_and_validate(headers={**AUTH, "host": "127.0.0.1"}, checks=[not_a_server_error])
            seen.setdefault(op.label, set()).add(r.status_code)
        check()
    assert len(seen) == len(operations), seen  # every operation was called
    assert 200 in seen["GET /api/runs/{run_id}/curves"] and 200 in seen["GET /api/runs/{run_id}"]


def test_plan_requests_run_one_plan_process_at_a_time_once_per_recipe(client, ledger_dir, monkeypatch):
    """Each GET /api/plan started a ~175 MB planning process: six at once for two questions now
    make two plans, one after the other (the real plan_json, counted as it is called)."""
    from ember.web import views as views_module
    _, _, ids = ledger_dir
    real, running, seen = views_module.plan_json, [0], []
    lock = threading.Lock()

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            seen.append(running[0])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1
    monkeypatch.setattr(views_module, "plan_json", counted)
    answers: list = []

    def ask(memory: float) -> None:
        answers.append(client.get("/api/plan", params={"run": ids["tiny"], "device_memory": memory}))
    threads = [threading.Thread(target=ask, args=(m,)) for m in (5, 6, 5, 6, 5, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert [r.status_code for r in answers] == [200] * 6, [r.text[:300] for r in answers]
    assert len(seen) == 2 and max(seen) == 1, seen  # two questions, never two processes at once
