"""The pipeline bubble when the stages' operations do not take the same time every time: a
simulation of the schedules over two stages, no torch, no processes.

(p-1)/(m+p-1) assumes every forward and every backward of a micro-batch takes the same time on
every stage. On a shared CPU they do not: each hand-off between the stages then waits for the
slower of two noisy operations, and those waits add up over a step's 2m hand-offs. This script
draws each operation's time from a lognormal with the given coefficient of variation (mean:
--forward and --backward seconds) and plays ember's two schedules over 2 stages as torch runs
them, each operation starting once its stage is free and its input has arrived (stage 1's
forward of micro-batch i needs stage 0's; stage 0's backward of i needs stage 1's; sends take no
time): gpipe (all forwards, then all backwards) and 1f1b (stage 0: F0 F1 B0 F2 B1 ... B(m-1);
stage 1: F0 B0 F1 B1 ...). The bubble of a stage is the step less its own operations, as a share
of the step (what ember.parallel.stages measures), averaged over the two stages; printed is the
median over --trials steps and its ratio to (p-1)/(m+p-1). Figures are printed, never asserted.

usage: python bench/pipeline_jitter.py [--cv 0 0.05 0.1 0.2 0.3] [--forward 0.17] [--backward 0.33]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

STAGES = 2


def orders(m: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Each stage's operations in the order the schedule runs them."""
    if schedule == "gpipe":
        return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(STAGES)]
    first = [("F", 0)] + [op for i in range(1, m) for op in (("F", i), ("B", i - 1))] + [("B", m - 1)]
    last = [op for i in range(m) for op in (("F", i), ("B", i))]
    return [first, last]


def bubble(m: int, schedule: str, seconds: dict[str, float], cv: float, rng: random.Random) -> float:
    """One step's bubble, the stages' mean share, each operation's time drawn with spread `cv`."""
    sigma = math.sqrt(math.log(1 + cv * cv))
    done: dict[tuple[str, int, int], float] = {}
    clock, busy = [0.0] * STAGES, [0.0] * STAGES
    queue = orders(m, schedule)
    at = [0] * STAGES
    while any(at[s] < len(queue[s]) for s in range(STAGES)):
        for s in range(STAGES):
            while at[s] < len(queue[s]):
                kind, i = queue[s][at[s]]
                needs = ("F", i, s - 1) if kind == "F" and s > 0 else \
                        ("B", i, s + 1) if kind == "B" and s < STAGES - 1 else None
                if needs is not None and needs not in done:
                    break  # the other stage has not sent it yet
                took = seconds[kind] * rng.lognormvariate(-sigma * sigma / 2, sigma)
                clock[s] = max(clock[s], done[needs] if needs else 0.0) + took
                busy[s] += took
                done[(kind, i, s)] = clock[s]
                at[s] += 1
    step = max(clock)
    return statistics.fmean((step - b) / step for b in busy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cv", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.15, 0.2, 0.3])
    ap.add_argument("--forward", type=float, default=0.17, help="a stage's forward of a micro-batch, seconds")
    ap.add_argument("--backward", type=float, default=0.33, help="and its backward")
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.trials < 1 or args.forward <= 0 or args.backward <= 0 or min(args.cv) < 0:
        raise SystemExit("--trials must be at least 1, --forward and --backward above 0, every --cv at least 0")
    rng = random.Random(args.seed)
    seconds = {"F": args.forward, "B": args.backward}
    cases = [(m, s) for m in (2, 4, 8) for s in ("gpipe", "1f1b")]
    print("| spread (CV) of an operation | " + " | ".join(f"{s}, m={m}" for m, s in cases) + " |")
    print("| --- |" + " ---: |" * len(cases))
    for cv in args.cv:
        cells = []
        for m, schedule in cases:
            share = statistics.median(bubble(m, schedule, seconds, cv, rng) for _ in range(args.trials))
            cells.append(f"{share:.1%} ({share / ((STAGES - 1) / (m + STAGES - 1)):.2f})")
        print(f"| {cv:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
