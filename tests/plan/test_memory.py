"""The memory estimate: two breakdowns computed by hand, and the estimate against the measured
peak of real steps (ember/doctor/measure.py) on small models."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ember.doctor.measure import live_tensor_bytes, measured_step, step_peak
from ember.errors import EmberError
from ember.launch import check_memory
from ember.plan.memory import LINEARS, ModelShape, TrainShape, estimate
from ember.plan.planner import UnknownArchitecture, has_formulas, plan_memory
from ember.recipe import MethodConfig, load_recipe
from ember.train.loss import causal_lm_loss
from ember.train.model import apply_lora, tiny_config
from ember.train.quantize import quantize_base
from tests.helpers import write_recipe


def test_full_fp32_by_hand():
    """builtin:tiny (hidden 64, MLP 176, 2 layers, 4 heads / 2 KV heads of 16, vocab 257), b=4, s=128."""
    m = ModelShape.from_config(tiny_config())
    b = estimate(m, TrainShape(micro_batch=4, seq_len=128))
    layer = 46080 + 2 * 64  # q 64x64, k 64x32, v 64x32, o 64x64, gate/up/down 64x176; two norms
    params = 2 * layer + 64 + 2 * 257 * 64  # final norm, embedding and untied output layer
    assert b.params == params == 125_376
    assert b.weights == params * 4 and b.optimizer == 2 * params * 4
    # Saved per token and layer (fp32 bytes): two norms (input, rsqrt, normalised) 2 x 516; the
    # q/k/v input 256; the gate/up input 256; the down input 176*4; SDPA q 256, k 128, v 128,
    # output 256, log-sum-exp 16; gate, SiLU and up outputs 3 x 704.
    per_layer = 2 * 516 + 256 + 256 + 704 + 256 + 128 + 128 + 256 + 16 + 3 * 704
    fixed = 516 + 256 + 8 + 8  # final norm, output-layer input, token ids, targets
    rope = 2 * 128 * 16 * 4
    tokens = 4 * 128
    assert b.activations == (2 * per_layer + fixed) * tokens + rope
    assert b.loss_buffers == 3 * tokens * 257 * 4  # log-softmax kept, two gradients at its backward
    assert b.phase == "loss backward" and b.gradients == 0  # gradients do not exist yet
    assert b.peak == b.weights + b.optimizer + b.activations + b.loss_buffers == 8_770_816


def test_lora_on_q_and_v_by_hand():
    m = ModelShape.from_config(tiny_config())
    t = TrainShape(micro_batch=2, seq_len=64, lora=True, lora_rank=8, lora_targets=frozenset({"q_proj", "v_proj"}))
    b = estimate(m, t)
    adapters = 2 * (8 * (64 + 64) + 8 * (64 + 32))  # A and B for q (64->64) and v (64->32), 2 layers
    assert b.trainable == adapters == 3584
    assert b.weights == (125_376 + adapters) * 4 and b.optimizer == adapters * 8
    # Frozen norms keep no normalised copy; frozen MLP linears keep no input; each adapter keeps
    # its rank-8 intermediate. The first layer's input needs no gradient: its norm keeps nothing.
    layer = 2 * 260 + 256 + 2 * 8 * 4 + (256 + 128 + 128 + 256 + 16) + 3 * 704
    first = layer - 260
    fixed = 260 + 8  # final norm (input, rsqrt), targets
    tokens = 2 * 64
    assert b.activations == (first + layer + fixed) * tokens + 2 * 64 * 16 * 4
    assert b.peak == b.weights + b.optimizer + b.activations + 3 * tokens * 257 * 4 == 1_904_896


def test_checkpointing_by_hand():
    """builtin:tiny with activation checkpointing, b=8, s=64 (examples/tiny.toml): the peak is
    while the first decoder layer, remade, differentiates its MLP product act(gate) * up."""
    m = ModelShape.from_config(tiny_config())
    b = estimate(m, TrainShape(micro_batch=8, seq_len=64, activation_checkpointing=True))
    tokens = 8 * 64
    assert b.phase == "layer backward"
    # Gradients made so far: the output layer (257 x 64), the final norm, the whole last layer
    # and the first layer's down_proj (176 x 64); not the embedding's, not the rest of layer 0's.
    assert b.gradients == (257 * 64 + 64 + 46_208 + 176 * 64) * 4
    # The first layer's activations, remade (as test_full_fp32_by_hand counts them), without
    # down_proj's input (its backward has run); the token ids; RoPE's cos and sin.
    per_layer = 2 * 516 + 256 + 256 + 704 + 256 + 128 + 128 + 256 + 16 + 3 * 704
    assert b.activations == (per_layer - 704 + 8) * tokens + 2 * 64 * 16 * 4
    # The product's incoming gradient and its two outputs (3 x 176 fp32 per token), and the
    # residual stream's gradient (64 fp32 per token): the term the estimate lacked.
    assert b.temporaries == (3 * 176 * 4 + 64 * 4) * tokens
    assert b.peak == b.weights + b.optimizer + b.gradients + b.activations + b.temporaries == 5_298_432


CASES = [  # hidden, mlp, layers, heads, kv, vocab, b, s, method, checkpointing, precision, loss chunk
    (64, 176, 2, 4, 2, 257, 4, 64, "full", False, "fp32", 0),
    (128, 352, 2, 4, 2, 2000, 2, 128, "lora", False, "fp32", 0),
    (128, 352, 2, 4, 4, 2000, 2, 128, "full", True, "fp32", 0),
    (128, 352, 2, 4, 2, 2000, 2, 128, "lora", False, "bf16", 0),
    (128, 352, 2, 4, 2, 4000, 2, 128, "full", False, "fp32", 64),
    (96, 256, 3, 6, 2, 300, 1, 16, "full", False, "fp32", 0),  # tiny batch: the update is the peak
    # examples/tiny.toml with train.activation_checkpointing: the peak is inside the first
    # layer's backward (was planned 7.6% under); with LoRA, inside the last layer's (15.7% under).
    (64, 176, 2, 4, 2, 257, 8, 64, "full", True, "fp32", 0),
    (64, 176, 2, 4, 2, 257, 8, 64, "lora", True, "fp32", 0),
    # QLoRA ([method] quantize = 'nf4'): 4-bit linears; under autocast their outputs stay fp32
    (128, 352, 2, 4, 2, 2000, 2, 128, "qlora", False, "fp32", 0),
    (128, 352, 2, 4, 2, 2000, 2, 64, "qlora", False, "bf16", 0),
    (256, 704, 2, 4, 2, 1000, 1, 32, "qlora", True, "fp32", 0),  # the dequantized weight is the peak's edge
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[8]}-{c[10]}-ac{int(c[9])}-chunk{c[11]}" for c in CASES])
def test_estimate_matches_measured_peak(case):
    est, measured = estimated_and_measured(case)
    assert -0.05 <= est / measured - 1 <= 0.10, (est, measured)


# QLoRA shapes whose peak is a 4-bit linear's dequantized weight (wide linears, few tokens).
DEQUANTIZE_PEAKS = [
    (512, 1408, 2, 8, 4, 500, 1, 16, "qlora", False, "bf16", 0),  # the last down_proj in forward: was +2.06%
    (384, 1024, 3, 6, 2, 300, 1, 8, "qlora", False, "fp32", 0),
    (512, 1408, 2, 8, 4, 500, 1, 16, "qlora", True, "fp32", 0),
    (256, 704, 2, 4, 2, 1000, 1, 32, "qlora", True, "bf16", 0),  # down_proj's backward: was -3.1%
    (256, 704, 2, 4, 2, 1000, 1, 32, "qlora", False, "fp32", 0),
]


@pytest.mark.parametrize("case", DEQUANTIZE_PEAKS, ids=[f"h{c[0]}-{c[10]}-ac{int(c[9])}" for c in DEQUANTIZE_PEAKS])
def test_qlora_dequantize_peak_within_two_percent(case):
    """Issue 30's goal for QLoRA: within 2% where the dequantized weight is at the peak (in
    forward: the output layer's half-precision copy and the final norm do not exist yet; the
    embeddings' output, the MLP's input and product are alive, and the absmaxes in fp32; in
    down_proj's backward: two fp32 gradients for its input, the base's and the adapter's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # oneDNN's bf16 matmul takes scratch space that grows with threads (unplanned)
    try:
        est, measured = estimated_and_measured(case)
    finally:
        torch.set_num_threads(threads)
    assert abs(est / measured - 1) <= 0.02, (est, measured, f"{est / measured - 1:+.2%}")


