"""[method] quantize = 'gguf': QLoRA over a GGUF file's own blocks. Its dequantization against
gguf-py's (what transformers loads a GGUF with), the base it keeps against the one LoRA trains
over (bit-identical weights, losses and gradients), the bytes it holds, the merge `ember export`
uses, the plan's trace against a measured step, and the refusals. The demo job's 60-step curves
(the goal: QLoRA's loss within LoRA's spread across seeds) are bench/qlora_quality.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ember.ckpt.contents import trainable_state
from ember.errors import EmberError, NothingToQuantize
from ember.recipe import MethodConfig, ModelConfig
from ember.train.gguf_blocks import BLOCK_BYTES, FORMATS, BlockLinear, dequantize, keep_gguf_blocks
from ember.train.loss import causal_lm_loss
from ember.train.model import load_model
from ember.train.quantize import merge_adapters
from tests.gguf_files import TINY, TYPES, gguf_parses, shared_tiny_gguf, write_tiny_gguf

LORA = dict(kind="lora", rank=4, alpha=8.0, target_modules=["all-linear"])


@pytest.fixture(scope="module")
def tiny_gguf() -> Path:
    return shared_tiny_gguf()


def built(path: Path, quantize: str) -> torch.nn.Module:
    torch.manual_seed(7)  # LoRA's A init draws on it, as a run's seeded start does
    return load_model(ModelConfig(str(path)), MethodConfig(**LORA, quantize=quantize), False).model


# Where each type keeps its fp16 fields (d, and the minimum or dmin): gguf-py quantizes the
# 32-weight types; for the k-quants (which it cannot quantize) the blocks are random bytes with
# these fields set to finite fp16 numbers.
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("qtype", sorted(FORMATS))
def test_each_format_dequantizes_bit_for_bit_as_gguf_py_does(qtype):
    import gguf
    rng = np.random.default_rng(0)
    kind = gguf.GGMLQuantizationType[qtype]
    per_block, size = FORMATS[qtype]
    if qtype in FP16_FIELDS:
        packed = rng.integers(0, 256, (48, 3 * size), dtype=np.uint8)
        blocks = packed.reshape(-1, size)
        for at in FP16_FIELDS[qtype]:
            blocks[:, at:at + 2] = (rng.standard_normal((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    else:
        weight = (rng.standard_normal((48, 3 * per_block)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
        weight[3, :32] = 0.5  # a constant block: scale 0
        packed = gguf.quants.quantize(weight, kind)
    assert packed.shape == (48, 3 * size)
    want = gguf.quants.dequantize(packed, kind)
    got = dequantize(torch.from_numpy(packed), qtype)
    assert got.shape == (48, 3 * per_block) and got.dtype == torch.float32
    assert np.isfinite(want).all() and torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("qtype", sorted(FORMATS))
def test_each_format_dequantizes_on_the_device_its_blocks_are_on(qtype):
    """The k-quants shifted their codes by a column of shifts made on the CPU: blocks on another
    device (CUDA; the meta device here, which no GPU is needed for) failed with "Tensor on
    device cpu is not on the expected device"."""
    per_block, size = FORMATS[qtype]
    got = dequantize(torch.zeros(4, 2 * size, dtype=torch.uint8, device="meta"), qtype)
    assert got.device.type == "meta" and got.shape == (4, 2 * per_block) and got.dtype == torch.float32


@pytest.mark.parametrize("autocast", [False, True])
def test_a_layer_keeps_its_blocks_for_backward_not_the_dequantized_weight(autocast, monkeypatch):
    """The fp32 weight a forward dequantizes is freed when the forward returns (its saved view
    is the blocks and their geometry: before, an fp32 forward kept it, whose weight.t() is a view
    of dequantize's reshape and escaped the hook), and backward's gradient is nn.Linear's."""
    import gguf
    import weakref
    from ember.train import gguf_blocks
    weight = np.random.default_rng(1).standard_normal((96, 64)).astype(np.float32)
    packed = torch.from_numpy(gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1))
    layer = BlockLinear(torch.nn.Linear(64, 96), packed, "Q4_1")
    plain = torch.nn.Linear(64, 96)
    with torch.no_grad():
        plain.weight.copy_(layer.dequantized())
        plain.bias.copy_(layer.bias)
    made = []

    def recorded(*args):
        out = dequantize(*args)
        made.append(weakref.ref(out if out._base is None else out._base))
        return out
    monkeypatch.setattr(gguf_blocks, "dequantize", recorded)
    for shape in [(2, 24, 64), (24, 64)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, want = layer(x), plain(x)
        del made[:-1]  # the forward's own dequantization
        assert made[0]() is None, f"{shape}: the forward's dequantized weight is alive while its graph is"
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype)
        (got,) = torch.autograd.grad(y, x, g)
        (expected,) = torch.autograd.grad(want, x, g)
        assert torch.equal(y, want) and torch.equal(got, expected)


