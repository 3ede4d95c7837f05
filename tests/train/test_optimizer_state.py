"""[optimizer] state_dtype = 'int8': bitsandbytes' 8-bit AdamW moments, their bytes against fp32
AdamW's and against `ember plan`'s figures, and the errors a user can meet. That a run with them
resumes bit-exact is tests/e2e/test_resume.py (its "int8" configuration)."""

from __future__ import annotations

import dataclasses
import gc
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ember.doctor.measure import live_tensor_bytes, measured_step, step_peak
from ember.errors import EmberError
from ember.plan.memory import LINEARS, ModelShape, TrainShape, estimate
from ember.recipe import MethodConfig, OptimizerConfig, Recipe, load_recipe
from ember.train.loss import causal_lm_loss
from ember.train.model import apply_lora, tiny_config
from ember.train.parts import build_optimizer, check_state, state_bytes
from ember.train.sharding import check_distributed
from tests.helpers import write_recipe

SMALL = LlamaConfig(vocab_size=2000, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, use_cache=False)


def stepped(config: LlamaConfig, state_dtype: str, lora: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of `config` and its optimizer after one step (the state exists from then on)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if lora:
        model = apply_lora(model, MethodConfig(kind="lora"))
    opt = build_optimizer(model, OptimizerConfig(state_dtype=state_dtype))
    causal_lm_loss(model, torch.randint(0, config.vocab_size, (2, 16))).backward()
    opt.step()
    return model, opt


def test_8bit_state_takes_under_three_tenths_of_fp32_adamws():
    _, fp32 = stepped(SMALL, "fp32")
    _, int8 = stepped(SMALL, "int8")
    assert isinstance(fp32, torch.optim.AdamW) and not isinstance(int8, torch.optim.AdamW)
    ratio = state_bytes(int8) / state_bytes(fp32)
    assert ratio <= 0.3, ratio
    big = [s for s in int8.state.values() if s["state1"].numel() >= 4096]
    assert big and all(s["state1"].dtype == s["state2"].dtype == torch.uint8 for s in big)


@pytest.mark.parametrize("config,lora", [(tiny_config(), False), (SMALL, False), (SMALL, True)],
                         ids=["tiny-full", "small-full", "small-lora"])
def test_the_plans_optimizer_figure_is_the_measured_state(config, lora):
    shape = ModelShape.from_config(config)
    for dtype, kind in (("int8", "adamw8bit"), ("fp32", "adamw")):
        _, opt = stepped(config, dtype, lora)
        planned = estimate(shape, TrainShape(2, 16, lora=lora, lora_targets=frozenset(LINEARS), optimizer=kind))
        # torch's AdamW also keeps a 4-byte step counter per tensor, which the plan leaves out.
        counters = 4 * len(opt.state) if dtype == "fp32" else 0
        assert state_bytes(opt) == planned.optimizer + counters, dtype


def test_the_8bit_step_peak_is_planned():
    """The 8-bit update dequantizes each tensor's moments to fp32 while it updates it: the plan's
    peak counts those temporaries, against the measured peak of the loop's own step (a batch so
    small that the update is the peak; bench/optimizer_state.py measures larger models)."""
    h, f, layers, heads, kv, vocab, b, s = 96, 256, 3, 6, 2, 300, 1, 16
    cpu = torch.device("cpu")
    gc.collect()
    foreign = live_tensor_bytes(cpu)  # what earlier tests left alive in this worker (test_memory.py)
    config = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    r = Recipe()
    r = dataclasses.replace(r, optimizer=dataclasses.replace(r.optimizer, state_dtype="int8"))
    step = measured_step(model, torch.randint(0, vocab, (b, s)), cpu, recipe=r)
    step()
    measured = step_peak(step, cpu) - foreign
    est = estimate(ModelShape.from_config(config), TrainShape(b, s, optimizer="adamw8bit"))
    assert est.phase == "optimizer step"
    assert -0.05 <= est.peak / measured - 1 <= 0.10, (est.peak, measured)


def test_a_bad_state_dtype_is_named_with_the_choices(tmp_path):
    with pytest.raises(EmberError, match=r"\[optimizer\] state_dtype = 'int4': must be one of 'fp32', 'int8'"):
        load_recipe(write_recipe(tmp_path, optimizer={"state_dtype": "int4"}))


def test_without_bitsandbytes_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` meets when absent
    with pytest.raises(EmberError, match="needs the bitsandbytes package.*pip install"):
        build_optimizer(LlamaForCausalLM(tiny_config()), OptimizerConfig(state_dtype="int8"))


@pytest.mark.parametrize("saved,loaded", [("fp32", "int8"), ("int8", "fp32")])
def test_a_checkpoint_of_the_other_state_dtype_is_refused(saved, loaded):
    """Either optimizer takes the other's state_dict silently and fails at its next step; the
    resume checks it (ember.train.resume turns the ValueError into an error naming the checkpoint)."""
    model, opt = stepped(tiny_config(), saved)
    other = build_optimizer(model, OptimizerConfig(state_dtype=loaded))
    other.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match=f"moments in {saved}, the recipe's .* state_dtype is '{loaded}'"):
        check_state(other, loaded)
    check_state(opt, saved)  # its own kind passes


def test_8bit_state_is_refused_for_several_ranks(tmp_path):
    r = load_recipe(write_recipe(tmp_path, optimizer={"state_dtype": "int8"}))
    with pytest.raises(EmberError, match="state_dtype = 'int8' trains in one process only"):
        check_distributed(r, 2, "here")


def test_the_plan_counts_8bit_state_and_offers_it_as_a_remedy(tmp_path):
    from ember.hardware import Device, Kind
    from ember.plan.planner import plan_memory
    shape = ModelShape.from_config(tiny_config())
    planned = estimate(shape, TrainShape(4, 32, optimizer="adamw8bit"))
    cap = int(estimate(shape, TrainShape(4, 32)).peak * 1.05)  # fp32 moments do not fit with the 10% margin
    device = [Device(0, "capped", Kind.CPU, cap, cap)]
    int8 = plan_memory(load_recipe(write_recipe(tmp_path / "a", optimizer={"state_dtype": "int8"})), None, device)
    assert int8.memory.optimizer == planned.optimizer and int8.memory.peak == planned.peak and int8.fits
    fp32 = plan_memory(load_recipe(write_recipe(tmp_path / "b")), None, device)
    assert not fp32.fits
    (remedy,) = [x for x in fp32.remedies if x.name == "8-bit optimizer state"]
    assert remedy.available and remedy.fits and remedy.peak == planned.peak
    assert remedy.changes == {"optimizer.state_dtype": "int8"}
