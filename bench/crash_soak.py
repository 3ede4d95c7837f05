"""The long crash-consistency soak: SIGKILL a training run N times (default 1,000) at random
moments and at fault points, restart it after each kill, check after each that no committed
checkpoint is torn or lost, and at the end that per-step losses and final weights equal the
uninterrupted run's bit-for-bit. Prints the count of kills by kind and any violation.
With --power-cuts every kill is followed by a simulated power cut (tests/powercut_fs.py: all
writes and folder changes not made durable by fsync are forgotten).

usage: python bench/crash_soak.py [--kills 1000] [--seed 1] [--power-cuts]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests import crash_harness  # noqa: E402
from tests.helpers import assert_same_result, losses, run_ember, write_recipe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--power-cuts", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-crash-soak-"))
    os.environ["EMBER_HOME"] = str(work / "home")
    steps = max(3000, args.kills * 60)
    recipe = write_recipe(work, train={"max_steps": steps, "micro_batch": 2}, data={"seq_len": 16},
                          schedule={"kind": "constant"}, checkpoint={"every_steps": 7, "keep_last": 2})
    t0 = time.time()
    assert run_ember("run", recipe, "--out", work / "base", "--no-ledger", timeout=7200).returncode == 0
    print(f"baseline: {steps} steps in {time.time() - t0:.0f} s", flush=True)
    t0 = time.time()

    def progress(s: crash_harness.CrashStats) -> None:
        print(f"{s.kills} kills, {time.time() - t0:.0f} s, violations {len(s.violations)}", flush=True)

    if args.power_cuts:
        stats = crash_harness.power_cuts(recipe, work / "cut", args.kills, args.seed,
                                         losses(work / "base"), progress=progress)
        run = work / "cut" / "disk" / "run"
    else:
        stats = crash_harness.crash_and_resume(recipe, work / "run", args.kills, args.seed,
                                               progress=progress)
        run = work / "run"
    print(f"\nkills: {stats.kills} in {time.time() - t0:.0f} s; by kind: {stats.by_fault}")
    print(f"violations: {stats.violations or 'none'}")
    try:
        assert_same_result(run, work / "base")
        print("final per-step losses and weights: bit-for-bit equal to the uninterrupted run")
    except AssertionError as e:
        print(f"final result DIFFERS from the uninterrupted run: {e}")


if __name__ == "__main__":
    main()
