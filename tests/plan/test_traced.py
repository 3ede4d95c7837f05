"""The plan of a model family ember has no formula for: its step traced on fake tensors
(ember.doctor.traced) against the same step measured for real (ember.doctor.measure), family by
family (issue 30, item 3), and `ember plan` on such a model, torch-free once traced."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers as tf

from ember.doctor.fake_step import trace
from ember.doctor.measure import live_tensor_bytes
from ember.plan.memory import LLAMA_FAMILY
from ember.recipe import load_recipe
from ember.data.tokenizer import ByteTokenizer
from tests.helpers import ROOT, measured_peak, write_recipe
from tests.test_startup import HEAVY, imports_of

H = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512}
FAMILIES = {  # ten families outside the Llama formulas, as transformers builds them
    "gemma2": lambda: tf.Gemma2Config(**H, head_dim=32),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**H, head_dim=32),
    "phi3": lambda: tf.Phi3Config(**H, pad_token_id=0),
    "gpt_neox": lambda: tf.GPTNeoXConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=1000, max_position_embeddings=512),
    "gpt2": lambda: tf.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=512,
                                  bos_token_id=0, eos_token_id=0),
    "opt": lambda: tf.OPTConfig(hidden_size=128, ffn_dim=352, num_hidden_layers=2, num_attention_heads=4,
                                vocab_size=1000, max_position_embeddings=512, word_embed_proj_dim=128),
    "falcon": lambda: tf.FalconConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
                                      new_decoder_architecture=True, num_kv_heads=2),
    "olmo": lambda: tf.OlmoConfig(**H),
    "stablelm": lambda: tf.StableLmConfig(**H),
    "gptj": lambda: tf.GPTJConfig(n_embd=128, n_layer=2, n_head=4, rotary_dim=16, vocab_size=1000, n_positions=512,
                                  bos_token_id=0, eos_token_id=0),
}
VARIANTS = {  # on one family: each setting that changes the step's memory
    "lora": ["method.kind=lora", "method.target_modules=['all-linear']"],
    "activation checkpointing": ["train.activation_checkpointing=true"],
    "bf16": ["precision.mode=bf16"],
    "chunked loss": ["train.loss_chunk=128"],
    "int8 optimizer state": ["optimizer.state_dtype=int8"],
    "lora, checkpointing, bf16, accumulation": ["method.kind=lora", "method.target_modules=['all-linear']",
                                                "train.activation_checkpointing=true", "precision.mode=bf16",
                                                "train.grad_accum=3"],
}
QLORA = {  # LoRA over a 4-bit NF4 base (bitsandbytes), on a family without formulas
    "qlora": ["method.kind=lora", "method.quantize=nf4", "method.target_modules=['all-linear']"],
    "qlora, checkpointing, bf16, accumulation": ["method.kind=lora", "method.quantize=nf4",
                                                 "method.target_modules=['all-linear']",
                                                 "train.activation_checkpointing=true", "precision.mode=bf16",
                                                 "train.grad_accum=3"],
}
# The issue's goal is 2%. The families' traces match to 0.02%; each is held to 0.5%, below the
# smallest share of the explicit causal mask a fake-tensor trace used to count (GPT-J's +1.84%;
# GPT-NeoX, OLMo, StableLM, Gemma 3 and Phi-3 also took that path: ember.doctor.fake_step).
UNDER, FAMILY = 0.02, 0.005


def model_folder(root, family: str):
    """A model of the family, with weights (the measurement loads them), written once."""
    folder = root / family
    if not folder.is_dir():
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(FAMILIES[family]()).save_pretrained(folder)
        ByteTokenizer().save(folder)  # the measurement loads a tokenizer beside the weights
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def traced_and_measured(recipe_path, *overrides: str) -> tuple[int, int]:
    """The traced peak, and the measured one (less the tensors other tests left: measured_peak)."""
    r = load_recipe(recipe_path, list(overrides))
    return trace(r).peak_bytes, measured_peak(r)


def test_the_families_are_outside_the_formulas():
    assert not set(FAMILIES) & LLAMA_FAMILY


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_traced_step_is_within_half_a_percent_of_the_measured_one(tmp_path, models, family):
    recipe = write_recipe(tmp_path, model={"path": str(model_folder(models, family))},
                          data={"seq_len": 128}, train={"micro_batch": 4})
    traced, measured = traced_and_measured(recipe)
    assert -FAMILY <= traced / measured - 1 <= FAMILY, f"{family}: traced {traced:,} B, measured {measured:,} B"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_setting_that_shapes_the_step_is_traced(tmp_path, models, variant):
    recipe = write_recipe(tmp_path, model={"path": str(model_folder(models, "gpt2"))},
                          data={"seq_len": 128}, train={"micro_batch": 4})
    plain, _ = traced_and_measured(recipe) if variant == "lora" else (None, None)
    traced, measured = traced_and_measured(recipe, *VARIANTS[variant])
    assert -UNDER <= traced / measured - 1 <= UNDER, f"{variant}: traced {traced:,} B, measured {measured:,} B"
    if plain is not None:
        assert traced < plain  # LoRA's frozen base has no gradients nor optimizer state


def test_the_measured_peak_is_the_accumulating_steps(tmp_path, models):
    """Accumulating, the gradients of the micro-batches before are alive through each later one's
    backward: full fine-tuning with grad_accum 3 peaks 10% above one micro-batch's step. The
    measurement (`ember plan --calibrate`, preflight) took one micro-batch's step whatever the
    recipe said, 10% under the trace and under the run; it now takes the recipe's accumulation."""
    recipe = write_recipe(tmp_path, model={"path": str(model_folder(models, "gpt_neox"))},
                          data={"seq_len": 128}, train={"micro_batch": 4})
    alone, _ = traced_and_measured(recipe)
    traced, measured = traced_and_measured(recipe, "train.grad_accum=3")
    assert traced > 1.05 * alone  # the accumulation is a real part of the peak
    assert -FAMILY <= traced / measured - 1 <= FAMILY, f"traced {traced:,} B, measured {measured:,} B"


