"""The built-in engine against llama.cpp's server, on the same model and prompt, in one run.

Goal (issue 29, item 1): p50 and p99 within 1.5x of llama.cpp. Figures are printed, never asserted.

    before   ember's engine at --before (default 48f2c7b: HF generate, one request at a time),
             its `ember` package taken with `git archive` into a temp folder
    after    this checkout's engine (ember.infer.batching: own decode loop, continuous batching)
    llama    llama-cpp-python's server (its default threads), on the same GGUF file

Each server is its own process on loopback; the ember ones are `python -m ember.web.infer_worker`
as `ember serve` starts them. Rounds alternate which server goes first, so each sees the same
drift of this shared machine. Per round and server: one request alone, then --concurrent at once,
for each of --tokens new tokens; greedy, not streamed, latency = request sent to answer whole.
The prompt is a long enough text that no server stops early (completion tokens are checked).

usage: python bench/engine.py [--rounds 5] [--tokens 16 64] [--concurrent 4] [--before 48f2c7b]
           [--model package:...gguf] [--engines before after llama] [--dtype-env VALUE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from ember.models import resolve_path  # noqa: E402
from ember.proc import dies_with_us  # noqa: E402
from tests.engines import SMOLLM2_GGUF, free_port  # noqa: E402
from tests.helpers import GENESIS  # noqa: E402

HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=16))


def q(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in [0, 1])."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(p * len(xs) + 0.999999) - 1))]


@contextmanager
def process(argv: list[str], cwd: Path, log: Path, url: str | None = None, ready: str = "/health",
            env: dict[str, str] | None = None):
    """Run a server; yield its URL once /v1/models answers; stop it on exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE if url is None else out, stderr=out,
                                text=True, start_new_session=True, env={**os.environ, **(env or {})},
                                preexec_fn=dies_with_us())  # a killed bench leaves no server behind
    try:
        if url is None:  # an ember worker says where it listens on its first line
            url = proc.stdout.readline().split()[-1]
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if HTTP.get(f"{url}{ready}", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def ask(url: str, prompt: str, tokens: int) -> tuple[float, int, str]:
    """One greedy completion: (seconds, completion tokens, text)."""
    t = time.perf_counter()
    r = HTTP.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return time.perf_counter() - t, body["usage"]["completion_tokens"], body["choices"][0]["text"]


def main() -> None:
    """Start the servers, run the alternating rounds, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--before", default="48f2c7b")
    ap.add_argument("--model", default=SMOLLM2_GGUF)
    ap.add_argument("--engines", nargs="+", default=["before", "after", "llama"])
    ap.add_argument("--before-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for `before` (0: torch's default, all cores); `after` "
                         "takes half the cores by itself, as llama.cpp does")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    gguf = resolve_path(args.model)
    prompt = json.loads(GENESIS.read_text().splitlines()[0])["text"][:300]
    tmp = Path(tempfile.mkdtemp(prefix="ember-bench-engine-"))
    urls: dict[str, str] = {}
    with ExitStack() as stack:
        for name in args.engines:
            if name == "llama":
                port = free_port()
                urls[name] = stack.enter_context(process(
                    [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                     "--port", str(port)], tmp, tmp / "llama.log", f"http://127.0.0.1:{port}", "/v1/models"))
                continue
            where = ROOT
            if name == "before":
                where = tmp / "before"
                where.mkdir()
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "ember"],
                                         check=True, capture_output=True).stdout
                subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
            urls[name] = stack.enter_context(process(
                [sys.executable, "-m", "ember.web.infer_worker", "--model", args.model, "--port", "0"],
                where, tmp / f"{name}.log",
                env={"OMP_NUM_THREADS": str(args.before_threads)} if name == "before" and args.before_threads else None))
        for url in urls.values():
            ask(url, prompt, 4)  # warm-up: first-call costs are not latency
        lat: dict[tuple[str, int, int], list[float]] = {}
        texts: dict[tuple[str, int], set[str]] = {}
        short: list[str] = []
        names = list(urls)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for tokens in args.tokens:
                for name in order:
                    for width in (1, args.concurrent):
                        with ThreadPoolExecutor(width) as pool:
                            got = list(pool.map(lambda _: ask(urls[name], prompt, tokens), range(width)))
                        lat.setdefault((name, tokens, width), []).extend(s for s, _, _ in got)
                        texts.setdefault((name, tokens), set()).update(t for _, _, t in got)
                        short += [f"{name}: {n} of {tokens}" for _, n, _ in got if n != tokens]
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"model {args.model}, prompt {len(prompt)} characters, {args.rounds} rounds, greedy; "
          f"llama.cpp with its default threads; cpu count {os.cpu_count()}; before's threads "
          f"{args.before_threads or 'torch default'}")
    print(f"{'new tokens':>10} {'requests':>8} " + " ".join(f"{n + ' p50':>12} {n + ' p99':>12}" for n in names)
          + (" " + " ".join(f"{n}/llama p50,p99" for n in names if n != "llama") if "llama" in names else ""))
    for tokens in args.tokens:
        for width in (1, args.concurrent):
            row = {n: lat[(n, tokens, width)] for n in names}
            cells = " ".join(f"{statistics.median(v):12.3f} {q(v, 0.99):12.3f}" for v in row.values())
            ratios = ""
            if "llama" in names:
                ll = row["llama"]
                ratios = " " + " ".join(f"{statistics.median(row[n]) / statistics.median(ll):6.2f}x,"
                                        f"{q(row[n], 0.99) / q(ll, 0.99):5.2f}x" for n in names if n != "llama")
            print(f"{tokens:>10} {width:>8} {cells}{ratios}")
    for (name, tokens), seen in texts.items():
        print(f"{name} {tokens} tokens: {len(seen)} distinct text(s): {sorted(seen)[0][:60]!r}")
    if short:
        print(f"answers shorter than asked: {short[:8]}")


if __name__ == "__main__":
    main()
