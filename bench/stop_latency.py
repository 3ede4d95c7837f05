"""Time from SIGTERM to exit with a durable checkpoint, against one step plus one save measured
in the same run. Goal (long-runs issue): latency <= one step + one save.

The builtin tiny model at seq_len 512 x micro batch 16 (~0.1-0.2 s a step here); SIGTERM lands at
a random moment of a random step; the run is then resumed once to check the checkpoint it
wrote on the way out is the one it resumes from.

usage: python bench/stop_latency.py [--trials 5]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.helpers import write_recipe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-stop-bench-"))
    os.environ["EMBER_HOME"] = str(work / "home")
    rng = random.Random(0)
    recipe = write_recipe(work, train={"max_steps": 10_000, "micro_batch": 16, "threads": 0},
                          data={"seq_len": 512}, checkpoint={"every_steps": 10})
    rows = []
    for trial in range(args.trials):
        out = work / f"run{trial}"
        proc = subprocess.Popen([sys.executable, "-m", "ember", "run", str(recipe), "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        metrics = out / "metrics.jsonl"
        target = rng.randint(12, 25)
        while proc.poll() is None and (not metrics.exists() or metrics.read_text().count("\n") < target):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.1))
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
        latency = time.perf_counter() - t0
        steps = [json.loads(line) for line in metrics.read_text().splitlines()]
        step = statistics.median(s["step_seconds"] for s in steps)
        con = sqlite3.connect(work / "home" / "ledger.db")
        saves = [r[0] for r in con.execute("SELECT durable_seconds FROM checkpoints WHERE path LIKE ?",
                                           (f"{out}/%",))]
        save = statistics.median(saves)
        rows.append((latency, step, save))
        print(f"trial {trial + 1}: exit {code}, SIGTERM -> exit {latency:.3f} s; step p50 {step:.3f} s, "
              f"durable save p50 {save:.3f} s; ratio {latency / (step + save):.2f}", flush=True)
    lat = statistics.median(r[0] for r in rows)
    bound = statistics.median(r[1] + r[2] for r in rows)
    print(f"\nmedian SIGTERM -> exit {lat:.3f} s against one step + one save {bound:.3f} s: "
          f"ratio {lat / bound:.2f} (goal <= 1; process teardown included)")


if __name__ == "__main__":
    main()
