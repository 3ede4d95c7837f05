"""Time from SIGTERM to exit with a durable checkpoint, against one step plus one save measured
in the same run. Goal (long-runs issue): latency <= one step + one save.

The builtin tiny model at seq_len 512 x micro batch 16 (~0.1-0.2 s a step here); SIGTERM lands at
a random moment of a random step; the run is then resumed once to check the checkpoint it
wrote on the way out is the one it resumes from.

With --grad-accum N (N micro-batches a step), the same SIGTERM `ember yield` and a preemption
send: the process stops between two micro-batches (ember.train.between), saves its last completed
step and exits, so the bound is one micro-batch + one save; p50 and p99 over the trials. It also
times when training stops (the device is free): the run's "step N undone after k of its
micro-batches" line, read from its stderr as it comes, against one micro-batch (issue 29's goal:
the device free within one micro-batch of `ember yield`).

usage: python bench/stop_latency.py [--trials 5] [--grad-accum 1] [--micro-batch 16] [--seq-len 512]
           [--first-step 12]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ember.metrics.stats import percentile  # noqa: E402
from ember.proc import dies_with_us  # noqa: E402
from tests.helpers import write_recipe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--first-step", type=int, default=12, help="SIGTERM during a step from this to twice it")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-stop-bench-"))
    os.environ["EMBER_HOME"] = str(work / "home")
    rng = random.Random(0)
    recipe = write_recipe(work, train={"max_steps": 10_000, "micro_batch": args.micro_batch, "threads": 0,
                                       "grad_accum": args.grad_accum},
                          data={"seq_len": args.seq_len}, checkpoint={"every_steps": 10})
    rows = []
    for trial in range(args.trials):
        out = work / f"run{trial}"
        proc = subprocess.Popen([sys.executable, "-m", "ember", "run", str(recipe), "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                preexec_fn=dies_with_us())  # a killed bench leaves no 10,000-step run behind
        said: list[tuple[float, str]] = []  # (perf_counter, line) of the run's stderr, as it comes
        reader = threading.Thread(target=lambda: said.extend((time.perf_counter(), x) for x in proc.stderr),
                                  daemon=True)
        reader.start()
        metrics = out / "metrics.jsonl"
        target = rng.randint(args.first_step, 2 * args.first_step + 1)
        while proc.poll() is None and (not metrics.exists() or metrics.read_text().count("\n") < target):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.1 * args.grad_accum))  # a random moment of a random step
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
        latency = time.perf_counter() - t0
        reader.join(10)
        # the step in progress undone between two of its micro-batches: training has stopped
        free = next((t - t0 for t, x in list(said) if t >= t0 and " undone after " in x), None)
        steps = [json.loads(line) for line in metrics.read_text().splitlines()]
        step = statistics.median(s["step_seconds"] for s in steps)
        con = sqlite3.connect(work / "home" / "ledger.db")
        saves = [r[0] for r in con.execute("SELECT durable_seconds FROM checkpoints WHERE path LIKE ?",
                                           (f"{out}/%",))]
        save = statistics.median(saves)
        rows.append((latency, step, save, free))
        stopped = "at a step's end" if free is None else f"training stopped {free:.3f} s"
        print(f"trial {trial + 1}: exit {code}, SIGTERM -> exit {latency:.3f} s ({stopped}); step p50 {step:.3f} s, "
              f"durable save p50 {save:.3f} s; ratio {latency / (step + save):.2f}", flush=True)
    lat = statistics.median(r[0] for r in rows)
    bound = statistics.median(r[1] + r[2] for r in rows)
    print(f"\nmedian SIGTERM -> exit {lat:.3f} s against one step + one save {bound:.3f} s: "
          f"ratio {lat / bound:.2f} (goal <= 1; process teardown included)")
    lats = [r[0] for r in rows]
    micro = statistics.median(r[1] for r in rows) / args.grad_accum
    save = statistics.median(r[2] for r in rows)
    print(f"SIGTERM -> exit p50 {percentile(lats, 50):.3f} s, p99 {percentile(lats, 99):.3f} s "
          f"(grad_accum {args.grad_accum}); one micro-batch {micro:.3f} s, one step {micro * args.grad_accum:.3f} s, "
          f"one save {save:.3f} s; p99 / (micro-batch + save) {percentile(lats, 99) / (micro + save):.2f}")
    # Each trial against its own run's micro-batch and save (a shared machine's load drifts between trials).
    own = [r[0] / (r[1] / args.grad_accum + r[2]) for r in rows]
    print(f"each trial's SIGTERM -> exit / (its micro-batch + its save): p50 {percentile(own, 50):.2f}, "
          f"p99 {percentile(own, 99):.2f} (goal <= 1 once a stop lands between micro-batches)")
    frees = [(r[3], r[3] / (r[1] / args.grad_accum)) for r in rows if r[3] is not None]
    if args.grad_accum > 1 and frees:
        print(f"SIGTERM -> training stopped (its step undone), {len(frees)} of {len(rows)} trials (the others "
              f"stopped at a step's end): p50 {percentile([f for f, _ in frees], 50):.3f} s, "
              f"p99 {percentile([f for f, _ in frees], 99):.3f} s; against each trial's own micro-batch: "
              f"p50 {percentile([x for _, x in frees], 50):.2f}, p99 {percentile([x for _, x in frees], 99):.2f} "
              f"(goal <= 1)")


if __name__ == "__main__":
    main()
