"""What QLoRA's 4-bit linears cost a step beyond plain ones, for its time (ember.plan.planner.
dequant_seconds): how many calls bitsandbytes makes (quantized_calls) and the bytes each one
moves (dequantize_once). Checked against a real step's ops in tests/plan/test_dequant.py."""

from __future__ import annotations

from ember.plan.memory import F32, NF4_BLOCK, NF4_NESTED_BLOCK, ModelShape, TrainShape

# What feeds each linear's input within a decoder layer: in the first layer, whose input (the
# embeddings through a frozen norm) carries no gradient, a linear's input needs one only where
# one of these is adapted.
UPSTREAM = {"q_proj": (), "k_proj": (), "v_proj": (), "o_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_proj": ("q_proj", "k_proj", "v_proj", "o_proj"), "up_proj": ("q_proj", "k_proj", "v_proj", "o_proj"),
            "down_proj": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")}


def quantized_calls(m: ModelShape, t: TrainShape) -> list[tuple[int, int]]:
    """(weights, calls per micro-batch) of every 4-bit linear (none without [method] quantize =
    'nf4'), as bitsandbytes runs them: once in forward (its fused 4-bit matmul), once more in the
    forward recomputed under activation checkpointing, and once in backward (a dequantization for
    its input's gradient) where that input needs a gradient: all but some of the first layer's."""
    if t.quantize != "nf4":
        return []
    forward = 2 if t.activation_checkpointing else 1
    out = []
    for i in range(m.layers):
        for name, (a, b) in m.linear_shapes().items():
            backward = i > 0 or bool(t.lora_targets & set(UPSTREAM[name]))
            out.append((a * b, forward + backward))
    return out


def dequant_bytes(m: ModelShape, t: TrainShape) -> int:
    """Bytes a micro-batch's 4-bit linears move, each call (quantized_calls) priced as one
    dequantization of its weight (0 without [method] quantize = 'nf4')."""
    return sum(calls * dequantize_once(n) for n, calls in quantized_calls(m, t))


def dequantize_once(n: int) -> int:
    """Bytes read and written dequantizing one n-element NF4 weight, as bitsandbytes' ops do it
    (double quantization; its compute dtype fp32, under autocast too): the 8-bit absmaxes, their
    fp32 scales and 256-entry fp32 code map read, fp32 absmaxes written; the fp32 offset added
    (read, written); the codes and fp32 absmaxes read, the fp32 weight written."""
    blocks = -(-n // NF4_BLOCK)
    absmax = blocks + F32 * (-(-blocks // NF4_NESTED_BLOCK) + 256) + F32 * blocks
    offset = F32 * (2 * blocks + 1)
    return absmax + offset + -(-n // 2) + F32 * blocks + F32 * n