def test_the_files_blocks_are_the_weights_lora_trains_over_and_train_bit_identically(tiny_gguf):
    plain, kept = built(tiny_gguf, "none"), built(tiny_gguf, "gguf")
    blocks = {n: m for n, m in kept.named_modules() if isinstance(m, BlockLinear)}
    assert len(blocks) == 2 * len(TYPES) - 1  # every decoder matrix but the f32 one
    assert {m.qtype for m in blocks.values()} == set(TYPES.values())
    f32 = kept.get_submodule("base_model.model.model.layers.1.mlp.down_proj.base_layer")
    assert type(f32) is torch.nn.Linear and f32.weight.dtype == torch.float32
    for name, block in blocks.items():
        weight = plain.get_submodule(name).weight
        assert block.weight.dtype == torch.uint8 and not block.weight.requires_grad
        assert block.weight.numel() == weight.numel() // FORMATS[block.qtype][0] * BLOCK_BYTES[block.qtype]
        assert torch.equal(block.dequantized(), weight), name
    # Two steps: the same losses and the same adapters' gradients, bit for bit.
    ids = torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    runs = []
    for model in (plain, kept):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(2):
            loss = causal_lm_loss(model, ids)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((losses, trainable_state(model)))
    (la, sa), (lb, sb) = runs
    assert la == lb and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all("lora_A" in k or "lora_B" in k for k in sb)  # a checkpoint holds only the adapters
    assert any(not torch.equal(v, 0 * v) for k, v in sb.items() if "lora_B" in k)  # they trained
    # Rebuilt from the file, the base is the same bytes (what a resumed run starts from).
    again = {n: m.weight for n, m in built(tiny_gguf, "gguf").named_modules() if isinstance(m, BlockLinear)}
    assert all(torch.equal(again[n], b.weight) for n, b in blocks.items())


def test_the_base_holds_the_files_bytes_not_fp32(tiny_gguf):
    plain, kept = built(tiny_gguf, "none"), built(tiny_gguf, "gguf")

    def base_bytes(model: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)

    matrices = {n: m.weight.numel() for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)
                and "lora_" not in n and n != "base_model.model.lm_head"}
    blocks = {n: m for n, m in kept.named_modules() if isinstance(m, BlockLinear)}
    saved = sum(4 * matrices[n] - b.weight.numel() for n, b in blocks.items())
    assert base_bytes(plain) - base_bytes(kept) == saved > 0


def test_the_merge_adds_each_adapter_to_the_dequantized_blocks(tiny_gguf):
    plain, kept = built(tiny_gguf, "none"), built(tiny_gguf, "gguf")
    with torch.no_grad():
        for model in (plain, kept):
            gen = torch.Generator().manual_seed(5)
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen))  # B starts at zero: make the update visible
    a, b = merge_adapters(plain), merge_adapters(kept)
    assert not any(isinstance(m, BlockLinear) for m in b.modules())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_traced_plan_of_a_gguf_base_counts_its_blocks(tiny_gguf, tmp_path):
    """The plan traces the file's blocks at their sizes (not the formulas' NF4, nor fp32), and its
    peak is within 2% of a measured step's (ember.doctor.measure, as `ember plan --calibrate`
    measures it, less the tensors this test process held before: other tests')."""
    from ember.doctor.calibrated_plan import PlanRequest, plan_recipe
    from ember.events import Events
    from ember.recipe import load_recipe
    from tests.helpers import measured_peak, write_recipe
    recipe = write_recipe(tmp_path, model={"path": str(tiny_gguf)}, method={**LORA, "quantize": "gguf"},
                          data={"seq_len": 32}, train={"micro_batch": 2, "max_steps": 2})
    plan = plan_recipe(PlanRequest(recipe), Events()).plan
    assert any("quantize = 'gguf'" in n for n in plan.notes)
    kept = built(tiny_gguf, "gguf")
    weights = sum(t.numel() * t.element_size() for t in [*kept.parameters(), *kept.buffers()])
    assert plan.memory.weights == weights
    assert plan.model.params == sum(p.numel() for p in built(tiny_gguf, "none").parameters())  # weights, not bytes
    del kept
    measured = measured_peak(load_recipe(recipe))
    assert abs(plan.memory.peak / measured - 1) <= 0.02, (plan.memory.peak, measured)


