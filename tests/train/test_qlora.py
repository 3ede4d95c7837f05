"""[method] quantize = 'nf4' (QLoRA): the 4-bit base as bitsandbytes stores it against `ember
plan`'s arithmetic, rebuilt bit-identically at every start, left out of checkpoints, untouched by
evaluation; the merge `ember export` uses; the refusals. That a QLoRA run resumes bit-exact is
tests/e2e/test_resume.py (its "qlora" configuration); the export of a run, tests/infer/test_export.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ember.ckpt.contents import trainable_state
from ember.ckpt.state import seed_all
from ember.errors import EmberError
from ember.plan.memory import LINEARS, ModelShape, TrainShape, base_bytes, estimate, nf4_bytes, qlora
from ember.models import tiny_config
from ember.recipe import MethodConfig, ModelConfig, load_recipe
from ember.train.loss import causal_lm_loss
from ember.train.model import apply_lora, load_model
from ember.train.quantize import dequantized_weight, is_4bit, merge_adapters, quantize_base, storage_bytes
from ember.train.sharding import check_distributed
from tests.helpers import write_recipe

QLORA = MethodConfig(kind="lora", rank=4, alpha=8.0, quantize="nf4")
# SmolLM2-135M's shape (the demo job's model), for arithmetic; SMALL is built for real.
SMOL = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, use_cache=False)
SMALL = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, use_cache=False)


def built(seed: int = 7) -> torch.nn.Module:
    seed_all(seed)  # as a run does before building builtin:tiny
    return load_model(ModelConfig("builtin:tiny"), QLORA, False).model


def quantized_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" not in k}


def test_the_plans_nf4_bytes_are_the_quantized_modules_storage():
    for i, o in [(64, 176), (100, 30), (576, 1536), (1536, 576), (64, 64)]:
        q = torch.nn.Sequential(torch.nn.Linear(i, o))
        q.get_output_embeddings = lambda: None
        quantize_base(q)
        assert is_4bit(q[0]) and storage_bytes(q[0]) == nf4_bytes(i * o), (i, o)
    # A whole model: its parameters as they are stored (4-bit linears, fp32 rest) are base_bytes.
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMALL)
    quantize_base(model)
    stored = sum(storage_bytes(m) for m in model.modules() if is_4bit(m))
    stored += sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dtype != torch.uint8)
    assert base_bytes(ModelShape.from_config(SMALL), qlora(TrainShape(1, 16))) == stored
    # The goal: the resident base at most 0.35x its fp32 bytes (SmolLM2-135M, embeddings in fp32).
    full = ModelShape.from_config(SMOL)
    ratio = base_bytes(full, qlora(TrainShape(1, 16))) / base_bytes(full, TrainShape(1, 16, lora=True))
    assert ratio <= 0.35, ratio
    planned = estimate(full, qlora(TrainShape(1, 16)))
    assert planned.weights == base_bytes(full, qlora(TrainShape(1, 16))) + planned.trainable * 4


def test_the_base_is_quantized_again_bit_identically_and_checkpoints_hold_only_adapters():
    a, b = built(), built()
    qa, qb = quantized_tensors(a), quantized_tensors(b)
    assert qa.keys() == qb.keys() and all(torch.equal(qa[k], qb[k]) for k in qa)
    assert sum(is_4bit(m) for m in a.modules()) == 2 * len(LINEARS)
    assert any(v.dtype == torch.uint8 for v in qa.values())
    saved = trainable_state(a)
    assert saved and all("lora_A" in k or "lora_B" in k for k in saved)  # the base is never checkpointed
    # Quantizing draws nothing from torch's RNG: the adapters start as plain LoRA's do.
    seed_all(7)
    plain = load_model(ModelConfig("builtin:tiny"), MethodConfig(kind="lora", rank=4, alpha=8.0), False).model
    plain_state = trainable_state(plain)
    assert all(torch.equal(saved[k], plain_state[k]) for k in saved)


def test_two_steps_are_bit_identical_and_train_the_adapters():
    def step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
        loss = causal_lm_loss(model, ids)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    (la, ga), (lb, gb) = step(built()), step(built())
    assert la == lb and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert all(g.abs().sum() > 0 for k, g in ga.items() if "lora_B" in k)  # gradients reach every adapter (A: B is 0)


def test_an_evaluation_forward_leaves_the_4bit_weights_and_training_as_they_were():
    """On CPUs with AVX512-BF16, bitsandbytes repacks a Linear4bit's weight in place at its first
    eval-mode forward without grad, and training forwards then use that layout (no gradient to
    their input). ember turns it off: evaluating between steps changes nothing."""
    model = built()
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    before = quantized_tensors(model)
    causal_lm_loss(model, ids).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.eval()(input_ids=ids[:1])
    model.train()
    after = quantized_tensors(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    causal_lm_loss(model, ids).backward()
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters() if p.requires_grad)


def test_the_merge_adds_each_adapter_to_its_dequantized_weight():
    import bitsandbytes.functional as bnbf
    torch.manual_seed(0)
    base = LlamaForCausalLM(SMALL)
    originals = {n: m.weight.detach().clone() for n, m in base.named_modules()
                 if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    quantize_base(base)
    model = apply_lora(base, QLORA)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # B starts at zero: make the update visible
    adapters = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A")}
    merged = merge_adapters(model)
    assert not any(is_4bit(m) for m in merged.modules())
    scale = QLORA.alpha / QLORA.rank
    for name, w in originals.items():
        codes, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        lora = adapters[f"base_model.model.{name}"]
        want = bnbf.dequantize_4bit(codes, state) + lora.lora_B["default"].weight @ lora.lora_A["default"].weight * scale
        got = merged.get_submodule(name).weight
        assert type(merged.get_submodule(name)) is torch.nn.Linear and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert (got - w).abs().max() > 1e-3  # not the fp32 original: the dequantized base


def test_quantizing_a_full_fine_tuning_is_refused(tmp_path):
    with pytest.raises(EmberError, match=r"quantize = 'nf4'.*set \[method\] kind = 'lora'"):
        load_recipe(write_recipe(tmp_path, method={"kind": "full", "quantize": "nf4"}))
    with pytest.raises(EmberError, match=r"\[method\] quantize = 'int4': must be one of 'none', 'nf4'"):
        load_recipe(write_recipe(tmp_path, method={"kind": "lora", "quantize": "int4"}))


def test_qlora_is_refused_for_several_ranks(tmp_path):
    r = load_recipe(write_recipe(tmp_path, method={"kind": "lora", "quantize": "nf4"}))
    with pytest.raises(EmberError, match="quantize = 'nf4' \\(QLoRA\\) trains in one process only"):
        check_distributed(r, 2, "here")


def test_a_model_with_nothing_to_quantize_is_refused_at_the_start_and_left_out_of_fit(tmp_path):
    """GPT-2's layers are Conv1D, which bitsandbytes does not store in 4 bits: before, its QLoRA
    run quantized nothing and trained as plain LoRA, saying it was QLoRA. Now `ember run` says so
    before its first step, and `plan --fit` searches it without QLoRA, saying why."""
    import transformers as tf

    from ember.data.tokenizer import ByteTokenizer
    from ember.doctor.traced import traced_step
    from ember.plan.fit import FitRequest, fit_recipe
    from tests.helpers import run_ember
    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=300, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    ByteTokenizer().save(folder)
    recipe = write_recipe(tmp_path, model={"path": str(folder)}, data={"seq_len": 32},
                          method={"kind": "lora", "quantize": "nf4", "target_modules": ["c_attn"]},
                          cost={"peak_tflops": 1.0})
    result = run_ember("run", recipe, "--out", tmp_path / "run")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "model_type 'gpt2' has no nn.Linear layer but its output head" in result.stderr, result.stderr
    assert "set quantize = 'none'" in result.stderr
    fit = fit_recipe(FitRequest(recipe, [], "1GB"), None, traced_step)
    assert {c.method for c in fit.best} <= {"full", "lora"} and fit.best
    assert any(n.startswith("QLoRA not searched: [method] quantize = 'nf4': model_type 'gpt2'") for n in fit.notes), fit.notes


def test_linear_subclasses_are_quantized_too():
    """Falcon's layers are FalconLinear, an nn.Linear subclass, which transformers' bitsandbytes
    integration quantizes: ember's took nn.Linear itself only, so a Falcon QLoRA run quantized
    nothing and trained as plain LoRA."""
    import transformers as tf
    torch.manual_seed(0)
    model = tf.FalconForCausalLM(tf.FalconConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                 vocab_size=300, new_decoder_architecture=True, num_kv_heads=2))
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    assert linears and all(type(model.get_submodule(n)).__name__ == "FalconLinear" for n in linears)
    assert quantize_base(model) == len(linears)
    assert all(is_4bit(model.get_submodule(n)) for n in linears) and not is_4bit(model.lm_head)


def test_without_bitsandbytes_the_error_says_what_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` meets when absent
    with pytest.raises(EmberError, match=r"quantize = 'nf4' needs the bitsandbytes package.*pip install"):
        built()


def test_the_plan_shows_the_4bit_base_and_offers_qlora(tmp_path):
    from ember.hardware import Device, Kind
    from ember.plan.planner import plan_memory
    shape = ModelShape.from_config(tiny_config())
    lora = TrainShape(4, 32, lora=True)
    planned = estimate(shape, TrainShape(4, 32, lora=True, quantize="nf4"))
    cap = int(estimate(shape, lora).peak * 1.05)  # plain LoRA does not fit with the 10% margin
    device = [Device(0, "capped", Kind.CPU, cap, cap)]
    q = plan_memory(load_recipe(write_recipe(tmp_path / "a", method={"kind": "lora", "quantize": "nf4"})), None, device)
    assert q.memory.weights == planned.weights < estimate(shape, lora).weights
    assert q.memory.peak == planned.peak and q.fits
    plain = plan_memory(load_recipe(write_recipe(tmp_path / "b", method={"kind": "lora"})), None, device)
    (remedy,) = [x for x in plain.remedies if x.name == "QLoRA (4-bit base)"]
    assert remedy.available and remedy.fits and remedy.peak == planned.peak
    assert remedy.changes == {"method.quantize": "nf4"}
    full = plan_memory(load_recipe(write_recipe(tmp_path / "c")), None, device)
    (remedy,) = [x for x in full.remedies if x.name == "QLoRA (4-bit base)"]
    assert remedy.changes == {"method.kind": "lora", "method.rank": 16, "method.quantize": "nf4"}