# Accumulating (grad_accum > 1): from the second micro-batch on, every gradient of the step so far
# is alive through the forward and the backward. The estimate left that out: 5.4% under for full
# fine-tuning (the peak in the loss's backward), 6.2% with activation checkpointing, 1.0% LoRA.
ACCUMULATING = [
    (64, 176, 2, 4, 2, 257, 4, 64, "full", False, "fp32", 0),
    (64, 176, 2, 4, 2, 257, 8, 64, "full", True, "fp32", 0),
    (128, 352, 2, 4, 2, 2000, 2, 128, "lora", False, "fp32", 0),
    (128, 352, 2, 4, 2, 2000, 2, 128, "qlora", False, "fp32", 0),
]


@pytest.mark.parametrize("case", ACCUMULATING, ids=[f"{c[8]}-ac{int(c[9])}" for c in ACCUMULATING])
def test_an_accumulating_step_is_planned_with_the_gradients_it_carries(case):
    alone, _ = estimated_and_measured(case)
    est, measured = estimated_and_measured(case, grad_accum=2)
    assert est > alone
    assert abs(est / measured - 1) <= 0.0025, (est, measured, f"{est / measured - 1:+.3%}")


def estimated_and_measured(case: tuple, grad_accum: int = 1) -> tuple[int, int]:
    """The estimate's peak and the peak measured on a real step, for a CASES row."""
    h, f, layers, heads, kv, vocab, b, s, method, ac, precision, chunk = case
    cpu = torch.device("cpu")
    # step_peak counts every tensor alive in the process, as `ember plan` does in a process of its
    # own; in a test worker, tensors that earlier tests left alive (module globals, caches) are not
    # this step's: what a fresh process would measure is the peak less those.
    gc.collect()
    foreign = live_tensor_bytes(cpu)
    config = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if ac:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if method == "qlora":
        quantize_base(model)
    if method != "full":
        model = apply_lora(model, MethodConfig(kind="lora"))
    model.train()
    ids = torch.randint(0, vocab, (b, s))
    step = measured_step(model, ids, cpu, precision, chunk, grad_accum=grad_accum)
    step()
    measured = step_peak(step, cpu) - foreign
    shape = TrainShape(b, s, lora=method != "full", lora_targets=frozenset(LINEARS),
                       activation_checkpointing=ac, autocast=precision != "fp32", loss_chunk=chunk,
                       quantize="nf4" if method == "qlora" else "none", accumulating=grad_accum > 1)
    return estimate(ModelShape.from_config(config), shape).peak, measured


