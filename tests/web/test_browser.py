"""The dashboard in a real browser: Debian's Chromium, driven by Playwright, against a real
`ember ui` and a real `ember serve` (child processes, stopped by PID).

Runs and Run pages: the chart's drawn data is the server's downsampled curve, with the run's
spike in it and on the canvas where it should be; zooming asks the server for the finer steps;
a run that trains is drawn as its steps arrive (server-sent events) until it ends.
Run page: the step-time histogram's bars are as tall as their counts, the axes' ticks differ,
the slow steps are said at the top. Queue page: a queued job is held, released, resumed (it
starts), paused, resumed and cancelled with the page's buttons (and `ember resume`), each change
seen in the page; finished jobs' buttons are off and a failed job's note says why and where its
output is; a cancelled job is requeued, and its name links to its run. Every page is screenshotted
into .artifacts/dashboard/ (printed), and no page logs an error (a CSP refusal included)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ember.ledger import database as store
from tests.helpers import ROOT, ember_cmd, write_recipe
from tests.serve_harness import Serve
from tests.web.runs import loss_at, make_run, metrics_line

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
UNAVAILABLE = ROOT / ".venv" / "chromium-unavailable"  # why `make` could not install it
SHOTS = ROOT / ".artifacts" / "dashboard"
SPIKE = 31_337


def browser_or_skip():
    """Playwright's Chromium: Debian's, since Playwright cannot download its own here."""
    if not os.path.exists(CHROMIUM):
        why = UNAVAILABLE.read_text().strip() if UNAVAILABLE.exists() else "`make` installs it as root (apt)"
        pytest.skip(f"no Chromium at {CHROMIUM}: {why}")
    from playwright.sync_api import sync_playwright
    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
    return pw, browser


@pytest.fixture(scope="module")
def chromium():
    pw, browser = browser_or_skip()
    SHOTS.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots of the dashboard's pages: {SHOTS}")
    yield browser
    browser.close()
    pw.stop()


def open_page(browser, errors: list[str]):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(90_000)  # the Plan page plans in a child process: seconds on a busy machine
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page


def shoot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


class Ui:
    """`ember ui` in a child process over a ledger, stopped by its PID."""

    def __init__(self, home: Path, ledger: Path):
        self.home = home
        env = {**os.environ, "EMBER_HOME": str(home)}
        self.proc = subprocess.Popen(ember_cmd("ui", "--port", "0", "--ledger", ledger), env=env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                info = json.loads((home / "serve" / "ui.json").read_text())
                if info["pid"] == self.proc.pid:
                    self.url = info["url"]
                    self.login = f"{self.url}/login?token={(home / 'serve' / 'token').read_text().strip()}"
                    return
            except (OSError, ValueError, KeyError):
                pass
            assert self.proc.poll() is None, self.proc.stderr.read()
            time.sleep(0.1)
        raise AssertionError("ember ui did not start")

    def stop(self) -> str:
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def test_runs_and_run_pages_draw_the_servers_curves(chromium, tmp_path):
    home, ledger = tmp_path / "home", tmp_path / "ledger.db"
    home.mkdir()
    con = store.connect(ledger)
    spiky = make_run(con, tmp_path / "runs" / "long", 100_000, spike_at=SPIKE)
    other = make_run(con, tmp_path / "runs" / "short", 3000)
    for i in range(20):
        make_run(con, tmp_path / "runs" / f"r{i:02d}", 50 + i)
    growing = make_run(con, tmp_path / "runs" / "growing", 100, completed=False)  # its attempt: this process
    con.close()
    ui = Ui(home, ledger)
    errors: list[str] = []
    try:
        page = open_page(chromium, errors)
        page.goto(f"{ui.url}/runs")  # not signed in: the sign-in page
        assert page.url == f"{ui.url}/login" and page.locator("input[name=token]").count() == 1
        page.goto(ui.login)  # the link `ember ui` prints; then the runs
        assert page.url == f"{ui.url}/runs"
        assert page.locator("#run-count").inner_text() == "23"
        shoot(page, "runs")
        page.click(f"a[href='/runs/{spiky}']")
        page.wait_for_selector("#charts[data-drawn]", timeout=30_000)
        shoot(page, "run")
        drawn = page.evaluate("""() => {
            const u = window.ember.charts.loss, c = window.ember.curves;
            const i = u.data[0].indexOf(%d);
            const x = Math.round(u.valToPos(%d, 'x', true)), y = Math.round(u.valToPos(40, 'y', true));
            const px = u.ctx.getImageData(x - 2, y - 2, 5, 5).data;
            let blue = 0;
            for (let k = 0; k < px.length; k += 4) if (px[k + 2] > 150 && px[k] < 120 && px[k + 3] > 100) blue++;
            return {steps: u.data[0], loss: u.data[1], at: i, y: i >= 0 ? u.data[1][i] : null, blue,
                    buckets: c.buckets, points: c.points};
        }""" % (SPIKE, SPIKE))
        assert drawn["points"] == 100_000 and len(drawn["steps"]) <= 2 * drawn["buckets"] < 100_000
        assert drawn["y"] == 40.0, "the spike is in the drawn data"
        assert drawn["blue"] > 0, "and drawn where it belongs on the canvas"
        api = page.evaluate(f"fetch('/api/runs/{spiky}/curves?fields=loss&buckets={drawn['buckets']}').then(r => r.json())")
        assert drawn["steps"] == api["curves"][0]["steps"] and drawn["loss"] == api["curves"][0]["values"]
        assert all(v == loss_at(s, SPIKE) for s, v in zip(drawn["steps"][:200], drawn["loss"][:200]))
        # Zoom: drag across a tenth of the chart; the server sends that range's finer steps.
        box = page.locator("#loss-chart .u-over").bounding_box()
        y = box["y"] + box["height"] / 2
        page.mouse.move(box["x"] + box["width"] * 0.30, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.32, y, steps=5)
        page.mouse.up()
        page.wait_for_function("() => window.ember.zoom !== null && document.querySelector('#charts').dataset.drawn > '1'")
        zoomed = page.evaluate("() => ({steps: window.ember.charts.loss.data[0], zoom: window.ember.zoom})")
        lo, hi = zoomed["zoom"]
        assert 25_000 < lo < hi < 40_000 and hi - lo < 5000
        assert zoomed["steps"] == list(range(math.floor(lo), math.ceil(hi) + 1))  # every step of the range
        page.dblclick("#loss-chart .u-over")
        page.wait_for_function("() => window.ember.zoom === null")
        # Compare with another run: both loss curves on one chart, and the differences listed.
        page.goto(f"{ui.url}/runs/{spiky}?compare={other}")
        page.wait_for_selector("#charts[data-drawn]", timeout=30_000)
        series = page.evaluate("() => window.ember.charts.loss.series.map(s => s.label)")
        assert series[-1] == f"loss of {other}" and "train.max_steps" in page.inner_text("#differences")
        page.goto(f"{ui.url}/machine")
        shoot(page, "machine")
        page.goto(f"{ui.url}/plan?run={other}&device_memory=8")
        assert page.locator("#verdict").count() == 1, page.inner_text("main")
        shoot(page, "plan")
        page.goto(f"{ui.url}/queue")
        assert "No service runs here" in page.inner_text("#no-service")
        # A run that trains: its steps arrive over server-sent events and are drawn as they come.
        page.goto(f"{ui.url}/runs/{growing}")
        page.wait_for_selector("#charts[data-drawn]")
        assert page.evaluate("() => window.ember.charts.loss.data[0].length") == 100
        with open(tmp_path / "runs" / "growing" / "metrics.jsonl", "a") as f:
            f.write("".join(metrics_line(s, 1.25) for s in range(101, 131)))
        page.wait_for_function("() => window.ember.curves.last_step === 130", timeout=20_000)
        drawn = page.evaluate("() => { const d = window.ember.charts.loss.data; return [d[0].slice(-30), d[1].slice(-30)]; }")
        assert drawn == [list(range(101, 131)), [1.25] * 30] and page.inner_text("#run-step") == "130"
        con = store.connect(ledger)
        store.Ledger(con, growing, 1, print).finish("completed")
        con.close()
        page.wait_for_selector("#live:has-text('finished')", timeout=20_000)
    finally:
        ui.stop()
    assert not errors, errors


def test_the_run_page_draws_its_step_histogram_lr_ticks_and_slow_step_warning(chromium, tmp_path):
    home, ledger = tmp_path / "home", tmp_path / "ledger.db"
    home.mkdir()
    con = store.connect(ledger)
    run = make_run(con, tmp_path / "runs" / "lr", 300)
    con.close()
    # A learning rate as a fine-tune has it: linear warm-up to 1e-4 over 30 steps, then cosine to
    # 0; and one step ten times the others.
    metrics = tmp_path / "runs" / "lr" / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in steps:
        s = r["step"]
        r["lr"] = 1e-4 * s / 30 if s <= 30 else 0.5e-4 * (1 + math.cos(math.pi * (s - 30) / 270))
        r["step_seconds"] = 0.2 if s == 150 else r["step_seconds"]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in steps))
    ui = Ui(home, ledger)
    errors: list[str] = []
    try:
        page = open_page(chromium, errors)
        page.goto(ui.login)
        page.goto(f"{ui.url}/runs/{run}")
        page.wait_for_selector("#charts[data-drawn]", timeout=30_000)
        shoot(page, "run-histogram")
        # Each bar of the step-time histogram is as tall as its count says (150 px for the largest).
        counts = page.evaluate(f"fetch('/api/runs/{run}').then(r => r.json())")["step_histogram"]["counts"]
        bars = page.locator("#step-histogram rect.bar")
        heights = [bars.nth(i).bounding_box()["height"] for i in range(bars.count())]
        assert len(heights) == len(counts) and max(heights) > 140
        assert all(abs(h - 150 * c / max(counts)) < 1.5 for h, c in zip(heights, counts)), (heights, counts)
        # The learning-rate axis: every tick says a different number.
        for chart in ("lr", "loss"):
            ticks = page.evaluate(f"() => window.ember.charts.{chart}.axes[1]._values")
            assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), (chart, ticks)
        # The slow steps, as `ember report` lists them as stalls, said at the top of the page.
        warning = page.locator("#slow-steps")
        assert warning.is_visible() and warning.bounding_box()["y"] < page.locator("#charts").bounding_box()["y"]
        text = warning.inner_text()
        assert text.startswith("4 slow steps") and "step 150, took 200.0 ms (10.0× median)" in text, text
    finally:
        ui.stop()
    assert not errors, errors


OWNER = """
[service]
allowed = ["{root}"]
[inference]
enabled = false
"""


def finished_jobs(ledger: Path, recipe: Path, root: Path) -> dict[str, int]:
    """A job that failed while a hand's soft pause was on it, and one that completed, in the ledger
    as the service records them (a real failure takes four supervised attempts: minutes here)."""
    from ember.ledger import job_rows as rows
    from ember.ledger.job_states import move
    con = store.connect(ledger)
    try:
        failed = rows.insert(con, "broken", str(recipe), str(root / "broken"), [], 0, {"memory": 1, "max_steps": 24},
                             "running")
        move(con, failed, "failed", "gave up", cause="error: [data] files: /data/x.jsonl does not exist",
             pause="user")
        done = rows.insert(con, "done", str(recipe), str(root / "done"), [], 0, {"memory": 1, "max_steps": 24},
                           "running")
        move(con, done, "completed", "finished")
        return {"broken": failed.id, "done": done.id}
    finally:
        con.close()


def test_queue_page_holds_resumes_pauses_and_cancels_a_job(chromium, tmp_path):
    recipe = write_recipe(tmp_path / "recipe", train={"max_steps": 5000}, checkpoint={"every_steps": 100})
    s = Serve(tmp_path / "home", OWNER.format(root=tmp_path), "sim:1x64MiB")
    finished = finished_jobs(s.home / "ledger.db", recipe, tmp_path)
    s.start()
    errors: list[str] = []
    try:
        r = s.cli("ui")  # a service runs: `ember ui` says where its dashboard is and how to sign in
        assert r.returncode == 0 and f"{s.url}/login?token={s.token}" in r.stderr, r.stderr
        page = open_page(chromium, errors)
        page.goto(f"{s.url}/login?token={s.token}")  # the link `ember ui` printed
        page.goto(f"{s.url}/queue")
        page.fill("#yield-minutes", "30")
        page.click("#yield")
        page.wait_for_selector("#queue-message:has-text('devices free after')")
        # Submitted from the recipe's folder (the service's is another): the path is the client's.
        r = subprocess.run(ember_cmd("submit", "recipe.toml", "--name", "browser"), cwd=recipe.parent,
                           env={**s.env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        job = int(r.stdout.split()[1])
        row = f"#jobs tr[data-job='{job}']"

        def wait_state(state: str, timeout: float = 90_000) -> None:
            page.wait_for_selector(f"{row} td.state:text-is('{state}')", timeout=timeout)

        wait_state("queued")
        page.click(f"{row} button[data-action=pause]")
        page.wait_for_selector(f"{row} td.note:has-text('held: user')")
        page.click("#release")
        page.wait_for_selector("#queue-message:has-text('yield released')")
        time.sleep(2.5)  # a scheduler tick or more: the hand's hold still keeps it queued
        page.wait_for_selector(f"{row} td.note:has-text('held: user')")
        wait_state("queued")
        shoot(page, "queue")
        page.click(f"{row} button[data-action=resume]")
        wait_state("running")
        # A change is answered once the job's process took it: the page and `ember resume` say the new state.
        page.click(f"{row} button[data-action=pause]")
        page.wait_for_selector(f"#queue-message:has-text('job {job} browser: soft-paused')")
        r = s.cli("resume", "browser")
        assert r.returncode == 0 and r.stdout.strip() == f"job {job} browser: running", r.stdout + r.stderr
        wait_state("running")
        page.click(f"{row} button[data-action=cancel]")
        wait_state("cancelled")
        history = [(t["to_state"], t["hold"]) for t in transitions(s.home, job)]
        # Held by hand while queued, and lifted: transitions of their own (ageing skips the hold).
        assert history[:4] == [("queued", None), ("queued", "user"), ("queued", None), ("starting", None)], history
        states = [state for state, _ in history]
        assert "soft-paused" in states and states[-1] == "cancelled", history
        # Finished jobs take no pause, resume or cancel: those buttons are off, as rendered and as
        # refreshed, and the API refuses them (409); a failed or cancelled job offers requeue, a
        # completed one nothing more; a failed job's note says why it failed and where its output is.
        log = s.home / "serve" / "jobs" / f"{finished['broken']}.log"
        why = f"failed: error: [data] files: /data/x.jsonl does not exist; its output: {log} (ember logs broken)"
        for fresh in (True, False):
            if fresh:
                page.reload()
            else:
                seen = page.evaluate("() => document.querySelector('#jobs').dataset.refreshed || ''")
                page.wait_for_function(f"() => (document.querySelector('#jobs').dataset.refreshed || '') > '{seen}'")
            for j in (finished["broken"], finished["done"], job):
                buttons = page.locator(f"#jobs tr[data-job='{j}'] button")
                texts = buttons.all_inner_texts()
                again = [] if j == finished["done"] else ["requeue"]
                assert texts == ["pause", "resume", "cancel", *again], (j, fresh, texts)
                assert [buttons.nth(i).is_disabled() for i in range(len(texts))] == [True] * 3 + [False] * len(again)
            assert page.inner_text(f"#jobs tr[data-job='{finished['broken']}'] td.note") == why
        for j in finished.values():
            r = s.api("POST", f"/api/jobs/{j}/resume")
            assert r.status_code == 409 and "nothing to resume" in r.json()["error"]["message"]
        # Its name links to its run's page; cancelled, requeue resumes the same run.
        run = s.jobs()["browser"]["run"]
        assert run and page.get_attribute(f"{row} td.run a", "href") == f"/runs/{run}"
        page.click(f"{row} button[data-action=requeue]")
        wait_state("running")
        states = [t["to_state"] for t in transitions(s.home, job)]
        assert states[states.index("cancelled"):][:3] == ["cancelled", "queued", "starting"], states
    finally:
        s.stop()
    assert not errors, errors


def test_queue_page_shows_an_owner_toml_that_does_not_validate_as_it_happens(chromium, tmp_path):
    """owner.toml that did not validate showed only in the service's log (issue 24, item 10): the
    Queue page reads /api/owner with the queue, so the error appears without reloading the page,
    and goes once the file is fixed."""
    s = Serve(tmp_path / "home", OWNER.format(root=tmp_path)).start()
    errors: list[str] = []
    try:
        page = open_page(chromium, errors)
        page.goto(f"{s.url}/login?token={s.token}")
        page.goto(f"{s.url}/queue")
        assert page.inner_text("#owner-rules") == ""
        (s.home / "owner.toml").write_text(OWNER.format(root=tmp_path) + "[cpu]\nmax_other_load = 2\n")
        page.wait_for_selector("#owner-rules p.error:has-text('does not validate')")
        assert "[cpu] max_other_load = 2.0: must be <= 1" in page.inner_text("#owner-rules")
        shoot(page, "queue-owner-error")
        (s.home / "owner.toml").write_text(OWNER.format(root=tmp_path))
        page.wait_for_selector("#owner-rules p", state="detached")
    finally:
        s.stop()
    assert not errors, errors


def transitions(home: Path, job: int) -> list:
    con = store.connect(home / "ledger.db")
    try:
        from ember.ledger.job_rows import transitions as rows
        return [dict(r) for r in rows(con, job)]
    finally:
        con.close()
