"""FLOPs per token and MFU against hand-computed values; peaks from the table, never guessed."""

from __future__ import annotations

import pytest
import torch

from ember.metrics.flops import Architecture, architecture_of, flops_per_token, mfu, share_of_peak
from ember.metrics.peaks import lookup_peak
from ember.recipe import MethodConfig
from ember.train.model import apply_lora, tiny_config


def test_full_fine_tuning_formula_by_hand():
    a = Architecture(matmul_params=1_000_000, trainable_params=1_000_000, layers=2, heads=4,
                     head_dim=16, seq_len=32, lora=False)
    f = flops_per_token(a)
    assert f.total == 6 * 1_000_000 + 12 * 2 * 4 * 16 * 32 == 6_049_152
    assert f.formula == "6*N + 12*L*H*Q*T"
    # 1000 tokens/s on a 1 TFLOP/s device: 6.049152e9 / 1e12
    assert mfu(1000.0, f.total, 1e12) == pytest.approx(0.006049152)
    # 2,000 tokens/s at 6e9 FLOPs/token on a 24 TFLOP/s device: 1.2e13 / 2.4e13 = 50%.
    assert mfu(2000.0, 6e9, 24e12) == pytest.approx(0.5)
    assert mfu(1000.0, f.total, None) is None  # an unknown peak is never divided by


def test_a_share_above_the_peak_is_no_mfu():
    # 2,000 tokens/s at 6e9 FLOPs/token on a "6 TFLOP/s" device: 1.2e13 / 6e12 = 200%: the peak is wrong.
    assert mfu(2000.0, 6e9, 6e12) is None
    assert share_of_peak(2000.0, 6e9, 6e12) == pytest.approx(2.0)  # what the report flags
    assert mfu(1000.0, 6e9, 6e12) == pytest.approx(1.0)  # the peak itself is possible


def test_lora_counts_no_weight_gradients_for_frozen_weights():
    a = Architecture(matmul_params=1_010_000, trainable_params=10_000, layers=2, heads=4,
                     head_dim=16, seq_len=32, lora=True)
    assert flops_per_token(a).total == 4 * 1_000_000 + 6 * 10_000 + 49_152


def test_architecture_of_the_builtin_tiny_model():
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    a = architecture_of(model, seq_len=64)
    # Per layer: q 64x64, k,v 64x32, o 64x64, mlp 3 x 64x176, 2 norms of 64; plus final norm and
    # the untied head 64x257. The input embedding (257x64) is a lookup and is not counted.
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 176 + 2 * 64
    assert a.matmul_params == 2 * per_layer + 64 + 257 * 64
    assert (a.layers, a.heads, a.head_dim, a.seq_len, a.lora) == (2, 4, 16, 64, False)
    lora = apply_lora(model, MethodConfig(kind="lora", rank=2, target_modules=["q_proj"]))
    b = architecture_of(lora, seq_len=64)
    assert b.lora and b.trainable_params == 2 * (2 * 64 + 2 * 64)  # A: 2x64, B: 64x2 per layer
    assert b.matmul_params == a.matmul_params + b.trainable_params


def test_peak_table_and_unknown_devices():
    assert lookup_peak("NVIDIA H100 80GB HBM3", "bf16").flops == 989e12
    assert lookup_peak("NVIDIA H200", "bf16").flops == 989e12
    assert lookup_peak("NVIDIA A100-SXM4-80GB", "fp32").flops == 19.5e12
    assert lookup_peak("AMD Instinct MI300X", "fp16").flops == 1307e12
    unknown = lookup_peak("Imaginary GPU 9000", "bf16")
    assert unknown.flops is None and "unknown device" in unknown.source
