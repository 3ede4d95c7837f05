"""Where a rank sits in a pipeline, torch-free: the decoder layers each stage holds, and how
messages (the launcher's, the watchdog's) name a rank by its stage. The stages themselves:
ember/parallel/stages.py; the strategy: ember/parallel/pp.py."""

from __future__ import annotations


def layer_range(layers: int, stages: int, stage: int) -> range:
    """The decoder layers of `stage`: consecutive, the first stages one more when they do not split evenly."""
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def rank_name(rank: int, stages: int = 1, layers: int = 0, replicas: int = 1) -> str:
    """How a message names a rank: 'rank 1'; a pipeline stage with its place and the decoder layers
    it holds, numbered as in the parameters' names: 'rank 1 (pipeline stage 1 of 2, layers 2-3)';
    with several pipelines, its replica too: 'rank 3 (pipeline stage 1 of 2, layer 1, replica 1 of 2)'
    (the stages of replica r are ranks r x stages ... (r + 1) x stages - 1: ember.parallel.mesh)."""
    if stages < 2 or layers < stages:
        return f"rank {rank}"
    replica, stage = divmod(rank, stages)
    held = layer_range(layers, stages, stage)
    what = f"layer {held.start}" if len(held) == 1 else f"layers {held.start}-{held.stop - 1}"
    where = f", replica {replica} of {replicas}" if replicas > 1 else ""
    return f"rank {rank} (pipeline stage {stage} of {stages}, {what}{where})"