@pytest.mark.parametrize("family, variant", [("gpt_neox", "qlora"), ("phi3", "qlora"),
                                             ("opt", "qlora, checkpointing, bf16, accumulation")])
def test_a_qlora_step_is_traced_with_its_4_bit_base(tmp_path, models, family, variant):
    """The 4-bit base on fake tensors: codes and quantization state of bitsandbytes' sizes, its
    forward through bitsandbytes' own fake kernel, its backward's dequantization counted (before:
    "Cannot copy out of meta tensor", quantizing read the weights)."""
    recipe = write_recipe(tmp_path, model={"path": str(model_folder(models, family))},
                          data={"seq_len": 128}, train={"micro_batch": 4})
    traced, measured = traced_and_measured(recipe, *QLORA[variant])
    assert -FAMILY <= traced / measured - 1 <= FAMILY, f"{family}, {variant}: traced {traced:,} B, measured {measured:,} B"


def test_a_qlora_adapter_on_a_fused_projection_under_bf16_is_traced_within_half_a_percent(tmp_path, models):
    """Phi-3's fused gate_up_proj with an adapter over its 4-bit base, recomputed under bf16: the
    4-bit layer's fp32 output plus the adapter's bf16 one peaks with the bf16 side copied to fp32
    inside the add, which no op returns (the trace was 5.1% under, 463 KB)."""
    recipe = write_recipe(tmp_path, model={"path": str(model_folder(models, "phi3"))},
                          data={"seq_len": 128}, train={"micro_batch": 4})
    traced, measured = traced_and_measured(recipe, "method.kind=lora", "method.quantize=nf4",
                                           "method.target_modules=['gate_up_proj']",
                                           "train.activation_checkpointing=true", "precision.mode=bf16")
    assert -FAMILY <= traced / measured - 1 <= FAMILY, f"traced {traced:,} B, measured {measured:,} B"


