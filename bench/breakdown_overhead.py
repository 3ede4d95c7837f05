"""What the always-on step breakdown costs: ember's own train_step with the breakdown's timer
against the same step with a timer that records nothing, alternating in one process on the
same job, median over rounds. Goal (doctor issue): under 2% of step time.

usage: python bench/breakdown_overhead.py [--rounds 7] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ember.events import Events  # noqa: E402

from bench.loop_overhead import CONFIG  # noqa: E402
from ember.recipe import build_recipe  # noqa: E402
from ember.train.breakdown import PHASES, StepTimer  # noqa: E402
from ember.train.job import prepare  # noqa: E402
from ember.train.loop import Data, train_step  # noqa: E402


class NoTimer:
    """The baseline: the same calls, nothing measured."""

    def begin(self) -> None: ...
    def lap(self, phase: str) -> None: ...
    def wait(self, phase: str) -> None: ...
    def end(self) -> dict[str, float]:
        return dict.fromkeys(PHASES, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="ember-breakdown-bench-"))
    os.environ["EMBER_HOME"] = str(home)
    raw = json.loads(json.dumps(CONFIG))
    raw["train"]["max_steps"] = 10**9
    job = prepare(build_recipe(raw, "bench"), home / "run", False, Events(), ledger_path=False)
    data = Data(job)
    timers = {"breakdown": StepTimer(job.device), "none": NoTimer()}
    medians: dict[str, list[float]] = {k: [] for k in timers}
    for _ in range(3):
        train_step(job, data)  # warm-up
    for r in range(args.rounds):
        for name in (("breakdown", "none") if r % 2 else ("none", "breakdown")):
            job.timer = timers[name]
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                train_step(job, data)
                times.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(times))
        print(f"round {r + 1}: with breakdown {medians['breakdown'][-1] * 1000:.2f} ms, without "
              f"{medians['none'][-1] * 1000:.2f} ms", flush=True)
    a, b = statistics.median(medians["breakdown"]), statistics.median(medians["none"])
    print(f"\nstep time with the breakdown {a * 1000:.2f} ms, without {b * 1000:.2f} ms: overhead "
          f"{a / b - 1:+.2%} (goal < 2%)")


if __name__ == "__main__":
    main()
