"""The ops activation checkpointing's recomputation adds to a micro-batch, for its fixed per-op
cost in the plan's time (ember.plan.planner.recompute_seconds): on small shapes each op's fixed
cost (dispatch, autograd, checkpoint's hooks) outweighs its FLOPs. Counted as transformers'
Llama decoder layer runs them under ember's LoRA and bitsandbytes' 4-bit linears; checked against
a real step's ops in tests/plan/test_recompute.py."""

from __future__ import annotations

from ember.plan.memory import ModelShape, TrainShape

# Ops one decoder layer's recomputation adds (counted with a dispatch mode: a checkpointed step's
# ops less the plain step's; transformers 5, torch 2.13): the layer's forward, and checkpoint's
# detaches of what it saves. Trained weights save (and detach) more than a frozen base.
LAYER_FULL = 127         # every weight trained
LAYER_FROZEN = 85        # LoRA: the base frozen, before its adapters
PER_ADAPTER = 17         # each adapted linear: its A and B matmuls, the scaling, the add, their views
PER_DROPOUT = 4          # ... and its dropout where [method] dropout > 0
PER_4BIT = -1.5          # each 4-bit linear: one fused call where a plain linear takes a few (on average)


def recomputed_ops(m: ModelShape, t: TrainShape) -> float:
    """Ops a micro-batch's recomputation adds under activation checkpointing (0 without it): each
    decoder layer's forward run again in backward."""
    if not t.activation_checkpointing:
        return 0.0
    if not t.lora:
        return float(m.layers * LAYER_FULL)
    adapters = len(t.lora_targets)
    layer = LAYER_FROZEN + adapters * (PER_ADAPTER + (PER_DROPOUT if t.lora_dropout > 0 else 0))
    if t.quantize == "nf4":
        layer += len(m.linear_shapes()) * PER_4BIT
    return m.layers * layer
