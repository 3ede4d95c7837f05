"""Round figures for the strategies' arithmetic, so each test works its expected values by hand:
one device peaks at 1000 bytes, 600 of them state and 200 activations; the step is 1 s of
compute over 4 micro-batches of 2 rows through 2 layers; every collective moves 100 bytes a
second with no latency."""

from __future__ import annotations

from ember.parallel.collectives import Interconnect, Link
from ember.parallel.strategy import Footprint, Ranks, Step

FP = Footprint(peak=1000, state=600, activations=200, weights=400, grads=400, layer=50, layer_share=0.8)
STEP = Step(seconds=1.0, accum=4, micro_batch=2, layers=2, act_bytes=100)
NET = Interconnect(2, 1, "gloo", Link(0.0, 100.0), Link(0.0, 100.0), Link(0.0, 100.0))


def ranks(n: int, overlap: bool = False, busy: float = 1.0) -> Ranks:
    return Ranks(n, busy, overlap, NET)