def test_converting_a_gguf_file_draws_nothing_from_torchs_rng(tmp_path):
    """A run seeds torch, then loads its model. The first run of a GGUF file converts it into a
    model folder (ember.models.convert_gguf), building a model whose init drew on that RNG: its
    LoRA adapters started from other values than every later run's, which read the folder."""
    from ember.models import model_folder
    from ember.paths import home
    path = write_tiny_gguf(tmp_path / "rng.gguf", {**TYPES, "ffn_down": "Q4_0"})  # a file not converted yet
    seeded = torch.manual_seed(7).get_state()
    for converts in (True, False):
        before = set(home().models.iterdir()) if home().models.exists() else set()
        torch.manual_seed(7)
        model_folder(str(path))
        assert (set(home().models.iterdir()) != before) == converts
        assert torch.equal(torch.get_rng_state(), seeded), f"converting={converts} drew on torch's RNG"


def test_a_first_run_of_a_gguf_file_parses_it_once(tmp_path, monkeypatch):
    """A run's first start on a GGUF file checks the model's config (which converts the file:
    transformers opens it for the config, the weights and the tokenizer), then loads it with its
    blocks (indexing them): each opening parsed every metadata field again, 4 parses (~3-4 s each
    for SmolLM2's vocabulary). Now one; a later start reads none."""
    from ember.events import Events
    from ember.recipe import load_recipe
    from ember.train.job import prepare
    from tests.helpers import with_cpu_peak, write_recipe
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))  # nothing converted or indexed yet
    with_cpu_peak(tmp_path / "home")
    path = Path(shutil.copy(shared_tiny_gguf(), tmp_path / "once.gguf"))  # write_tiny_gguf's file of TYPES
    recipe = load_recipe(write_recipe(tmp_path / "r", model={"path": str(path)}, train={"max_steps": 1},
                                      method={**LORA, "quantize": "gguf"}))
    for out, parsed in (("first", 1), ("again", 0)):
        with gguf_parses() as parses:
            job = prepare(recipe, tmp_path / out, False, Events(lambda e: None), ledger_path=False)
        assert parses[0] == parsed, out
        assert sum(isinstance(m, BlockLinear) for m in job.model.modules()) == 2 * len(TYPES) - 1


def test_quantize_gguf_is_refused_without_blocks_it_keeps(tiny_gguf, tmp_path):
    from ember.recipe import load_recipe
    from tests.helpers import write_recipe
    with pytest.raises(EmberError, match=r"\[train\] compile = true with \[method\] quantize = 'gguf'.*set compile = false"):
        load_recipe(write_recipe(tmp_path, method={**LORA, "quantize": "gguf"}, train={"compile": True}))
    with pytest.raises(EmberError, match=r"quantize = 'gguf'.*'builtin:tiny'.*not a \.gguf file.*'nf4'"):
        load_model(ModelConfig("builtin:tiny"), MethodConfig(**LORA, quantize="gguf"), False)
    # and so is its plan (before: "[Errno 2] No such file or directory: '.../builtin:tiny'", from
    # the trace's cache key, which hashed the model's file)
    from ember.doctor.calibrated_plan import PlanRequest, plan_recipe
    from ember.events import Events
    with pytest.raises(EmberError, match=r"quantize = 'gguf'.*'builtin:tiny'.*not a \.gguf file.*'nf4'"):
        plan_recipe(PlanRequest(write_recipe(tmp_path / "plan", method={**LORA, "quantize": "gguf"})), Events())
    every = tuple(f"blk.{i}.{k}" for i in range(2) for k in TYPES)
    unquantized = write_tiny_gguf(tmp_path / "f32.gguf", TYPES, f32=every)
    from transformers import LlamaForCausalLM
    with pytest.raises(NothingToQuantize, match=r"no linear layer of the file is stored in Q4_0, Q4_1, Q8_0, Q4_K, "
                       r"Q5_K, Q6_K \(its layers are F32\)"):
        keep_gguf_blocks(LlamaForCausalLM(TINY), unquantized, str(unquantized))
