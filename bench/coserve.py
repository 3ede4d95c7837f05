"""Co-serving against pause-and-gap, per request trace, every figure a ratio measured in one run
(issue 29, item 4). Figures are printed, never asserted.

Traces (the same seeded arrivals and prompt positions for every arm of one trace; open loop,
streamed, greedy, 64-token answers, 32-token prompts):

    light    Poisson, 0.2 requests/s
    heavy    Poisson, 2 requests/s
    bursty   on/off: every 10 s, 2 s on (Poisson at 4 requests/s, ~8 requests), 8 s off;
             0.8 requests/s on average, each burst several times what one request needs

Arms. Training is one recipe everywhere: the builtin tiny model, 1 thread, seq 256 x micro
batch 8, grad_accum 2 (bench/coserve_light.py's). Two engines answer, each in its own phase:

    (d) co-serving       `ember run` with `[serve] coserve = true`: the training process answers
                         for its live model between micro-batches (its endpoint, its token)
    (b) built-in alone   the same engine code (ember.infer.batching's decode loop, 1 thread) on
                         the same model spec (builtin:tiny, seed 7), as `python -m
                         ember.web.infer_worker`, while the co-serving run is soft-paused (its
                         control files, ember.control: the process sleeps): (d)'s baseline. Not
                         the co-serving endpoint itself: it answers only between micro-batches,
                         so with training paused it would not answer at all
    (a) training alone   the co-serving run with no request: (d)'s training baseline
    (c) pause-and-gap    `ember serve` with llama.cpp's server (llama-cpp-python, 1 thread) as
                         `[inference] upstream` and the same recipe as a job: the service pauses
                         the job for each request and resumes it after the idle gap (2 s, the
                         default); requests go through the service
    (b) llama.cpp alone  the same service path with the job soft-paused by hand: (c)'s baseline
    (a) training alone   the service's job with no request: (c)'s training baseline

llama.cpp cannot serve the co-served model (builtin:tiny has ember's byte tokenizer, which
llama.cpp does not know), so it serves the shipped SmolLM2-135M-Instruct Q4_1 GGUF, and its
prompts are cut to ~32 of that model's tokens (the measured mean is printed). Latencies of the
two engines are therefore not compared with each other: each arm's p50/p99 is a ratio against
its own engine alone, and each arm's training tokens/s against the same recipe training alone
in the same phase. Within a phase the windows (a), (b) and the arm rotate per trace so that each
sees the same drift of this shared machine.

A window: arrivals for --window seconds, then up to --drain seconds for the requests in flight;
one still running then is cut (its client leaves) and counted as not done, its latency as at
least the time it had (a percentile that lands on one prints as ">= x"). After a llama.cpp
window, outside it, a one-token request straight to llama.cpp returns once it has nothing left
(it answers one request at a time), so no window inherits another's queue. Training tokens/s: the
steps that ended in the window (for (c), plus the idle gap its last request started); kept: that
over the phase's (a) windows together, so an (a) row's own ratio shows this machine's drift.
For (d) also the run's own account, 1 - the share of the window's step time spent in
co-serving's gaps (phase `serve` of metrics.jsonl, as bench/coserve_light.py), which that drift
does not blur.

The default run (25 s windows, 15 s drain) takes about 10 minutes: 9 windows a phase, the
llama.cpp ones up to window + drain long (at 2 requests/s its one thread falls behind here).

usage: python bench/coserve.py [--window 25] [--drain 15] [--traces light heavy bursty]
           [--arms c d] [--micro-batch 8] [--seed 0] [--idle-gap 2.0] [--model tiny|smollm2]
           [--seq-len N] [--gap-share X] [--burst-seconds S]

--model smollm2 trains the demo's LoRA on SmolLM2-135M instead (one thread, no accumulation, a
checkpoint every 10 steps): its engine alone serves the same base with the run's newest committed
adapter (the cost a token of the live model), and llama.cpp in (c) serves that base too. It
reads examples/data/kjv.jsonl, which `make demo` writes (examples/prepare_kjv.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

from coserve_light import TRAIN  # noqa: E402
from engine import process  # noqa: E402
from ember import control  # noqa: E402
from ember.proc import dies_with_us  # noqa: E402
from serve_colocation import llama_engine, start_service, steps, stop_service, throughput, union  # noqa: E402
from tests.helpers import GENESIS, ember_cmd, write_recipe  # noqa: E402

DEMO = ROOT / "examples" / "smollm2-lora.toml"
PROMPT_TOKENS, ANSWER_TOKENS = 32, 64
CHARS_PER_TOKEN = {"builtin": 1, "llama": 4.3}  # byte tokens; SmolLM2's BPE on English prose
HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=128, max_keepalive_connections=128))
TEXT = json.loads(GENESIS.read_text().splitlines()[0])["text"]
LOADS: list[float] = []  # the 1-minute load average at the end of every window: how shared the machine was


def arrivals(trace: str, seconds: float, rng: random.Random) -> list[float]:
    """Arrival offsets in [0, seconds) for one trace (module docstring)."""
    rate, on, period = {"light": (0.2, 1, 1), "heavy": (2.0, 1, 1), "bursty": (4.0, 2, 10)}[trace]
    out, t = [], rng.expovariate(rate)  # t: time spent "on"; mapped onto the on/off clock
    while (at := (t // on) * period + t % on) < seconds:
        out.append(at)
        t += rng.expovariate(rate)
    return out


def prompt(at: int, engine: str) -> str:
    """~32 tokens of Genesis from character `at`, whole words for a BPE engine."""
    chars = round(PROMPT_TOKENS * CHARS_PER_TOKEN[engine])
    text = TEXT[at:at + chars]
    return text if engine == "builtin" else text[text.find(" ") + 1:]


@dataclass
class Result:
    start: float
    end: float
    prompt_tokens: int = 0
    tokens: int = 0
    done: bool = False      # answered whole before the window's cut
    error: str | None = None


@dataclass
class Window:
    results: list[Result] = field(default_factory=list)
    lo: float = 0.0
    hi: float = 0.0
    training: float | None = None  # tokens/s; None: training was paused by design
    note: str = ""
    own: float | None = None       # (d): 1 - the share of step time in co-serving's gaps


def ask(url: str, headers: dict, model: str | None, text: str, cut: float) -> Result:
    """One streamed completion; left (the connection closed) at time.time() >= cut."""
    body = {"prompt": text, "max_tokens": ANSWER_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    r, chunks = Result(time.time(), 0.0), 0
    try:
        # A read may block past the cut (llama.cpp sends nothing while the request waits its
        # turn): bounded by the time to the cut, so it ends at the cut or soon after.
        with HTTP.stream("POST", url + "/v1/completions", json=body, headers=headers,
                         timeout=httpx.Timeout(30.0, read=max(1.0, cut - r.start))) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
            for line in resp.iter_lines() if r.error is None else ():
                if time.time() >= cut:
                    r.error = "cut"
                    break
                if line == "data: [DONE]":
                    r.done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or {}
                    r.prompt_tokens = usage.get("prompt_tokens", r.prompt_tokens)
                    chunks += any(c.get("text") for c in chunk.get("choices", []))
                    r.tokens = usage.get("completion_tokens", r.tokens)
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end, r.tokens = time.time(), r.tokens or chunks  # no usage chunk: one text chunk a token
    if r.end > cut:  # not answered whole by the cut: at least this long
        r.done, r.error, r.end = False, "cut", cut
    return r


def play(url: str, headers: dict, model: str | None, engine: str, trace: list[tuple[float, int]],
         args) -> Window:
    """The trace, open loop, against one endpoint; the window ends when every request is done,
    or is cut --drain seconds after the last arrival slot."""
    w = Window(lo=time.time())
    cut = w.lo + args.window + args.drain
    with ThreadPoolExecutor(128) as pool:
        t0, futures = time.perf_counter(), []
        for at, pos in trace:
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            futures.append(pool.submit(ask, url, headers, model, prompt(pos, engine), cut))
        time.sleep(max(0.0, t0 + args.window - time.perf_counter()))
        w.results = [f.result() for f in futures]
    w.hi = min(cut, max([time.time()] + [r.end for r in w.results]))
    return w


def warm(url: str, headers: dict, model: str | None, engine: str) -> None:
    """One request, answered whole and not counted: what the engine loads for its first answer
    (the worker alone: the run's newest committed adapter, read again whenever a newer one was
    committed) is not in a window's latencies."""
    r = play(url, headers, model, engine, [(0.0, 0)], argparse.Namespace(window=0.0, drain=300.0)).results[0]
    if not r.done:
        raise RuntimeError(f"the warm-up request to {url} was not answered: {r.error}")


