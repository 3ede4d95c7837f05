"""Round figures for the strategies' arithmetic, so each test works its expected values by hand:
one device peaks at 1000 bytes, 600 of them state and 200 activations; the step is 1 s of
compute over 4 micro-batches of 2 rows through 2 layers; every collective moves 100 bytes a
second with no latency. A pipeline stage: 100 bytes of state per layer (20 of them gradients) and
10 of activations per micro-batch; the embeddings 50 (10) and 5; the head and the loss 60 (10)
and 30, with 40 more while the loss differentiates; 2 bytes of hidden states between stages, 1
saved by every stage's forward, 30 of update temporaries; 4 micro-batches under 1F1B, 2 stages
per pipeline under 'pp+ddp'."""

from __future__ import annotations

from ember.parallel.collectives import Interconnect, Link
from ember.parallel.strategy import Footprint, Part, Ranks, StageParts, Step

PARTS = StageParts(layers=2, layer=Part(100, 20, 10), first=Part(50, 10, 5), last=Part(60, 10, 30, transient=40),
                   boundary=2, per_forward=1, update=30, pipeline=(4, "1f1b", 2))
FP = Footprint(peak=1000, state=600, activations=200, weights=400, grads=400, layer=50, layer_share=0.8,
               stages=PARTS)
STEP = Step(seconds=1.0, accum=4, micro_batch=2, layers=2, act_bytes=100)
NET = Interconnect(2, 1, "gloo", Link(0.0, 100.0), Link(0.0, 100.0), Link(0.0, 100.0))


def ranks(n: int, overlap: bool = False, busy: float = 1.0) -> Ranks:
    return Ranks(n, busy, overlap, NET)
