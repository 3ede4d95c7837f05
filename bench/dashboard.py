"""The dashboard's three goals, measured against a real `ember ui` in Debian's Chromium (Playwright):

    run page, 100,000-step run: navigation start to the loss chart drawn     goal < 1 s
    /metrics with 100 runs in the ledger: one scrape (first, and warm)        goal < 100 ms
    runs page with 1,000 runs: navigation start to the page loaded            goal < 1 s
                               (filtered and sorted over all runs, shown 100 rows a page)

Runs are written as a training process writes them (tests/web/runs.py: run.json, metrics.jsonl
and the ledger's rows), since nobody trains 100,000 steps or 1,000 runs for a benchmark. Medians
of several rounds are printed with their range; nothing is asserted.

    python bench/dashboard.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ember.ledger import database as store  # noqa: E402
from tests.web.runs import make_run  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def start_ui(home: Path, ledger: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "ember", "ui", "--port", "0", "--ledger", str(ledger)],
                            env={**os.environ, "EMBER_HOME": str(home)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            info = json.loads((home / "serve" / "ui.json").read_text())
            if info["pid"] == proc.pid:
                return proc, info["url"]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("ember ui did not start")


def summary(name: str, values: list[float], goal: float, unit: str = "ms") -> None:
    med = statistics.median(values)
    print(f"{name}: median {med:.0f} {unit} (min {min(values):.0f}, max {max(values):.0f}, {len(values)} rounds); "
          f"goal < {goal:.0f} {unit}: {'met' if med < goal else 'NOT met'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    base = Path(tempfile.mkdtemp(prefix="ember-bench-dash-"))
    home = base / "home"
    home.mkdir()
    try:
        # 1. The run page of a 100,000-step run.
        ledger = base / "long.db"
        con = store.connect(ledger)
        t0 = time.perf_counter()
        long_id = make_run(con, base / "runs" / "long", 100_000, spike_at=77_777)
        print(f"wrote a 100,000-step run ({(base / 'runs' / 'long' / 'metrics.jsonl').stat().st_size / 1e6:.1f} MB "
              f"of metrics.jsonl) in {time.perf_counter() - t0:.1f} s", flush=True)
        con.close()
        proc, url = start_ui(home, ledger)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{url}/runs/{long_id}")  # the first visit: the server reads the run (cold)
            page.wait_for_selector("#charts[data-drawn]", timeout=60_000)
            print(f"run page of a 100,000-step run, first visit (the server reads 22 MB of metrics twice: the "
                  f"report, then the curves): {page.evaluate('window.ember.drawn'):.0f} ms", flush=True)
            drawn, server = [], []
            for _ in range(args.rounds):
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"{url}/runs/{long_id}")
                page.wait_for_selector("#charts[data-drawn]", timeout=60_000)
                drawn.append(page.evaluate("window.ember.drawn"))  # ms since navigation start
                page.close()
                t = time.perf_counter()
                httpx.get(f"{url}/api/runs/{long_id}/curves?fields=loss,lr,eval_loss&buckets=1228", timeout=60)
                server.append((time.perf_counter() - t) * 1000)
            summary("run page of a 100,000-step run, later visits, navigation to chart drawn", drawn, 1000)
            print(f"  of which the curves request alone (downsampling the columns kept from the first read): "
                  f"median {statistics.median(server):.0f} ms", flush=True)
            browser.close()
        proc.terminate()
        proc.wait(30)

        # 2. /metrics with 100 runs.
        ledger = base / "hundred.db"
        con = store.connect(ledger)
        for i in range(100):
            make_run(con, base / "runs100" / f"r{i:03d}", 1000, completed=i % 10 != 0)  # every tenth one live
        con.close()
        proc, url = start_ui(home, ledger)
        with httpx.Client(timeout=60) as client:
            t = time.perf_counter()
            first = client.get(f"{url}/metrics")
            cold = (time.perf_counter() - t) * 1000
            warm = []
            for _ in range(max(10, 4 * args.rounds)):
                t = time.perf_counter()
                client.get(f"{url}/metrics")
                warm.append((time.perf_counter() - t) * 1000)
        print(f"/metrics with 100 runs (10 live): first scrape {cold:.0f} ms (reads every metrics.jsonl), "
              f"{len(first.text.splitlines())} lines", flush=True)
        summary("/metrics with 100 runs, a later scrape", warm, 100)
        proc.terminate()
        proc.wait(30)

        # 3. The runs page with 1,000 runs.
        ledger = base / "thousand.db"
        con = store.connect(ledger)
        t0 = time.perf_counter()
        for i in range(1000):
            make_run(con, base / "runs1000" / f"r{i:04d}", 20)
        print(f"wrote 1,000 runs in {time.perf_counter() - t0:.1f} s", flush=True)
        con.close()
        proc, url = start_ui(home, ledger)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            loaded = []
            page = browser.new_page()
            page.goto(f"{url}/runs")  # warm-up
            for _ in range(args.rounds):
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"{url}/runs?sort=goodput&desc=true", wait_until="load")
                assert page.locator("#run-count").inner_text() == "1000"
                loaded.append(page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd"))
                page.close()
            summary("runs page with 1,000 runs (sorted by goodput over all 1,000, 100 rows a page), navigation "
                    "to loaded", loaded, 1000)
            browser.close()
        proc.terminate()
        proc.wait(30)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