def quiet(args) -> Window:
    """Training alone: no request for --window seconds."""
    w = Window(lo=time.time())
    time.sleep(args.window)
    w.hi = time.time()
    return w


def rotation(i: int, arms: tuple[str, ...]) -> tuple[str, ...]:
    """The order of one trace's windows: rotated per trace, so each arm takes each place."""
    k = i % len(arms)
    return arms[k:] + arms[:k]


def windows(phase: str, traces: dict, arms: tuple[str, ...], measure) -> dict:
    """Every trace's window of every arm, in `rotation` order: {(trace, arm): measure(trace's name,
    trace, arm)}, the load average noted at each window's end."""
    got = {}
    for i, (name, trace) in enumerate(traces.items()):
        for arm in rotation(i, arms):
            print(f"[{phase}] {name}: ({arm})", flush=True)
            got[name, arm] = measure(name, trace, arm)
            LOADS.append(os.getloadavg()[0])
    return got


def training(got: dict, rows: list) -> None:
    """Each window's training tokens/s from the run's steps; none for (b), where training is paused."""
    for (_, arm), w in got.items():
        w.training = None if arm == "b" else throughput(rows, w.lo, w.hi)


def recipe_sections(args) -> dict:
    """The recipe's sections. --model tiny: coserve_light's, with --micro-batch sequences a
    micro-batch and the step's 16 sequences kept (grad_accum = 16 / micro-batch). --model smollm2:
    the demo's model, LoRA and data (examples/smollm2-lora.toml), one thread, --micro-batch
    sequences of --seq-len tokens a step (no accumulation), a checkpoint every 10 steps (the
    engine alone serves the newest committed adapter). [serve] gap_share and burst_seconds as given."""
    serve = {**TRAIN["serve"], **({"gap_share": args.gap_share} if args.gap_share is not None else {}),
             **({"burst_seconds": args.burst_seconds} if args.burst_seconds is not None else {})}
    if args.model == "tiny":
        return {**TRAIN, "train": {**TRAIN["train"], "micro_batch": args.micro_batch,
                                   "grad_accum": 16 // args.micro_batch}, "serve": serve,
                **({"data": {**TRAIN["data"], "seq_len": args.seq_len}} if args.seq_len else {})}
    demo = tomllib.loads(DEMO.read_text())
    return {"model": demo["model"], "method": demo["method"],
            "data": {"files": [str(DEMO.parent / demo["data"]["files"][0])], "seq_len": args.seq_len or 128},
            "train": {"max_steps": 1_000_000, "micro_batch": args.micro_batch, "grad_accum": 1, "threads": 1,
                      "seed": 0},
            "checkpoint": {"every_steps": 10, "keep_last": 2}, "serve": serve}


def warm_up_steps(args) -> int:
    """Steps a run trains before its first window (past start-up; SmolLM2's step is ~0.65 s)."""
    return 20 if args.model == "tiny" else 12


def engine_of(args) -> str:
    """How prompts are cut: byte tokens (builtin:tiny) or SmolLM2's BPE (~4.3 characters a token)."""
    return "builtin" if args.model == "tiny" else "llama"


def wait_ack(folder: Path, seq: int, state: str, timeout: float = 60) -> None:
    """Until the training process acknowledged control request `seq` with `state`."""
    deadline = time.monotonic() + timeout
    while (ack := control.acknowledged(folder)) is None or (ack.get("seq"), ack.get("state")) != (seq, state):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {state!r} acknowledgement of control request {seq}: {ack}")
        time.sleep(0.02)


def coserve_phase(work: Path, traces: dict, args) -> dict:
    """(a), (b) and (d) on one co-serving run and one built-in worker: {(trace, arm): Window}."""
    recipe, out, ctl = write_recipe(work / "coserve", **recipe_sections(args)), work / "coserve" / "run", work / "control"
    ctl.mkdir()
    with open(work / "coserve.log", "wb") as log:
        proc = subprocess.Popen(ember_cmd("run", recipe, "--out", out, "--no-ledger"), cwd=ROOT,
                                env={**os.environ, control.ENV: str(ctl)}, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=log,
                                preexec_fn=dies_with_us())  # a killed bench leaves no run training on
    if args.model == "tiny":  # the co-served model's weights differ (trained), its cost a token does not
        worker = [sys.executable, "-m", "ember.web.infer_worker", "--model", "builtin:tiny", "--seed", "7",
                  "--threads", "1"]
        served = "base"
    else:  # the same base with the run's newest committed adapter: the live model's cost a token
        worker = [sys.executable, "-m", "ember.web.infer_worker", "--model", recipe_sections(args)["model"]["path"],
                  "--runs", str(out), "--threads", "1"]
        served = out.name
    engine = engine_of(args)
    try:
        with process(worker, ROOT, work / "worker.log") as alone:
            while not (out / "serve.json").exists() or len(steps(out)) < warm_up_steps(args):  # past warm-up
                if proc.poll() is not None:
                    raise RuntimeError(f"the co-serving run exited; see {work / 'coserve.log'}")
                time.sleep(0.5)
            info = json.loads((out / "serve.json").read_text())
            live = (info["url"], {"Authorization": f"Bearer {info['token']}"}, None)
            if args.model != "tiny":  # co-serving's first answer builds what it keeps (untimed)
                warm(*live, engine)

            def measure(name: str, trace: list, arm: str) -> Window:
                if arm == "a":
                    return quiet(args)
                if arm == "d":
                    return play(*live, engine, trace, args)
                wait_ack(ctl, control.request(ctl, "user"), "paused")  # training soft-paused: the worker alone
                if args.model != "tiny":  # the adapter committed since its last window: loaded untimed
                    warm(alone, {}, served, engine)
                w = play(alone, {}, served, engine, trace, args)
                wait_ack(ctl, control.request(ctl, None), "running")
                return w
            got = windows("co-serving", traces, ("a", "d", "b"), measure)
        rows = steps(out)
        training(got, rows)
        for (_, arm), w in got.items():
            inside = [r for r in rows if w.lo <= r["time"] <= w.hi]
            if arm == "d" and inside:  # the run's own account, which the machine's drift does not blur
                w.own = 1 - sum(r["phases"].get("serve", 0.0) for r in inside) / sum(r["step_seconds"] for r in inside)
    finally:
        stop_group(proc)
    return got


def service_phase(work: Path, traces: dict, args) -> dict:
    """(a), (b) and (c) on one `ember serve` with llama.cpp upstream and one job: {(trace, arm): Window}."""
    with llama_engine(work) as upstream:
        s = start_service(work, "service", f'upstream = "{upstream}"', args.idle_gap)
        try:
            job_train = {k: v for k, v in recipe_sections(args).items() if k != "serve"}
            r = s.api("POST", "/api/jobs", {"recipe": str(write_recipe(work / "recipe-job", **job_train)),
                                            "name": "train"})
            assert r.status_code == 201, r.text
            s.wait(lambda j: j["train"]["state"] == "running" and j["train"]["step"] >= warm_up_steps(args), timeout=600)
            out = Path(s.jobs()["train"]["out"])
            tokens = llama_prompt_tokens(upstream, traces)

            def measure(name: str, trace: list, arm: str) -> Window:
                if arm == "a":
                    w = quiet(args)
                elif arm == "c":
                    w = play(s.url, s.auth, "base", "llama", trace, args)
                    w.hi += args.idle_gap if w.results else 0.0  # the pause its last request began
                else:
                    assert s.api("POST", "/api/jobs/train/pause", {}).status_code == 200
                    s.wait(lambda j: j["train"]["state"] == "soft-paused")
                    w = play(s.url, s.auth, "base", "llama", trace, args)
                if arm != "a":
                    settle(upstream)
                time.sleep(max(0.0, w.hi - time.time()) + 0.5)
                if arm == "b":
                    assert s.api("POST", "/api/jobs/train/resume", {}).status_code == 200
                s.wait(lambda j: j["train"]["state"] == "running")
                for r in w.results:
                    r.prompt_tokens = r.prompt_tokens or round(tokens[name])
                return w
            got = windows("pause-and-gap", traces, ("a", "c", "b"), measure)
            training(got, steps(out))
        finally:
            stop_service(s)
    return got


def settle(upstream: str) -> None:
    """Until llama.cpp's server has nothing left to do: it answers one request at a time, so a
    one-token request returns once every request still running (one cut by a window) is over."""
    HTTP.post(upstream + "/v1/completions", json={"prompt": "In", "max_tokens": 1}).raise_for_status()


def llama_prompt_tokens(upstream: str, traces: dict) -> dict[str, float]:
    """Mean prompt tokens of each trace's prompts, by llama.cpp's own tokenizer (its streams
    through the service carry no usage)."""
    count = lambda text: len(HTTP.post(upstream + "/extras/tokenize", json={"input": text}).json()["tokens"])
    return {name: sum(count(prompt(pos, "llama")) for _, pos in trace) / max(1, len(trace))
            for name, trace in traces.items()}


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group (it stops at its next micro-batch), SIGKILL after 60 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def pct(w: Window, p: float) -> tuple[float, bool]:
    """Latency percentile over every request sent: (seconds, whether it lands on a cut request,
    whose latency is only a lower bound)."""
    xs = sorted((r.end - r.start, not r.done) for r in w.results)
    if not xs:
        return float("nan"), False
    return xs[min(len(xs) - 1, max(0, round(p * len(xs) + 0.5) - 1))]


def fmt(x: tuple[float, bool]) -> str:
    return f"{'>= ' if x[1] else ''}{x[0]:.2f} s"


ARM_NAMES = {("d", "a"): "(a) training alone (co-serving run)", ("d", "b"): "(b) built-in engine alone",
             ("d", "d"): "**(d) co-serving**", ("c", "a"): "(a) training alone (service job)",
             ("c", "b"): "(b) llama.cpp alone (via service)", ("c", "c"): "**(c) pause-and-gap, llama.cpp**"}


def solo(got: dict) -> float:
    """Training alone: tokens/s over every (a) window of the phase, time-weighted."""
    ws = [w for (_, arm), w in got.items() if arm == "a"]
    return sum(w.training * (w.hi - w.lo) for w in ws) / sum(w.hi - w.lo for w in ws)


def row(trace: str, phase: str, arm: str, got: dict) -> str:
    """One table row: requests, latency and its ratio to the engine alone, training kept."""
    w, alone = got[trace, arm], got.get((trace, "b"))
    if w.note:
        return f"| {trace} | {ARM_NAMES[phase, arm]} | {w.note} |" + " |" * 8
    done = sum(r.done for r in w.results)
    errors = sorted({r.error for r in w.results if r.error and r.error != "cut"})
    ok = [r for r in w.results if r.done] or [Result(0, 0)]
    cells = [f"{done}/{len(w.results)}" + (f" ({errors[0][:60]})" if errors else ""),
             f"{sum(r.prompt_tokens for r in ok) / len(ok):.0f} / {sum(r.tokens for r in ok) / len(ok):.0f}"]
    if arm == "a":
        cells += ["-"] * 5
    else:
        p50, p99 = pct(w, 0.5), pct(w, 0.99)
        a50, a99 = pct(alone, 0.5), pct(alone, 0.99)
        busy = union([(r.start, r.end) for r in w.results], w.lo, w.hi) / (w.hi - w.lo)
        ratio = lambda x, a: "1" if arm == "b" else f"{'~' if x[1] or a[1] else ''}{x[0] / a[0]:.2f}"
        cells += [fmt(p50), fmt(p99), ratio(p50, a50), ratio(p99, a99), f"{busy:.1%}"]
    if w.training is None:
        cells += ["paused", "-"]
    else:
        kept = w.training / solo(got)
        own = f" (own account {w.own:.3f})" if w.own is not None else ""
        cells += [f"{w.training:,.0f}", f"{kept:.3f}{own}"]
    return f"| {trace} | {ARM_NAMES[phase, arm]} | " + " | ".join(cells) + " |"


def report(got: dict, traces: dict, phases: list[str], args, loads: list[float], seconds: float) -> None:
    sections = recipe_sections(args)
    print(f"\n{len(traces)} traces x arms, --window {args.window:g} s, --drain {args.drain:g} s, "
          f"model {args.model}, {json.dumps(sections['train'])}, {json.dumps(sections['serve'])}, "
          f"seq_len {sections['data']['seq_len']}, seed {args.seed}, "
          f"idle gap {args.idle_gap:g} s; {seconds:.0f} s in all")
    print("| trace | arm | requests done | prompt / answer tokens | latency p50 | latency p99 | p50 / alone "
          "| p99 / alone | busy share | training tokens/s | kept (vs all (a)) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for trace in traces:
        for phase in phases:
            for arm in ("a", "b", phase):
                print(row(trace, phase, arm, got[phase]))
    print(f"\nload average (1 min) at the start, after each phase and at the end: "
          f"{', '.join(f'{x:.2f}' for x in loads)}; at the {len(LOADS)} windows' ends min {min(LOADS, default=0):.2f}, "
          f"mean {sum(LOADS) / max(1, len(LOADS)):.2f}, max {max(LOADS, default=0):.2f}; "
          f"{os.cpu_count()} cores, shared with other work")


def skipped(traces: dict, note: str) -> dict:
    """Rows that say why an arm was not measured."""
    return {(name, arm): Window(note=note) for name in traces for arm in ("a", "b", "c")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=float, default=25.0, help="seconds of arrivals per window")
    p.add_argument("--drain", type=float, default=15.0, help="seconds after a window for requests in flight")
    p.add_argument("--traces", nargs="+", choices=("light", "heavy", "bursty"), default=["light", "heavy", "bursty"])
    p.add_argument("--arms", nargs="+", choices=("c", "d"), default=["c", "d"],
                   help="c: pause-and-gap with llama.cpp, d: co-serving; each with its own (a) and (b)")
    p.add_argument("--micro-batch", type=int, choices=(1, 2, 4, 8, 16), default=8,
                   help="sequences a micro-batch (default 8); with --model tiny a step stays 16 of them: "
                        "a co-served request waits for the micro-batch under way")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-gap", type=float, default=2.0, help="the service's [inference] idle_gap_seconds")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny: builtin:tiny, full fine-tuning (default); smollm2: the demo's LoRA on SmolLM2-135M, "
                        "co-served and served alone with its adapter, llama.cpp serving the same model in (c)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens a sequence (default: 256 tiny, 128 smollm2)")
    p.add_argument("--gap-share", type=float, default=None, help="[serve] gap_share (default: the recipe's)")
    p.add_argument("--burst-seconds", type=float, default=None, help="[serve] burst_seconds (default: the recipe's)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    traces = {t: [(at, rng.randrange(len(TEXT) - 200)) for at in arrivals(t, args.window, rng)] for t in args.traces}
    print(f"requests per trace: {', '.join(f'{t} {len(x)}' for t, x in traces.items())}", flush=True)
    t0, loads, got = time.time(), [os.getloadavg()[0]], {}
    with tempfile.TemporaryDirectory(prefix="ember-coserve-") as tmp:
        work = Path(tmp)
        if "d" in args.arms:
            got["d"] = coserve_phase(work, traces, args)
            loads.append(os.getloadavg()[0])
        if "c" in args.arms:
            try:
                import llama_cpp.server.app  # noqa: F401
            except (ImportError, OSError, RuntimeError) as e:
                got["c"] = skipped(traces, f"not measured: llama-cpp-python[server] is not importable ({e})")
            else:
                got["c"] = service_phase(work, traces, args)
            loads.append(os.getloadavg()[0])
    report(got, traces, [ph for ph in ("d", "c") if ph in got], args, loads, time.time() - t0)


if __name__ == "__main__":
    main()
