"""Goodput under a fault schedule: a supervised tiny run (`ember run --restarts`) whose training
process is SIGKILLed every 20-60 s (uniform) for about ten minutes. Reports goodput (share of
wall-clock in steps that count), where the rest went (restart backoff and start-up, restore,
lost progress, checkpoints), the lost-progress share, and the same figures for an uninterrupted
run of the same recipe and length measured afterwards, in the same session, as the baseline;
the two must also end with bit-for-bit equal losses and weights.

usage: python bench/fault_goodput.py [--minutes 10] [--seed 0]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.helpers import assert_same_result, run_ember, write_recipe  # noqa: E402

RECIPE = {"train": {"micro_batch": 8, "restart_backoff_seconds": 1.0},
          "data": {"seq_len": 64}, "schedule": {"kind": "constant"},
          "checkpoint": {"every_steps": 1_000_000, "every_seconds": 10.0, "keep_last": 2}}


def report(out: Path) -> dict:
    result = run_ember("report", out, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def describe(name: str, r: dict) -> None:
    g = r["goodput"]
    wall = g["wall_seconds"]
    parts = ", ".join(f"{k} {v / wall:.1%}" for k, v in sorted(g["buckets"].items(), key=lambda kv: -kv[1])
                      if v > 0)
    print(f"{name}: {r['run']['steps']} steps, {r['run']['attempts']} attempts, wall {wall:.0f} s, "
          f"goodput {g['goodput']:.1%}; lost steps {g['lost_steps']}; {parts}", flush=True)


def child_pid(out: Path, supervisor: int) -> int | None:
    """The newest attempt's PID, if it is alive and a child of the supervisor we started."""
    try:
        pid = json.loads((out / "attempts.jsonl").read_text().splitlines()[-1])["pid"]
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pid if ppid == supervisor else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-fault-goodput-"))
    os.environ["EMBER_HOME"] = str(work / "home")
    rng = random.Random(args.seed)

    # A short uninterrupted calibration sizes the faulted run.
    calib = write_recipe(work / "calib", **{**RECIPE, "train": {**RECIPE["train"], "max_steps": 600}})
    assert run_ember("run", calib, "--out", work / "calib" / "run").returncode == 0
    base = report(work / "calib" / "run")
    step_s = report(work / "calib" / "run")["step_time"]["p50"]
    steps = int(args.minutes * 60 * 0.8 / step_s)  # ~80% of the window is productive under faults
    recipe = write_recipe(work / "fault", **{**RECIPE, "train": {**RECIPE["train"], "max_steps": steps}})

    out = work / "fault" / "run"
    sup = subprocess.Popen([sys.executable, "-m", "ember", "run", str(recipe), "--out", str(out),
                            "--restarts", "1000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT)
    t0, kills = time.time(), []
    while sup.poll() is None:
        wait = rng.uniform(20, 60)
        deadline = time.time() + wait
        while sup.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        pid = child_pid(out, sup.pid)
        if pid is not None and sup.poll() is None:
            os.kill(pid, signal.SIGKILL)
            kills.append(time.time() - t0)
            print(f"  SIGKILL at {kills[-1]:.0f} s (after {wait:.0f} s)", flush=True)
    _, err = sup.communicate()
    print(f"supervisor exit {sup.returncode} after {time.time() - t0:.0f} s, {len(kills)} kills", flush=True)
    assert sup.returncode == 0, err[-2000:]
    faulted = report(out)

    plain = work / "plain"
    assert run_ember("run", recipe, "--out", plain, timeout=7200).returncode == 0
    base = report(plain)
    describe("uninterrupted", base)
    describe("under faults ", faulted)
    g = faulted["goodput"]
    lost = g["buckets"].get("wasted_progress", 0) / g["wall_seconds"]
    print(f"\ngoodput under a SIGKILL every 20-60 s: {g['goodput']:.1%} (uninterrupted, same steps: "
          f"{base['goodput']['goodput']:.1%}); lost progress {lost:.1%} of wall-clock; "
          f"{len(kills)} kills, mean {len(kills) and (kills[-1] / len(kills)):.0f} s apart; wall "
          f"{g['wall_seconds'] / base['goodput']['wall_seconds']:.2f}x the uninterrupted run's")
    assert_same_result(out, plain)
    print("final per-step losses and weights: bit-for-bit equal to an uninterrupted run of the same length")


if __name__ == "__main__":
    main()
