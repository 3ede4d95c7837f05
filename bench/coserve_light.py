"""Co-serving's cost to training under a light request stream, measured in one run.

One training run with `[serve] coserve = true` (builtin tiny model, 1 thread, seq 256 x micro
batch 8, grad_accum 2: two gaps a step). Its time is cut into windows that alternate: quiet (no
request) and light (Poisson arrivals at --rate, 32-token prompts, 64-token greedy answers,
streamed, open loop), so both kinds of window see the same drift of this shared machine.
Printed: training tokens/s in each kind (steps that ended in the window), the ratio light /
quiet (training kept), the share of light time with a request in flight (busy share) and the
goal's floor 0.9 x (1 - busy share), the share of the light windows' step time spent in
co-serving's gaps (the phase `serve` of metrics.jsonl: the run's own account of what serving
took from training, which this shared machine's drift does not blur), and the requests'
latency p50 / p99. Figures, never asserted.

usage: python bench/coserve_light.py [--rate 0.2] [--window 30] [--blocks 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

from serve_colocation import q, steps, throughput, union  # noqa: E402
from tests.helpers import GENESIS, ember_cmd, write_recipe  # noqa: E402

TRAIN = {"train": {"max_steps": 1_000_000, "micro_batch": 8, "grad_accum": 2, "threads": 1},
         "data": {"seq_len": 256}, "checkpoint": {"every_steps": 0}, "serve": {"coserve": True}}


def one(http: httpx.Client, info: dict, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """One streamed completion of the live model: (sent, done, completion tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, tokens = time.time(), 0
    with http.stream("POST", info["url"] + "/v1/completions", json=body,
                     headers={"Authorization": f"Bearer {info['token']}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", tokens)
    return start, time.time(), tokens


def light(http: httpx.Client, info: dict, seconds: float, rate: float, max_tokens: int,
          rng: random.Random) -> list[tuple[float, float, int]]:
    """Open-loop Poisson arrivals for `seconds`; every request's result, once all are done."""
    text = json.loads(GENESIS.read_text().splitlines()[0])["text"]
    with ThreadPoolExecutor(32) as pool:
        t0, at, futures = time.monotonic(), rng.expovariate(rate), []
        while at < seconds:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            i = rng.randrange(len(text) - 32)
            futures.append(pool.submit(one, http, info, text[i:i + 32], max_tokens))  # 32 byte tokens
            at += rng.expovariate(rate)
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        return [f.result() for f in futures]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=0.2, help="requests per second in light windows")
    p.add_argument("--window", type=float, default=30.0, help="seconds per window")
    p.add_argument("--blocks", type=int, default=3, help="(quiet, light) pairs")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as work:
        recipe, out = write_recipe(Path(work), **TRAIN), Path(work) / "run"
        proc = subprocess.Popen([*ember_cmd("run", recipe, "--out", out, "--no-ledger")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        try:
            while not (out / "serve.json").exists():
                time.sleep(0.05)
            info = json.loads((out / "serve.json").read_text())
            while len(steps(out)) < 20:  # past start-up and the first steps' warm-up
                time.sleep(0.5)
            quiet, busy, served, results, gaps = [], [], [], [], []
            with httpx.Client(timeout=600) as http:
                for b in range(args.blocks):
                    for kind in (("quiet", "light") if b % 2 == 0 else ("light", "quiet")):
                        lo = time.time()
                        if kind == "quiet":
                            time.sleep(args.window)
                        else:
                            got = light(http, info, args.window, args.rate, args.max_tokens, rng)
                            results += got
                        hi = time.time()
                        rate = throughput(steps(out), lo, hi)
                        (quiet if kind == "quiet" else busy).append(rate)
                        if kind == "light":
                            served.append(union([(a, z) for a, z, _ in got], lo, hi) / (hi - lo))
                            gaps += [r for r in steps(out) if lo <= r["time"] <= hi]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    report(quiet, busy, served, results, gaps, args)


def report(quiet: list[float], busy: list[float], served: list[float], results: list, rows: list[dict],
           args) -> None:
    mean = lambda xs: sum(xs) / len(xs)
    kept, share = mean(busy) / mean(quiet), mean(served)
    latency = [z - a for a, z, _ in results]
    print(f"co-serving, light stream: {args.rate} req/s, 32-token prompts, {args.max_tokens}-token answers, "
          f"{args.blocks} x ({args.window:.0f} s quiet, {args.window:.0f} s light)")
    print(f"training tokens/s per window, quiet: {', '.join(f'{x:,.0f}' for x in quiet)}")
    print(f"training tokens/s per window, light: {', '.join(f'{x:,.0f}' for x in busy)}")
    print(f"training kept (light / quiet): {kept:.3f}; busy share {share:.3f}; "
          f"floor 0.9 x (1 - busy share) = {0.9 * (1 - share):.3f}")
    serve = sum(r["phases"].get("serve", 0.0) for r in rows) / sum(r["step_seconds"] for r in rows)
    print(f"share of the light windows' step time in co-serving's gaps: {serve:.3f} "
          f"(training kept by this account: {1 - serve:.3f})")
    print(f"requests {len(results)}, completion tokens {sum(t for *_, t in results)}; "
          f"latency p50 {q(latency, 0.5):.2f} s, p99 {q(latency, 0.99):.2f} s")


if __name__ == "__main__":
    main()
