"""Remote jobs on a real one-node Slurm (tests/slurm_cluster.sh, started and stopped here).

1. Submission overhead: seconds from `ember submit --target` (plan, gate, audit, staging verified
   on arrival, sbatch, the allocation process, srun) to the first training step, against `sbatch`
   of a hand-written batch script that runs `ember run` on the same recipe and data (the baseline),
   alternating A, B, A, B. The first step's time is the `time` of the run's first metrics line.
2. Goodput of a job requeued twice (`scontrol requeue` at two points of its run) against the same
   job uninterrupted, both submitted with `ember submit --target` and read back with
   `ember report`; also the time from submission to the end, which includes the requeued job's
   waits in the queue (not in goodput: the job holds no node then). Both must end bit-identical.

Needs root (the Slurm daemons, and Debian's packages when missing).

usage: python bench/remote.py [--rounds 3] [--steps 300] [--no-goodput]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["EMBER_TEST_COLD"] = "1"  # each `ember` a fresh interpreter, as a user's: not the tests' warm fork

from ember.policy.registry import register  # noqa: E402
from tests.helpers import GENESIS, assert_same_result, run_ember, write_recipe  # noqa: E402

SCRIPT = ROOT / "tests" / "slurm_cluster.sh"
TARGET = """
[targets.local]
kind = "slurm"
device = "cpu"
device_hour_price = 1.0
max_nodes = 1
max_wall_hours = 2
max_device_hours = 2
max_cost_per_job = 2
max_cost_per_month = 1000
allowed_classifications = ["public"]
stage_dir = "{stage}"
signal_seconds = 30
"""
LIMITS = ["--max-wall-hours", "1", "--max-device-hours", "1", "--max-cost", "1", "--max-nodes", "1"]
HAND_WRITTEN = """#!/bin/bash
#SBATCH --job-name=hand
#SBATCH --time=60
#SBATCH --output={out}.slurm
exec {python} -m ember run {recipe} --out {out} --no-ledger
"""


def first_step_time(metrics: Path, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            return json.loads(metrics.read_text().splitlines()[0])["time"]
        time.sleep(0.05)
    raise SystemExit(f"{metrics}: no first step within {timeout:.0f} s")


def steps(metrics: Path) -> int:
    return metrics.read_text().count("\n") if metrics.exists() else 0


def wait_steps(metrics: Path, n: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while steps(metrics) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{metrics}: step {n} not reached within {timeout:.0f} s")
        time.sleep(0.1)


def wait_idle(timeout: float = 300) -> None:
    """Until the cluster runs nothing (each measurement starts on an idle node)."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            raise SystemExit("the queue did not empty")
        time.sleep(0.2)


