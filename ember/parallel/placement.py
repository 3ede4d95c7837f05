"""Where a rank sits in a pipeline, torch-free: the decoder layers each stage holds, and how
messages (the launcher's, the watchdog's) name a rank by its stage. The stages themselves:
ember/parallel/stages.py; the strategy: ember/parallel/pp.py."""

from __future__ import annotations


def layer_range(layers: int, stages: int, stage: int) -> range:
    """The decoder layers of `stage`: consecutive, the first stages one more when they do not split evenly."""
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def rank_name(rank: int, stages: int = 1, layers: int = 0) -> str:
    """How a message names a rank: 'rank 1'; a pipeline stage with its place and the decoder layers
    it holds, numbered as in the parameters' names: 'rank 1 (pipeline stage 1 of 2, layers 2-3)'."""
    if stages < 2 or layers < stages:
        return f"rank {rank}"
    held = layer_range(layers, stages, rank)
    what = f"layer {held.start}" if len(held) == 1 else f"layers {held.start}-{held.stop - 1}"
    return f"rank {rank} (pipeline stage {rank} of {stages}, {what})"
