"""torch.profiler over a few steps of train_step on one in-memory micro-batch: the top operators.
Evidence only (it changes nothing, so it compares nothing): it comes last."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ember.doctor.diagnose import Figures, TopOp
from ember.doctor.experiments.budget import Budget
from ember.doctor.experiments.protocol import Lab, Result, timed_step

PROFILER_START_SECONDS = 4.0  # torch.profiler's first use in a process: 4.2 s on a busy 2-core machine


@dataclass
class Profile:
    """torch.profiler over a few steps: the top operators (a profiled step takes ~3 plain ones)."""
    lab: Lab
    found: Figures
    steps: int = 3
    name = "profile"
    changes = "nothing: the profiler watches the recipe's step"

    def run(self, budget: Budget) -> Result:
        """figures["top_ops"]: the eight operators that took the most time, with their share."""
        lab, out, stop = self.lab, Result(self.name), budget.stop(self.name)
        need = PROFILER_START_SECONDS + 3 * self.steps * lab.step
        if not stop.fits(need):
            return out.skip(f"needs ~{need:.1f} s, {stop.left():.1f} s left of its share")
        lab.events.stage("doctor: profiling the compute")
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        cuda = lab.job.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # kineto's start/stop lines
        run = timed_step(lab.job, lab.in_memory())
        try:
            with torch_profile(activities=activities) as prof:
                for _ in range(self.steps):
                    run()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        found = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
        total = sum(getattr(e, key) for e in found) or 1
        top = sorted(found, key=lambda e: -getattr(e, key))[:8]
        out.figures["top_ops"] = [TopOp(e.key, getattr(e, key) / total, e.count, getattr(e, key) / 1e6 / self.steps)
                                  for e in top]
        return out
