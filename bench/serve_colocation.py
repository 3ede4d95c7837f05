"""Inference beside training under `ember serve`: one request trace against an idle machine and
against one training in the background, for each engine, measured in the same run.

Goals (serve issue): inference p99 within 1.2x of the idle machine's p99; training keeps at least
90% of (1 - inference busy share) x its solo throughput; yield p99 (request to device free) under
one training step; scheduler overhead per job under 1 s. Figures are printed, never asserted.

    engine builtin   the service's own engine ([inference] model, default builtin:tiny)
    engine llama     llama.cpp's server (llama-cpp-python) on SmolLM2-135M, as [inference] upstream

Per engine, a fresh service in a temp EMBER_HOME (loopback only) and one training job on the
inference device (builtin tiny model, 1 thread, seq 256 x micro batch 8). The trace (Poisson
arrivals, seeded prompts, streamed completions) is cut into blocks; each block runs twice, on
the idle machine (the job soft-paused by hand: its process sleeps) and with the job training,
alternating which goes first, so both see the same drift of this shared machine. Training alone
(no requests) is measured in a window before each block and after the last. The yield is timed
from the job's control files (ember.control), which the service writes and the job answers.
Then, on a service with inference off, short jobs of one recipe submitted one after another:
the scheduler's overhead.

usage: python bench/serve_colocation.py [--engine builtin|llama|both] [--requests 200] [--rate 0.5]
           [--max-tokens 16] [--seed 0] [--idle-gap 2.0] [--model SPEC] [--blocks 4]
           [--solo-seconds 10] [--jobs 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402

from ember.models import resolve_path  # noqa: E402
from ember.proc import dies_with_us  # noqa: E402
from ember.web.security import WORKER_TOKEN_ENV  # noqa: E402
from tests.helpers import GENESIS, write_recipe  # noqa: E402
from tests.serve_harness import Serve  # noqa: E402

REQUEST_TIMEOUT = 120.0   # seconds a request may take, whole, before it counts as failed
# One client for every request: a new httpx client costs ~50 ms here (it loads CA certificates),
# which would count as latency. Thread-safe; its pool is as large as the trace's thread pool.
HTTP = httpx.Client(timeout=REQUEST_TIMEOUT, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
TRAIN = {"train": {"max_steps": 1_000_000, "micro_batch": 8, "threads": 1},
         "data": {"seq_len": 256}, "checkpoint": {"every_steps": 1000, "keep_last": 1}}


@dataclass
class Result:
    start: float            # time.time() when sent
    ttft: float | None      # seconds to the first chunk carrying text
    end: float
    tokens: int             # completion tokens (the usage chunk; else chunks that carried text)
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


def q(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in [0, 1]); nan for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p * len(xs) + 0.5) - 1))] if xs else float("nan")


def make_trace(n: int, rate: float, seed: int) -> list[tuple[float, str]]:
    """n (arrival offset in seconds, prompt): exponential gaps, prompts cut from Genesis."""
    rng = random.Random(seed)
    words = json.loads(GENESIS.read_text().splitlines()[0])["text"].split()
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        i = rng.randrange(len(words) - 12)
        out.append((t, " ".join(words[i:i + rng.randint(4, 12)])))
    return out


def one(url: str, prompt: str, max_tokens: int, auth: dict[str, str] | None = None) -> Result:
    """One streamed completion, bounded by REQUEST_TIMEOUT (`auth`: the service's token; the
    engine behind it takes requests without one)."""
    start = time.time()
    first, tokens = None, 0
    body = {"model": "base", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    try:
        with HTTP.stream("POST", url + "/v1/completions", json=body, headers=auth) as r:
            if r.status_code != 200:
                return Result(start, None, time.time(), 0, f"HTTP {r.status_code}: {r.read()[:200]!r}")
            for line in r.iter_lines():
                if time.time() - start > REQUEST_TIMEOUT:
                    return Result(start, None, time.time(), tokens, "timed out")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(start, None, time.time(), tokens, str(chunk["error"])[:200])
                usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
                if any(c.get("text") for c in chunk.get("choices", [])):
                    tokens += 1
                    first = first or time.time() - start
    except httpx.HTTPError as e:
        return Result(start, None, time.time(), tokens, f"{type(e).__name__}: {e}")
    return Result(start, first, time.time(), tokens if usage is None else usage)


def run_trace(url: str, trace: list[tuple[float, str]], max_tokens: int,
              auth: dict[str, str] | None = None) -> list[Result]:
    """Open loop: each request leaves at its arrival time whether or not earlier ones finished."""
    with ThreadPoolExecutor(64) as pool:
        t0 = time.perf_counter()
        futures = []
        for at, prompt in trace:
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            futures.append(pool.submit(one, url, prompt, max_tokens, auth))
        return [f.result() for f in futures]


def union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the intervals."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if cur_b is None or a > cur_b:
            total += (cur_b - cur_a) if cur_b is not None else 0.0
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + ((cur_b - cur_a) if cur_b is not None else 0.0)


class ControlWatch:
    """Polls the job's control.json / control.ack (ember.control) every 5 ms: when each pause
    was asked and when the training process acknowledged it, to time the yield ourselves."""

    def __init__(self, run: Path):
        self.run, self.asked, self.acked = run, {}, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def poll(self) -> None:
        while not self.stop.wait(0.005):
            for name, into in (("control.json", self.asked), ("control.ack", self.acked)):
                try:
                    d = json.loads((self.run / name).read_text())
                except (OSError, ValueError):
                    continue
                key = (d.get("seq"), d.get("pause", d.get("state")))
                into.setdefault(key, d.get("time"))

    def yields(self, sends: list[float]) -> list[tuple[float, float]]:
        """Per pause asked for inference: (send -> pause asked, pause asked -> acknowledged), the
        send being that of the request that caused it (the last one sent before it was asked)."""
        out = []
        for (seq, what), at in self.asked.items():
            acked = self.acked.get((seq, "paused"))
            before = [s for s in sends if s <= at]
            if what == "inference" and acked is not None and before:
                out.append((at - before[-1], acked - at))
        return out


def steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def throughput(rows: list[dict], lo: float, hi: float) -> float:
    """Tokens/s of the steps that ended in [lo, hi]."""
    return sum(r["tokens"] for r in rows if lo <= r["time"] <= hi) / (hi - lo)


@contextmanager
def llama_engine(work: Path) -> Iterator[str]:
    """llama-cpp-python's server on SmolLM2 (where tests.engines finds it), its process group
    stopped on exit. `--interrupt_requests False`: by default it cuts a streamed answer short
    (sends [DONE], drops the connection) as soon as another request waits; llama.cpp's own
    llama-server queues them instead. One thread for prompts too (its default is every core):
    with two threads on two cores and anything else running, its threads wait for each other
    and a prompt took up to 0.65 s a token."""
    from tests.engines import SMOLLM2_GGUF, _stop_group, free_port
    url = f"http://127.0.0.1:{free_port()}"
    with open(work / "llama-server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(resolve_path(SMOLLM2_GGUF)),
                                 "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
                                 "--interrupt_requests", "False", "--n_threads", "1", "--n_threads_batch", "1"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=dies_with_us())  # a killed bench leaves no server behind
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # still loading the model
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama_cpp.server did not start; see {work / 'llama-server.log'}")
            time.sleep(0.2)
        yield url
    finally:
        _stop_group(proc)


def start_service(work: Path, name: str, inference: str, idle_gap: float) -> Serve:
    owner = f'[service]\nallowed = ["{work}"]\n[inference]\n{inference}\nidle_gap_seconds = {idle_gap}\n'
    s = Serve(work / name, owner).start()
    s.engine_proc = None
    if "enabled = false" in inference:
        return s
    deadline = time.monotonic() + 900  # a GGUF converts once on first load
    while True:
        try:
            if httpx.get(s.url + "/health", timeout=10, headers=s.auth).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or s.proc.poll() is not None:
            s.stop()
            raise RuntimeError(f"the service's engine did not become ready:\n{s.output()[-2000:]}")
        time.sleep(0.2)
    m = re.search(r"built-in engine .* PID (\d+)", s.output())
    if m:  # the service stops its worker; we check at the end that it did
        try:
            s.engine_proc = psutil.Process(int(m.group(1)))
        except psutil.Error:
            pass
    return s


def stop_service(s: Serve) -> None:
    s.stop()
    if s.engine_proc is not None and s.engine_proc.is_running():  # psutil checks the start time
        s.engine_proc.kill()


def engine_auth(s: Serve) -> dict[str, str] | None:
    """The header the engine behind the service wants: the built-in worker answers only requests
    carrying the token the service gave it in its environment (read here from the worker, the
    service's own descendant); llama.cpp's server wants none."""
    for child in psutil.Process(s.proc.pid).children(recursive=True):
        try:
            token = child.environ().get(WORKER_TOKEN_ENV)
        except psutil.Error:
            continue
        if token:
            return {"Authorization": f"Bearer {token}"}
    return None


def proxy_cost(service: Serve, engine: str, trace: list[tuple[float, str]], max_tokens: int, k: int = 11) -> dict:
    """One request at a time, alternating straight to the engine and through the service; each
    of k prompts (k odd) once each way, never the same prompt twice in a row (llama.cpp reuses
    the cache of the prompt it has just seen)."""
    direct, via, auth = [], [], engine_auth(service)
    k = min(k, len(trace) - (len(trace) + 1) % 2)  # a short trace: as many prompts as it has, k odd
    for i in range(2 * k):
        prompt = trace[i % k][1]
        if i % 2:
            via.append(one(service.url, prompt, max_tokens, service.auth))
        else:
            direct.append(one(engine, prompt, max_tokens, auth))
    failed = [(name, r.error) for name, rs in (("direct", direct), ("via", via)) for r in rs if r.error]
    assert not failed, f"requests failed, so their latency would be the error's: {failed[:3]}"
    return {name: (statistics.median(r.latency for r in rs), statistics.median(r.ttft or math.nan for r in rs))
            for name, rs in (("direct", direct), ("via", via))}


def summarize(runs: list[list[Result]]) -> dict:
    """Latency and TTFT percentiles over every block; busy share: the time some request was in
    flight over the blocks' spans (first sent to last answered)."""
    results = [r for run in runs for r in run]
    ok = [r for r in results if r.error is None]
    spans = [(min(r.start for r in run), max(r.end for r in run)) for run in runs]
    return {"n": len(results), "ok": len(ok), "errors": sorted({r.error for r in results if r.error})[:3],
            "p50": q([r.latency for r in ok], 0.5), "p99": q([r.latency for r in ok], 0.99),
            "ttft50": q([r.ttft for r in ok if r.ttft is not None], 0.5),
            "ttft99": q([r.ttft for r in ok if r.ttft is not None], 0.99),
            "tokens": statistics.mean(r.tokens for r in ok) if ok else 0.0,
            "busy": sum(union([(r.start, r.end) for r in run], lo, hi) for run, (lo, hi) in zip(runs, spans))
                    / sum(hi - lo for lo, hi in spans)}


def blocks(trace: list[tuple[float, str]], n: int) -> list[list[tuple[float, str]]]:
    """The trace cut into n consecutive blocks, each starting at its first arrival."""
    size = math.ceil(len(trace) / n)
    parts = [trace[i:i + size] for i in range(0, len(trace), size)]
    return [[(t - part[0][0], prompt) for t, prompt in part] for part in parts]


def bench_engine(engine: str, inference: str, work: Path, trace, args) -> dict:
    """The trace in blocks, each run twice, alternating which goes first: with the training job
    soft-paused by hand (the idle machine) and with it training; a solo window of training
    (no requests) before each block and after the last."""
    s = start_service(work, engine, inference, args.idle_gap)
    try:
        for _, prompt in trace[:3]:  # warm-up, not counted
            one(s.url, prompt, args.max_tokens, s.auth)
        print(f"[{engine}] engine ready; through the service and straight to it, one at a time", flush=True)
        proxy = proxy_cost(s, s.api("GET", "/api/stats").json()["engine"], trace, args.max_tokens)
        recipe = write_recipe(work / f"recipe-{engine}", **TRAIN)
        r = s.api("POST", "/api/jobs", {"recipe": str(recipe), "name": "train"})
        assert r.status_code == 201, r.text
        s.wait(lambda j: j["train"]["state"] == "running" and j["train"]["step"] >= 5, timeout=300)
        job = s.jobs()["train"]
        watch = ControlWatch(s.home / "serve" / "control" / str(job["id"]))
        watch.thread.start()
        idle, busy, solo, windows = [], [], [], []
        for b, block in enumerate(blocks(trace, args.blocks)):
            solo.append(solo_window(s, args))
            print(f"[{engine}] block {b + 1}/{args.blocks}: {len(block)} requests, idle and with training",
                  flush=True)
            for mode in ("idle", "training") if b % 2 == 0 else ("training", "idle"):
                if mode == "idle":
                    assert s.api("POST", "/api/jobs/train/pause", {}).status_code == 200
                    s.wait(lambda j: j["train"]["state"] == "soft-paused")
                    idle.append(run_trace(s.url, block, args.max_tokens, s.auth))
                    time.sleep(args.idle_gap + 0.5)  # the inference pause would follow the hand's
                    assert s.api("POST", "/api/jobs/train/resume", {}).status_code == 200
                    s.wait(lambda j: j["train"]["state"] == "running")
                else:
                    results = run_trace(s.url, block, args.max_tokens, s.auth)
                    busy.append(results)
                    # The window: from the first request to the end of the pause it caused.
                    windows.append((results[0].start, max(x.end for x in results) + args.idle_gap))
                    time.sleep(args.idle_gap + 0.5)
                    s.wait(lambda j: j["train"]["state"] == "running")
        solo.append(solo_window(s, args))
        watch.stop.set()
        stats = s.api("GET", "/api/stats").json()["inference"]
        rows, requests = steps(Path(job["out"])), [x for run in busy for x in run]
        seconds = sum(hi - lo for lo, hi in windows)
        during = [x["step_seconds"] for x in rows if any(lo <= x["time"] <= hi for lo, hi in windows)]
        return {"idle": summarize(idle), "busy": summarize(busy), "stats": stats, "proxy": proxy,
                "yields": watch.yields(sorted(x.start for x in requests)),
                "solo": [throughput(rows, lo, hi) for lo, hi in solo],
                "solo_mean": sum(throughput(rows, lo, hi) * (hi - lo) for lo, hi in solo) /
                             sum(hi - lo for lo, hi in solo),
                "with": sum(throughput(rows, lo, hi) * (hi - lo) for lo, hi in windows) / seconds,
                "busy_share": sum(union([(x.start, x.end) for x in requests], lo, hi) for lo, hi in windows) / seconds,
                "paused_share": sum(union([(x.start, x.end + args.idle_gap) for x in requests], lo, hi)
                                    for lo, hi in windows) / seconds,
                "step50": q(during, 0.5), "step99": q(during, 0.99), "steps_during": len(during)}
    finally:
        stop_service(s)


def solo_window(s: Serve, args) -> tuple[float, float]:
    """Training alone for --solo-seconds; the window."""
    lo = time.time()
    time.sleep(args.solo_seconds)
    return lo, time.time()


def exit_time(pid: int, timeout: float) -> float:
    """When the job's process (not our child) exited: it is a zombie until the service reaps it,
    which the service does within a tick; polled every 2 ms, bounded."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return time.time()
        except psutil.NoSuchProcess:
            return time.time()
        time.sleep(0.002)
    raise TimeoutError(f"job process {pid} still runs after {timeout:.0f} s")


def scheduler_overhead(work: Path, jobs: int) -> dict:
    """Short jobs of one recipe, one after another, on an idle service with inference off."""
    s = start_service(work, "sched", "enabled = false", 2.0)
    recipe = write_recipe(work / "recipe-sched", train={"max_steps": 3}, checkpoint={"every_steps": 1000})
    rows, nan = [], float("nan")
    try:
        for i in range(jobs + 1):  # the first plans the recipe; the rest find the plan cached
            name = f"j{i}"
            t0 = time.perf_counter()
            r = s.api("POST", "/api/jobs", {"recipe": str(recipe), "name": name})
            submit = time.perf_counter() - t0
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            pid = s.wait(lambda _, name=name: s.job_pid(name), every=0.005)
            exited = exit_time(pid, 120)
            s.wait(lambda j, name=name: j[name]["state"] in ("completed", "failed"), timeout=120)
            con = sqlite3.connect(s.home / "ledger.db")
            moves = {to: t for t, to in con.execute(
                "SELECT time, to_state FROM job_transitions WHERE job_id = ? ORDER BY rowid", (job_id,))}
            attempt_end = con.execute("SELECT max(a.end) FROM attempts a JOIN runs r ON r.id = a.run_id "
                                      "WHERE r.path = ?", (r.json()["out"],)).fetchone()[0]
            con.close()
            final = moves.get("completed", moves.get("failed"))
            rows.append({"submit": submit, "admit": moves["starting"] - moves["queued"],
                         "teardown": exited - (attempt_end or nan),
                         "first_step": moves.get("running", nan) - moves["starting"], "reap": final - exited,
                         "state": "completed" if "completed" in moves else "failed"})
    finally:
        stop_service(s)
    return {"first_submit": rows[0]["submit"], "rows": rows[1:]}


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f} ms"


def report(name: str, f: dict, args) -> None:
    print(f"\n## {name}")
    print("| scenario | requests ok | latency p50 | latency p99 | TTFT p50 | TTFT p99 | tokens/request | busy share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, x in (("idle machine", f["idle"]), ("training in the background", f["busy"])):
        print(f"| {label} | {x['ok']}/{x['n']} | {ms(x['p50'])} | {ms(x['p99'])} | {ms(x['ttft50'])} | "
              f"{ms(x['ttft99'])} | {x['tokens']:.1f} | {x['busy']:.1%} |")
        for e in x["errors"]:
            print(f"  error: {e}")
    (d_lat, d_ttft), (v_lat, v_ttft) = f["proxy"]["direct"], f["proxy"]["via"]
    print(f"- one request at a time, idle machine: straight to the engine p50 {ms(d_lat)} (TTFT {ms(d_ttft)}), "
          f"through the service {ms(v_lat)} (TTFT {ms(v_ttft)}): the service adds {ms(v_lat - d_lat)}")
    ratio = f["busy"]["p99"] / f["idle"]["p99"]
    ttft = f["busy"]["ttft99"] / f["idle"]["ttft99"]
    print(f"- inference p99 with training / idle: **{ratio:.2f}** (goal <= 1.2); TTFT p99: {ttft:.2f}")
    solo, busy = f["solo_mean"], f["busy_share"]
    goal = 0.9 * (1 - busy) * solo
    print(f"- training: solo {solo:,.0f} tokens/s (windows {min(f['solo']):,.0f} to {max(f['solo']):,.0f}); "
          f"during the trace {f['with']:,.0f} tokens/s: kept **{f['with'] / solo:.1%}** of solo. Goal: "
          f"0.9 x (1 - {busy:.1%} busy in those windows) x solo = {goal:,.0f} tokens/s ({0.9 * (1 - busy):.1%} of solo): "
          f"{f['with'] / goal if goal > 0 else math.inf:.2f}x the goal. Training is paused while requests run "
          f"and for the {args.idle_gap:g} s idle gap after: {f['paused_share']:.1%} of the time, so at most "
          f"{1 - f['paused_share']:.1%} could be kept")
    st, ys = f["stats"], f["yields"]
    total = [a + b for a, b in ys]
    print(f"- yield, request sent -> training paused (timed from the job's control files, {len(ys)} "
          f"pauses): p50 {ms(q(total, 0.5))}, p99 {ms(q(total, 0.99))}; of which sent -> pause asked "
          f"p50 {ms(q([a for a, _ in ys], 0.5))}, p99 {ms(q([a for a, _ in ys], 0.99))}, and asked -> "
          f"paused p50 {ms(q([b for _, b in ys], 0.5))}, p99 {ms(q([b for _, b in ys], 0.99))}. "
          f"Training step during the trace p50 {ms(f['step50'])}, p99 {ms(f['step99'])} "
          f"({f['steps_during']} steps): yield p99 / step p50 = **{q(total, 0.99) / f['step50']:.2f}** "
          f"(goal < 1)")
    nan = float("nan")
    print(f"- /api/stats says: {st['pauses']} pauses, p50 {ms(st['pause_latency_p50'] or nan)}, "
          f"p99 {ms(st['pause_latency_p99'] or nan)}; requests in flight after the trace: {st['in_flight']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("builtin", "llama", "both"), default="both")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-gap", type=float, default=2.0, help="[inference] idle_gap_seconds")
    parser.add_argument("--model", default="builtin:tiny", help="the built-in engine's [inference] model")
    parser.add_argument("--blocks", type=int, default=4, help="the trace in this many blocks, alternating")
    parser.add_argument("--solo-seconds", type=float, default=10.0, help="each solo window (blocks + 1)")
    parser.add_argument("--jobs", type=int, default=5, help="jobs for the scheduler overhead")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-serve-bench-"))
    trace = make_trace(args.requests, args.rate, args.seed)
    print(f"{args.requests} requests over {trace[-1][0]:.0f} s (rate {args.rate}/s, seed {args.seed}), "
          f"max_tokens {args.max_tokens}, idle gap {args.idle_gap:g} s; {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f}; work in {work}", flush=True)
    figures: dict[str, dict] = {}
    t_start = time.time()
    if args.engine in ("builtin", "both"):
        figures[f"built-in engine ({args.model})"] = bench_engine(
            "builtin", f'model = "{args.model}"\nseed = 7', work, trace, args)
    if args.engine in ("llama", "both"):
        try:
            import llama_cpp.server.app  # noqa: F401
        except (ImportError, OSError, RuntimeError) as e:
            print(f"llama engine skipped: llama-cpp-python[server] is not importable ({e})")
        else:
            with llama_engine(work) as url:
                figures["llama.cpp server (SmolLM2-135M Q4_1) as upstream"] = bench_engine(
                    "llama", f'upstream = "{url}"', work, trace, args)
    sched = scheduler_overhead(work, args.jobs)
    for name, f in figures.items():
        report(name, f, args)
    rows = sched["rows"]
    admit, reap = [r["admit"] for r in rows], [r["reap"] for r in rows]
    print(f"\n## Scheduler overhead ({len(rows)} jobs of a 3-step recipe, one after another, idle service)")
    print(f"- submit (HTTP, includes `ember plan`): first {sched['first_submit']:.2f} s; cached plan "
          f"p50 {ms(statistics.median(r['submit'] for r in rows))}")
    print(f"- queued -> starting p50 {ms(statistics.median(admit))} (max {ms(max(admit))}); job process "
          f"exit -> terminal state p50 {ms(statistics.median(reap))} (max {ms(max(reap))}); per job "
          f"**{ms(statistics.median(a + b for a, b in zip(admit, reap)))}** (goal < 1 s)")
    print(f"- not the scheduler's: starting -> running (process start, imports, first step) p50 "
          f"{statistics.median(r['first_step'] for r in rows):.2f} s; the attempt's end in the ledger -> "
          f"the job's process exited p50 {ms(statistics.median(r['teardown'] for r in rows))}; states: "
          f"{sorted({r['state'] for r in rows})}")
    print(f"\n{time.time() - t_start:.0f} s in all; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