def test_a_peak_inside_an_op_is_derived_for_another_micro_batch_too(models, tmp_path):
    """plan --fit derives a micro batch's peak from the traces at 1 and 2 (peak_between): a high
    point inside an op (the copy above) is a point of the timeline it scales, not a constant."""
    from ember.plan.fit import peak_between
    path = write_recipe(tmp_path, model={"path": str(model_folder(models, "phi3"))}, data={"seq_len": 128})
    extra = ["method.kind=lora", "method.quantize=nf4", "method.target_modules=['gate_up_proj']",
             "train.activation_checkpointing=true", "precision.mode=bf16"]
    at = {mb: trace(load_recipe(path, [*extra, f"train.micro_batch={mb}"])) for mb in (1, 2, 4)}
    assert peak_between(at[1], at[2], 4) == at[4].peak_bytes


def test_a_pointwise_op_of_two_dtypes_peaks_with_its_input_copied_to_the_results():
    """On the CPU, fp32 + bf16 first copies the bf16 operand to fp32 (TensorIterator's promotion
    of an input by a temporary), alive beside the output: the trace adds it at that op; the same
    op measured for real peaks where the trace says."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ember.doctor.fake_step import LiveBytes
    from ember.doctor.measure import step_peak
    a, b = torch.randn(512, 1024), torch.randn(512, 1024).to(torch.bfloat16)
    (a + b).sum()  # warm-up
    gc.collect()
    before = live_tensor_bytes(torch.device("cpu"))
    measured = step_peak(lambda: a + b, torch.device("cpu")) - before
    with FakeTensorMode():
        fa, fb = torch.empty(512, 1024), torch.empty(512, 1024, dtype=torch.bfloat16)
        live = LiveBytes([fa, fb])
        start = live.now
        with live:
            fa + fb  # its output and the copy of fb, alive together at the op
    traced = live.peak - start
    output = 512 * 1024 * 4
    assert measured >= 2 * output  # the output and the copy of the bf16 operand
    assert traced == pytest.approx(measured, rel=0.02), (traced, measured)


@pytest.mark.parametrize("settings", [[], ["train.activation_checkpointing=true", "train.grad_accum=2"]])
def test_the_trace_counts_the_4_bit_calls_the_formulas_count(tmp_path, settings):
    """On the Llama family, which has both: the traced step's 4-bit calls and the bytes they move
    per micro-batch are the formulas' (forward, recomputed forward, backward but the first layer's
    projections whose input needs no gradient), so QLoRA is priced alike with or without formulas."""
    from ember.models import model_config
    from ember.plan.memory import ModelShape
    from ember.plan.planner import dequant_counts
    from ember.plan.remedies import train_shape
    r = load_recipe(write_recipe(tmp_path), ["method.kind=lora", "method.quantize=nf4", *settings])
    t = trace(r)
    assert t.dequant_calls > 0
    assert (t.dequant_calls, t.dequant_bytes) == dequant_counts(ModelShape.from_config(model_config(r.model.path)),
                                                                train_shape(r))


def test_a_4_bit_forward_peaks_with_its_weight_dequantized(tmp_path):
    """bitsandbytes' CPU forward of a 4-bit linear dequantizes its block scales and its whole
    weight before the matmul, inside one op whose fake kernel allocates none of it: the trace
    adds them at that op. The same forward measured for real peaks where the trace says."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ember.doctor.fake_step import LiveBytes, _fake_parameters, _meta_4bit, _quantization_state
    from ember.doctor.measure import step_peak
    from ember.train.quantize import quantize_base
    torch.manual_seed(0)
    real = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(8, 8))
    real.get_output_embeddings = lambda: real[1]
    quantize_base(real)
    x = torch.randn(2, 512)
    with torch.no_grad():
        real[0](x)  # warm-up: the measurement is of a forward after the first
        gc.collect()
        before = live_tensor_bytes(torch.device("cpu"))
        measured = step_peak(lambda: real[0](x), torch.device("cpu")) - before
    with torch.device("meta"):
        plain = torch.nn.Linear(512, 1024)
    layer = _meta_4bit(plain)
    with FakeTensorMode(), torch.no_grad():
        _fake_parameters(layer)
        y = torch.empty(2, 512)
        live = LiveBytes([*layer.parameters(), *_quantization_state(layer), y])
        start = live.now
        with live:
            layer(y)
    traced = live.peak - start
    weight = 512 * 1024 * 4
    assert traced > weight and measured > weight  # the dequantized weight is in both
    assert traced == pytest.approx(measured, rel=0.02), (traced, measured)


