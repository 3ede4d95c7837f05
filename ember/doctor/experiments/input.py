"""The input pipeline: train_step on the real loader against one in-memory micro-batch,
interleaved (`InputPipeline`); then the pipeline alone, nothing consuming, at the recipe's micro
batch and the sweep's, and the loader workers that would keep up with the model (`Loader`)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

from ember.doctor.diagnose import Figures, InputFigures, difference
from ember.doctor.experiments.budget import MIN_SAMPLES, Budget, Stop
from ember.doctor.experiments.protocol import Lab, Result, interleave, timed_step
from ember.train.loop import Data


@dataclass
class InputPipeline:
    """train_step on the real loader against one in-memory micro-batch, interleaved. With loader
    workers, each real block first drains what the workers prefetched meanwhile."""
    lab: Lab
    found: Figures
    name = "input"
    changes = "the real input pipeline replaced by one in-memory micro-batch"

    def run(self, budget: Budget) -> Result:
        """figures["input"], or a skip saying why not."""
        lab, out = self.lab, Result(self.name)
        stop = budget.stop(self.name, lab.tolerance)
        shape = lab.shape
        drain = math.ceil(4 * shape.workers / shape.grad_accum) if shape.workers else 0
        round_cost = (drain + 2) * lab.step  # a real step (after the drain) and an in-memory one
        if not stop.fits(MIN_SAMPLES * round_cost):
            return out.skip(f"needs ~{MIN_SAMPLES * round_cost:.1f} s, {stop.left():.1f} s left of its share")
        lab.events.stage("doctor: the input pipeline against in-memory batches")
        data = Data(lab.job)
        try:
            real, memory = interleave([(timed_step(lab.job, data), drain + 1, drain),
                                       (timed_step(lab.job, lab.in_memory()), 1, 0)],
                                      stop, first_round=round_cost,
                                      effect=lambda got: difference([s for s, _ in got[0]], [s for s, _ in got[1]],
                                                                    paired=True))
        finally:
            data.close()
        if len(real) < MIN_SAMPLES:
            return out.skip(f"only {len(real)} steps fitted")
        wait = statistics.median(p["data"] for _, p in real)
        per_loader = shape.grad_accum / max(wait, 1e-6) if not shape.workers else 0.0
        out.figures["input"] = InputFigures([s for s, _ in real], [s for s, _ in memory], wait, None, per_loader,
                                            shape.workers)
        return out


@dataclass
class Loader:
    """The input pipeline alone, nothing consuming (its workers started first): seconds a
    micro-batch at the recipe's micro batch and at the sweep's; then the loader workers that
    would keep up with the model."""
    lab: Lab
    found: Figures
    name = "loader"
    changes = "nothing consumes the input pipeline"

    def run(self, budget: Budget) -> Result:
        """The input and sweep figures found so far, completed with the pipeline's own rates."""
        r, out, stop = self.lab.recipe, Result(self.name), budget.stop(self.name)
        i, sw = self.found.input, self.found.sweep
        sizes = [r.train.micro_batch] + ([p.micro_batch for p in sw.points] if sw is not None else [])
        start = 0.2 + 0.3 * self.lab.shape.workers  # the workers' start-up, each time
        rates: dict[int, float] = {}
        if stop.left() > len(sizes) * (start + 0.1):
            self.lab.events.stage("doctor: the input pipeline alone")
            rates = self._rates(sizes, stop)
        else:
            out.skip(f"{stop.left():.1f} s left of its share")
        if sw is not None:
            out.figures["sweep"] = dataclasses.replace(sw, loader_seconds={k: 1 / v for k, v in rates.items()})
        if i is not None:
            out.figures["input"] = self._workers(i, rates.get(r.train.micro_batch))
        return out

    def _rates(self, sizes: list[int], stop: Stop) -> dict[int, float]:
        """Micro-batches per second the pipeline delivers at each micro batch in `sizes`."""
        from ember.ckpt.state import DataCursor
        from ember.data.loader import PackedBatches, make_loader, resolve_packing
        r, job = self.lab.recipe, self.lab.job
        rates = {}
        for n, mb in enumerate(sizes):
            until = time.monotonic() + stop.left() / (len(sizes) - n)
            packed = PackedBatches(job.tokens_path, r.data.seq_len, mb, r.train.seed, DataCursor(),
                                   *resolve_packing(r.data, job.tokens_path))
            it = iter(make_loader(packed, 10**6, r.data.workers, pin=False))
            next(it)
            got, t0 = 0, time.perf_counter()
            while got < 40 and (got < MIN_SAMPLES or time.monotonic() < until):
                next(it)
                got += 1
            rates[mb] = got / max(time.perf_counter() - t0, 1e-9)
            del it  # stops its workers
        return rates

    def _workers(self, i: InputFigures, rate: float | None) -> InputFigures:
        """`i` with the pipeline's measured rate and the workers that would keep up with the model."""
        workers, cores = self.lab.shape.workers, self.lab.shape.cores
        per_worker = i.per_worker_batches_per_second
        if rate and (workers or not per_worker):
            per_worker = rate / max(1, workers)
        consume = self.lab.shape.grad_accum / max(statistics.median(i.in_memory), 1e-9)
        if not per_worker:  # workers, and no time to measure them: assume they keep up
            per_worker = consume
        return dataclasses.replace(i, loader_batches_per_second=rate, per_worker_batches_per_second=per_worker,
                                   suggested_workers=min(cores, max(2, math.ceil(1.5 * consume / per_worker))))
