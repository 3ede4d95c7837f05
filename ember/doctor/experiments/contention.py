"""Contention: other processes taking the cores. /proc during the baseline (load, other
processes' CPU, steal, this process's run-queue wait), and when it shows, train_step with fewer
threads against the recipe's, interleaved."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember.doctor.diagnose import ContentionFigures, Figures, difference
from ember.doctor.experiments.budget import MIN_SAMPLES, Budget
from ember.doctor.experiments.protocol import Lab, Result, interleave, timed_step


@dataclass
class Contention:
    """The /proc signals; with more than one thread and a sign of contention, fewer threads measured."""
    lab: Lab
    found: Figures
    name = "contention"
    changes = "train_step with fewer threads than the recipe's"

    def run(self, budget: Budget) -> Result:
        """figures["contention"]: the signals, and the fewer threads' steps when they were measured."""
        lab, cpu, out = self.lab, self.lab.cpu, Result(self.name)
        c = ContentionFigures(cpu["load"], cpu["runnable"], cpu["others"], cpu["steal"], cpu["wait_share"],
                              cpu["main_wait_share"] * self.found.baseline.step_seconds)
        out.figures["contention"] = c
        threads = lab.shape.threads
        if threads <= 1:
            return out
        if c.others_cores < 0.25 and c.wait_share < 0.05 and c.steal_share < 0.05:
            return out.skip(f"no sign of it: other processes used {c.others_cores:.2f} cores, "
                            f"run-queue wait {c.wait_share:.0%}; fewer threads not measured")
        fewer = max(1, min(threads - 1, int(lab.shape.cores - c.others_cores)))
        stop = budget.stop(self.name, lab.tolerance)
        # This runs only when other processes take the cores, and then a step with fewer threads
        # is no slower than one with more (20x faster here); the rounds are then sized from it.
        if not stop.fits(lab.step):
            return out.skip(f"fewer threads: a step may take ~{lab.step:.1f} s, {stop.left():.1f} s left of its share")
        lab.events.stage(f"doctor: {threads} threads against {fewer} (other processes use {c.others_cores:.1f} cores)")
        run = timed_step(lab.job, lab.in_memory())

        def at(n: int) -> Callable[[], float]:
            def one() -> float:
                torch.set_num_threads(n)  # no transient: the step right after a change is no slower
                return run()[0]
            return one
        try:
            first = at(fewer)()  # warm-up, and what a round will cost
            if not stop.fits(MIN_SAMPLES * (lab.step + first)):
                return out.skip(f"fewer threads: {MIN_SAMPLES} rounds need ~{MIN_SAMPLES * (lab.step + first):.1f} s, "
                                f"{stop.left():.1f} s left of its share")
            mine, less = interleave([(at(threads), 1, 0), (at(fewer), 1, 0)], stop, rounds=20,
                                    first_round=lab.step + first,
                                    effect=lambda got: difference(got[0], got[1], "mean", paired=True))
        finally:
            torch.set_num_threads(threads)
        if len(mine) < MIN_SAMPLES:  # the rounds ran slower than the first one said: no evidence
            return out.skip(f"fewer threads: only {len(mine)} rounds fitted")
        c.fewer_threads, c.at_threads, c.at_fewer = fewer, mine, less
        return out


def cpu_snapshot() -> dict[str, Any]:
    """Machine-wide CPU ticks (busy, steal), this process tree's ticks, its threads' run-queue wait."""
    with open("/proc/stat") as fh:
        cpu = [int(x) for x in fh.readline().split()[1:]]
    waits = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            run_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
            waits[task.name] = (run_ns, wait_ns)
        except (OSError, ValueError):
            continue
    return {"time": time.monotonic(), "busy": sum(cpu[:3]) + sum(cpu[5:7]), "steal": cpu[7] if len(cpu) > 7 else 0,
            "total": sum(cpu[:8]), "own": _tree_ticks(), "waits": waits}


def _tree_ticks() -> int:
    """CPU ticks used by this process (all threads), its reaped children and its live ones."""
    def ticks(pid: str) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15])
    total = ticks("self")
    for task in Path("/proc/self/task").iterdir():
        try:
            for child in (task / "children").read_text().split():
                total += ticks(child)
        except (OSError, ValueError, IndexError):
            continue
    return total


def cpu_since(before: dict[str, Any]) -> dict[str, float]:
    """What the machine and this process did since `before`: the contention signals."""
    now = cpu_snapshot()
    hz = os.sysconf("SC_CLK_TCK")
    wall = max(now["time"] - before["time"], 1e-9)
    run = wait = 0
    for tid, (r1, w1) in now["waits"].items():
        r0, w0 = before["waits"].get(tid, (0, 0))
        run, wait = run + r1 - r0, wait + w1 - w0
    main = str(os.getpid())  # the training thread
    main_wait = (now["waits"].get(main, (0, 0))[1] - before["waits"].get(main, (0, 0))[1]) / 1e9
    with open("/proc/loadavg") as fh:
        load = float(fh.read().split()[0])
    running = 0
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("procs_running"):
                running = int(line.split()[1])
    total = max(now["total"] - before["total"], 1)
    return {"load": load, "runnable": running,
            "others": max(0.0, (now["busy"] - before["busy"] - (now["own"] - before["own"])) / hz / wall),
            "steal": (now["steal"] - before["steal"]) / total,
            "wait_share": wait / max(run + wait, 1), "main_wait_share": main_wait / wall}
