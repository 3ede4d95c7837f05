"""What ranks need of this machine's memory: one rank's bytes at the step's peak under a strategy
of the registry (ember/parallel, each strategy's own `memory`), from the plan's one-process
estimate, and where those bytes land. Ranks on accelerators hold a device each (`ember run
--nproc N` gives local rank i device i); CPU ranks are processes of one machine, so together they
hold N x one rank's bytes of its host RAM. The advisor (ember.plan.advisor), the FSDP remedy
(ember.plan.remedies) and the check before a distributed launch (ember.launch) read these."""

from __future__ import annotations

from dataclasses import dataclass

from ember.hardware import Device
from ember.parallel.registry import STRATEGIES
from ember.parallel.strategy import Footprint
from ember.plan.memory import F32, Breakdown, ModelShape, TrainShape, estimate


def tp_share(m: ModelShape) -> float:
    """Share of a token's matmul FLOPs inside the decoder layers (what TP splits)."""
    layers = m.layers * sum(i * o for i, o in m.linear_shapes().values())
    return layers / (layers + m.vocab * m.hidden)


def footprint(m: ModelShape, b: Breakdown) -> Footprint:
    """One process's estimate (`b`) as the strategies' arithmetic reads it."""
    # fp32 master weights (autocast computes in bf16/fp16 from them) and the trained ones' gradients
    return Footprint(b.peak, b.weights + b.gradients + b.optimizer, b.activations, m.params() * F32,
                     b.trainable * F32, m.layer_params() * F32, tp_share(m))


@dataclass(frozen=True)
class RankMemory:
    """A strategy over `world` ranks, `local` of them on this machine's devices."""
    strategy: str
    world: int
    local: int
    per_rank: int   # bytes one rank holds at the step's peak (the strategy's arithmetic)
    need: int       # bytes one device here must hold: a rank's, or every local rank's in shared host RAM
    free: int       # bytes free on the fullest device the local ranks use
    shared: bool    # the local ranks are processes sharing host RAM (no accelerator)
    missing: int    # accelerators the local ranks lack here (0: one each)


def rank_memory(m: ModelShape, t: TrainShape, strategy: str, world: int, local: int,
                devices: list[Device]) -> RankMemory:
    """What `local` ranks of a `world`-rank run under `strategy` need of `devices` (the run's,
    ember.hardware.for_run: all of one kind)."""
    b = estimate(m, t)
    per = int(STRATEGIES[strategy].memory(footprint(m, b), world)) if world > 1 else b.peak
    shared = not devices[0].accelerator
    used = devices[:1] if shared else sorted(devices, key=lambda d: d.index)[:local]
    return RankMemory(strategy, world, local, per, per * local if shared else per, min(d.free for d in used),
                      shared, 0 if shared else max(0, local - len(devices)))
