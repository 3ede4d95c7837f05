"""The micro-batch sweep: train_step at each larger micro batch the memory plan says fits
(grad_accum 1, in-memory), interleaved with the recipe's: forward and backward per sample."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.doctor.diagnose import Difference, Figures, SweepFigures, SweepPoint, difference
from ember.doctor.experiments.budget import MIN_SAMPLES, Budget, Stop
from ember.doctor.experiments.protocol import Lab, Result, interleave, timed_step
from ember.models import model_config
from ember.hardware import for_run
from ember.plan.memory import estimate
from ember.plan.planner import modelled_shape
from ember.plan.remedies import fits, train_shape
from ember.recipe import Recipe


@dataclass
class Sweep:
    """Each larger micro batch that fits, interleaved with the recipe's (grad_accum 1, in-memory)."""
    lab: Lab
    found: Figures
    name = "sweep"
    changes = "a larger micro batch (grad_accum 1, one in-memory micro-batch)"

    def run(self, budget: Budget) -> Result:
        """figures["sweep"]: a point for each larger micro batch measured, and a skip for each not."""
        lab, out = self.lab, Result(self.name)
        stop = budget.stop(self.name, lab.tolerance)
        mb = lab.recipe.train.micro_batch
        fitting = fitting_micro_batches(lab.recipe)
        larger = sorted(k for k in fitting if k > mb)
        if not larger:
            return out.skip(f"no micro batch larger than {mb} fits (memory plan)")
        lab.events.stage("doctor: micro-batch sweep " + ", ".join(map(str, [mb] + larger)))
        one = lab.step / lab.recipe.train.grad_accum  # a step of one micro-batch, roughly
        reference = self._at(mb)
        points = []
        for n, k in enumerate(larger):
            cost = one * (1 + k / mb)  # a round: one step at each size (per-sample time at most flat)
            if not stop.fits(one * k / mb + MIN_SAMPLES * cost):
                out.skip(f"micro batch {', '.join(map(str, larger[n:]))}: needs "
                         f"~{one * k / mb + MIN_SAMPLES * cost:.1f} s, {stop.left():.1f} s left")
                break
            run = self._at(k)
            run()  # warm-up: this size's allocations
            share = Stop(time.monotonic() + stop.left() / (len(larger) - n), stop.tolerance)
            ref, got = interleave([(reference, 1, 0), (run, 1, 0)], share, rounds=8, first_round=cost,
                                  effect=lambda arms, k=k: self._effect(arms[0], arms[1], k))
            if len(got) < MIN_SAMPLES:  # rounds slower than estimated (a busy machine): no evidence
                out.skip(f"micro batch {k}: only {len(got)} rounds fitted")
                continue
            points.append(SweepPoint(k, [s for s, _ in got], [_compute(p) for _, p in got],
                                     [_compute(p) for _, p in ref]))
        if points:
            out.figures["sweep"] = SweepFigures(points, fitting)
        return out

    def _at(self, k: int) -> Callable[[], tuple[float, dict[str, float]]]:
        """One train_step at micro batch `k`, grad_accum 1, on the first micro-batch's rows."""
        job = self.lab.job
        single = dataclasses.replace(job, recipe=job.recipe.with_changes(
            {"train.micro_batch": k, "train.grad_accum": 1}, "the micro-batch sweep"))
        return timed_step(single, self.lab.in_memory(self.lab.batch.rows(k)))

    def _effect(self, ref: list[Any], got: list[Any], k: int) -> Difference:
        """Forward and backward per sample at the recipe's micro batch against `k`, as seconds a step."""
        mb, accum = self.lab.recipe.train.micro_batch, self.lab.recipe.train.grad_accum
        d = difference([_compute(p) / mb for _, p in ref], [_compute(p) / k for _, p in got], paired=True)
        return Difference(d.seconds * mb * accum, d.low * mb * accum, d.high * mb * accum)


def _compute(phases: dict[str, float]) -> float:
    return phases["h2d"] + phases["forward"] + phases["backward"]


def fitting_micro_batches(r: Recipe) -> dict[int, int]:
    """Micro batches 1, 2, 4, ... up to 4x the recipe's (at least 8) whose estimated peak fits,
    with that peak (memory arithmetic only: no calibration per size)."""
    try:
        m = modelled_shape(model_config(r.model.path), r.method)
    except ValueError:  # an architecture (or adapters) the plan does not know: only the recipe's own size
        return {r.train.micro_batch: 0}
    free = for_run(r.train.device)[0].free
    out = {}
    mb = 1
    while mb <= max(8, 4 * r.train.micro_batch):
        peak = estimate(m, train_shape(r.with_changes({"train.micro_batch": mb}, "the micro-batch sweep"))).peak
        if not fits(peak, free, r.plan.memory_margin):
            break
        out[mb] = peak
        mb *= 2
    return out