class Bench:
    def __init__(self, root: Path, steps_: int):
        self.root = root
        data = root / "data" / "genesis.jsonl"
        data.parent.mkdir()
        data.write_bytes(GENESIS.read_bytes())
        self.recipe = write_recipe(root / "project", data={"files": [str(data)], "seq_len": 128},
                                   train={"max_steps": steps_, "micro_batch": 8},
                                   checkpoint={"every_steps": 25})
        (root / "targets.toml").write_text(TARGET.format(stage=root / "stage"))
        register(root / "datasets.toml", "genesis", [data], "bench", "CC0-1.0", "public", ["local"], "")
        self.n = 0

    def files(self) -> list[str]:
        return ["--registry", str(self.root / "datasets.toml"), "--targets", str(self.root / "targets.toml"),
                "--ledger", str(self.root / "ledger.db")]

    def submit(self, name: str) -> tuple[float, float, str]:
        """(submission start, submit command's seconds, Slurm id)."""
        t0 = time.time()
        done = run_ember("submit", self.recipe, "--target", "local", *LIMITS, "--name", name, "--out",
                         self.root / "results" / name, *self.files())
        assert done.returncode == 0, done.stderr
        return t0, time.time() - t0, done.stdout.split("Slurm job ")[1].split()[0]

    def ember_first_step(self) -> tuple[float, float]:
        self.n += 1
        name = f"overhead-{self.n}"
        t0, submit_s, job = self.submit(name)
        first = first_step_time(self.root / "stage" / name / name / "metrics.jsonl")
        subprocess.run(["scancel", job], check=True)
        wait_idle()
        return first - t0, submit_s

    def hand_first_step(self) -> float:
        self.n += 1
        out = self.root / f"hand-{self.n}"
        script = self.root / f"hand-{self.n}.sh"
        script.write_text(HAND_WRITTEN.format(out=out, python=sys.executable, recipe=self.recipe))
        t0 = time.time()
        job = subprocess.run(["sbatch", "--parsable", str(script)], check=True, capture_output=True,
                             text=True).stdout.strip()
        first = first_step_time(out / "metrics.jsonl")
        subprocess.run(["scancel", job], check=True)
        wait_idle()
        return first - t0

    def goodput_run(self, name: str, requeue_at: list[int]) -> dict:
        t0, _, job = self.submit(name)
        metrics = self.root / "stage" / name / name / "metrics.jsonl"
        for k in requeue_at:
            wait_steps(metrics, k)
            subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
            time.sleep(1)
        done = run_ember("remote", "status", job, "--wait", "--timeout", "1200", "--json",
                         "--ledger", str(self.root / "ledger.db"), timeout=1300)
        (st,) = json.loads(done.stdout)
        assert st["job"]["state"] == "completed", st
        end = time.time()
        report = json.loads(run_ember("report", st["job"]["out"], "--json", "--ledger",
                                      str(self.root / "ledger.db")).stdout)
        report["end_to_end"] = end - t0
        report["out"] = st["job"]["out"]
        return report


def describe(name: str, r: dict) -> None:
    g = r["goodput"]
    wall = g["wall_seconds"]
    parts = ", ".join(f"{k} {v / wall:.1%}" for k, v in sorted(g["buckets"].items(), key=lambda kv: -kv[1])
                      if v > 0.005 * wall)
    print(f"{name}: {r['run']['steps']} steps, {r['run']['attempts']} attempts, held {wall:.1f} s, goodput "
          f"{g['goodput']:.1%}, lost steps {g['lost_steps']}, submit to end {r['end_to_end']:.1f} s, cost "
          f"{r['cost']['total']:.4f}; {parts}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps of the goodput job")
    ap.add_argument("--no-goodput", action="store_true", help="part 1 only: submission to the first step")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/remote.py: not run: a real Slurm needs root here (its daemons, and installing them)")
        return
    tmp = Path(tempfile.mkdtemp(prefix="ember-bench-remote-"))
    state = tmp / "slurm"
    started = subprocess.run([str(SCRIPT), "start", str(state)], capture_output=True, text=True)
    if started.returncode != 0:
        raise SystemExit(started.stderr)
    os.environ["SLURM_CONF"] = started.stdout.strip().split("=", 1)[1]
    try:
        b = Bench(tmp, args.steps)
        ember, submits, hand = [], [], []
        for _ in range(args.rounds):
            e, s = b.ember_first_step()
            ember.append(e)
            submits.append(s)
            hand.append(b.hand_first_step())
            print(f"round: ember submit -> first step {e:.2f} s (the submit command {s:.2f} s); "
                  f"hand-written sbatch -> first step {hand[-1]:.2f} s", flush=True)
        me, mh, ms = statistics.median(ember), statistics.median(hand), statistics.median(submits)
        print(f"submission to first step, median of {args.rounds}: ember {me:.2f} s (its submit command {ms:.2f} s), "
              f"hand-written sbatch {mh:.2f} s; ember's overhead {me - mh:+.2f} s (x{me / mh:.2f})")
        if args.no_goodput:
            return
        plain = b.goodput_run("plain", [])
        describe("uninterrupted", plain)
        third = args.steps // 3
        twice = b.goodput_run("requeued", [third, 2 * third])
        describe("requeued twice", twice)
        print(f"goodput requeued twice / uninterrupted: {twice['goodput']['goodput'] / plain['goodput']['goodput']:.3f}")
        assert_same_result(Path(twice["out"]), Path(plain["out"]))
        print("the requeued job's losses and final weights are bit-identical to the uninterrupted job's")
    finally:
        subprocess.run([str(SCRIPT), "stop", str(state)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