def test_plan_of_a_family_without_formulas_is_traced_then_torch_free(tmp_path, models):
    """`ember plan` of a GPT-2 model: planned from its traced step (no calibration, no weights
    read), and the second plan of it reads the trace from $EMBER_HOME/cache/traced."""
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home")}
    recipe = write_recipe(tmp_path, model={"path": str(model_folder(models, "gpt2"))},
                          data={"seq_len": 128}, train={"micro_batch": 4}, cost={"peak_tflops": 1.0})
    first, _ = imports_of(tmp_path, env, "plan", str(recipe))
    assert first.returncode == 0, first.stderr
    assert "model: gpt2, its step traced on its module graph" in first.stdout and "fits: yes" in first.stdout
    again, seen = imports_of(tmp_path, env, "plan", str(recipe))
    assert again.returncode == 0, again.stderr
    same = lambda out: [x for x in out.splitlines() if x.startswith(("model:", "│ peak"))]
    assert same(again.stdout) == same(first.stdout) and len(same(first.stdout)) == 2, (first.stdout, again.stdout)
    assert not seen & set(HEAVY), f"the second plan imported {sorted(seen)}"


def test_a_change_to_the_traced_step_is_a_new_cache_key(tmp_path):
    """The cached traces are keyed by the code that ran the step (fake_step.py), not only by the
    module that caches them: a corrected trace is never answered from a stale cache."""
    recipe = write_recipe(tmp_path)
    changed = tmp_path / "tree"
    shutil.copytree(ROOT / "ember", changed / "ember", ignore=shutil.ignore_patterns("__pycache__"))
    with open(changed / "ember/doctor/fake_step.py", "a") as f:
        f.write("# a changed step\n")
    code = f"from ember.recipe import load_recipe; from ember.doctor.traced import _key; print(_key(load_recipe({str(recipe)!r}, [])))"
    keys = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(tree)}) for tree in (ROOT, changed)]
    assert all(k.returncode == 0 for k in keys), [k.stderr for k in keys]
    assert keys[0].stdout.strip() != keys[1].stdout.strip(), keys[0].stdout


def test_a_traced_plan_counts_a_4_bit_layers_weights_not_its_packed_codes():
    """`ember plan` of a family without formulas printed a QLoRA model's parameters as its
    storage: each 4-bit weight counted half (NF4 codes two to a byte)."""
    from ember.doctor.fake_step import _weight_count
    from ember.recipe import MethodConfig, ModelConfig
    from ember.train.model import load_model
    from ember.train.quantize import is_4bit
    lora = {"kind": "lora", "rank": 4, "alpha": 8.0}
    qlora = load_model(ModelConfig("builtin:tiny"), MethodConfig(**lora, quantize="nf4"), False).model
    plain = load_model(ModelConfig("builtin:tiny"), MethodConfig(**lora), False).model
    assert any(map(is_4bit, qlora.modules()))
    assert _weight_count(qlora) == sum(p.numel() for p in plain.parameters())