def test_chunked_loss_equals_the_plain_loss():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    ids = torch.randint(0, 257, (3, 40))
    plain = causal_lm_loss(model, ids)
    chunked = causal_lm_loss(model, ids, loss_chunk=17)
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    (g1,) = torch.autograd.grad(plain, model.lm_head.weight)
    (g2,) = torch.autograd.grad(causal_lm_loss(model, ids, loss_chunk=17), model.lm_head.weight)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_unknown_architecture_is_named():
    class Config:
        model_type = "gpt_neox"
    with pytest.raises(ValueError, match="gpt_neox"):
        ModelShape.from_config(Config())


@pytest.mark.parametrize("fields, said", [
    ({"hidden_size": None}, "has no hidden_size: a llama model's"),
    ({"intermediate_size": [64, 64]}, "has intermediate_size = [64, 64]: a llama model's"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_attention_heads = 4, not a multiple of "
                                                           "num_key_value_heads = 3"),
    ({"hidden_size": 30}, "head_dim = 15 (hidden_size 30 / num_attention_heads 2)"),
    ({"num_attention_heads": 64, "num_key_value_heads": 64}, "head_dim = 0 (hidden_size 32 / num_attention_heads 64)"),
])
def test_a_llama_config_json_without_a_size_is_refused_naming_it(tmp_path, fields, said):
    """A Llama config.json without hidden_size ended `ember plan`, and `ember run`'s check before
    launch, in AttributeError: 'ConfigFields' object has no attribute 'hidden_size'; a per-layer
    list where the Llama family has one number, in a TypeError. Heads that key-value heads do not
    divide, or an odd (or zero) head size, planned as "fits": the run then failed in its first
    step (repeat_kv: "The size of tensor a (4) must match the size of tensor b (3)"), or at
    transformers' config validation (RoPE needs an even head_dim)."""
    folder = tmp_path / "model"
    folder.mkdir()
    shape = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 128, **fields}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in shape.items() if v is not None}))
    r = load_recipe(write_recipe(tmp_path, model={"path": str(folder)}))
    with pytest.raises(EmberError, match=f"its config.json .*{re.escape(said)}"):
        plan_memory(r)
    with pytest.raises(EmberError, match=re.escape(said)):
        check_memory(r)  # `ember run`, before anything is built


@pytest.mark.parametrize("targets", [["input_layernorm"], ["mlp"], ["lm_head"], ["q_proj", "embed_tokens"]])
def test_lora_on_modules_the_formulas_do_not_know_is_not_estimated_by_them(tmp_path, targets):
    """LoRA with [method] target_modules naming no decoder linear ended `ember plan`, and `ember
    run`'s check before launch, in ValueError: max() arg is an empty sequence; with one, the
    estimate left the other's adapters out. Such a recipe is traced (ember plan) or measured as the
    run goes (`ember run`), as a family without formulas is."""
    r = load_recipe(write_recipe(tmp_path, method={"kind": "lora", "target_modules": targets}))
    with pytest.raises(UnknownArchitecture, match=re.escape(f"[method] target_modules = {targets!r}")):
        plan_memory(r)
    assert not has_formulas(r)  # `ember plan` traces its step
    assert check_memory(r) is None  # `ember run` goes on: peft builds it, or refuses it by name
