"""`[method] quantize = 'nf4'` (QLoRA): the frozen base's linear layers stored in 4-bit NF4.

What is quantized: every `nn.Linear` of the base but the output head (as transformers'
BitsAndBytesConfig leaves it), into bitsandbytes' `Linear4bit`: NF4 codes, two to a byte, an
absmax per block of 64 weights, and those absmaxes quantized again to 8 bits per block of 256
(double quantization) with an fp32 scale each. Embeddings, norms, the output head and the LoRA
adapters stay fp32; each forward and backward dequantizes a layer's weight to fp32 for its
matmul and frees it after (bf16 under [precision] bf16 autocast).

Why it resumes exactly: quantizing is a pure function of the weights, done on the CPU at every
start from the model files (or builtin:tiny's seeded init), before the model moves to its
device; nothing of it draws on torch's RNG. A checkpoint holds the adapters and the optimizer,
never the 4-bit base (its tensors do not require grad).

Why bitsandbytes: its `Linear4bit` runs forward and backward on the CPU here (0.50.2), peft wraps
it with LoRA natively (peft.tuners.lora.bnb), and ember already uses it for 8-bit AdamW states.
torchao's NF4 tensor, the other candidate, is not installed in ember's environment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ember.errors import EmberError, NothingToQuantize
from ember.train.gguf_blocks import is_block_linear

NF4_BLOCK = 64        # weights per absmax (bitsandbytes' default block size for 4-bit)
NESTED_BLOCK = 256    # absmaxes per fp32 scale under double quantization


def bitsandbytes(setting: str, instead: str) -> Any:
    """bitsandbytes, imported quietly (on CPUs with AVX512-BF16 it logs a warning at import about
    its single-row CPU kernel, which falls back to its own C library, and below the commands nothing prints); EmberError naming
    `setting` and what to set `instead` when it is not installed."""
    try:
        log = logging.getLogger("bitsandbytes")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            import bitsandbytes as bnb
        finally:
            log.setLevel(level)
    except ImportError as e:
        raise EmberError(f"{setting} needs the bitsandbytes package ({e}); install it "
                         f"(pip install 'bitsandbytes>=0.50'), or {instead}") from None
    return bnb


def bnb_for_nf4() -> Any:
    """bitsandbytes, for [method] quantize = 'nf4' (the error names that setting)."""
    return bitsandbytes("[method] quantize = 'nf4'", "set quantize = 'none'")


def quantize_base(model: nn.Module, make: Callable[[nn.Linear], nn.Module] | None = None) -> int:
    """Replace every nn.Linear but the output head by an NF4 Linear4bit (double quantization),
    quantized on the CPU; return how many were replaced. `make` builds each 4-bit layer from its
    linear instead (the plan's trace: ember.doctor.fake_step, whose weights are fake)."""
    make = make or _nf4
    head = model.get_output_embeddings()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # nn.Linear and its subclasses (Falcon's FalconLinear), as transformers' bitsandbytes
            # integration takes them; not one already 4-bit (Linear4bit is an nn.Linear too)
            if not isinstance(child, nn.Linear) or is_4bit(child) or child is head:
                continue
            setattr(parent, name, make(child))
            count += 1
    if not count:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise NothingToQuantize(
            f"[method] quantize = 'nf4': model_type {kind!r} has no nn.Linear layer but its output head, and "
            f"bitsandbytes stores only nn.Linear in 4 bits (GPT-2's layers are Conv1D): nothing would be "
            f"quantized; set quantize = 'none' (LoRA over the base as it is)")
    return count


def linear_4bit(child: nn.Linear) -> nn.Module:
    """An empty NF4 Linear4bit of `child`'s shape on the meta device (nn.Linear's random init
    would draw on torch's RNG)."""
    q = bnb_for_nf4().nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                    compute_dtype=torch.float32, compress_statistics=True, quant_type="nf4",
                                    device="meta")
    # On CPUs with AVX512-BF16, an eval-mode forward without grad would repack the weight in
    # place into a bf16 inference layout that training forwards then use too, with no
    # gradient for their input: evaluation would change the next steps' training.
    q.support_avx512bf16_for_cpu = False
    return q


def _nf4(child: nn.Linear) -> nn.Module:
    q = linear_4bit(child)
    weight = child.weight.detach().to("cpu", torch.float32)
    q.weight = bnb_for_nf4().nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                           blocksize=NF4_BLOCK).to("cpu")  # .to quantizes
    if child.bias is not None:
        q.bias = nn.Parameter(child.bias.detach().clone(), requires_grad=child.bias.requires_grad)
    return q.to(child.weight.device)


def is_4bit(module: nn.Module) -> bool:
    """Whether `module` is a 4-bit bitsandbytes linear (without importing bitsandbytes)."""
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """A quantized linear's weight as fp32, exactly as its forward computes with it."""
    if is_block_linear(module):
        return module.dequantized()
    w = module.weight
    return bnb_for_nf4().functional.dequantize_4bit(w.data, w.quant_state).to(torch.float32)


def storage_bytes(module: nn.Module) -> int:
    """Bytes a Linear4bit's weight holds: the packed codes and its quantization state (absmax
    codes, nested scales, offset and code maps), the bias aside."""
    state = module.weight.quant_state
    tensors = [module.weight.data, state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors)


def _plain(module: nn.Module, weight: torch.Tensor) -> nn.Linear:
    out = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if module.bias is not None:
        out.bias = nn.Parameter(module.bias.detach().to(torch.float32).clone(), requires_grad=False)
    return out


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` is a quantized base linear: bitsandbytes' 4-bit one ('nf4') or a GGUF
    file's blocks ('gguf')."""
    return is_4bit(module) or is_block_linear(module)


def merge_adapters(model: nn.Module) -> nn.Module:
    """The plain fp32 model of a peft LoRA model: each adapter merged into its base weight, a
    quantized base weight dequantized first (peft's merge_and_unload would quantize the sum again,
    or add it to a GGUF layer's bytes)."""
    from peft.tuners.lora import LoraLayer
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not any(is_quantized(m.get_base_layer()) for m in layers) and not any(map(is_quantized, model.modules())):
        return model.merge_and_unload()
    with torch.no_grad():
        for layer in layers:
            base = layer.get_base_layer()
            if not is_quantized(base):
                layer.merge()
                continue
            weight = dequantized_weight(base)
            for name in layer.active_adapters:
                weight += layer.get_delta_weight(name).to(torch.float32)
            layer.base_layer = _plain(base, weight)
        plain = model.unload()  # each LoRA layer replaced by its (merged) base
        for parent in list(plain.modules()):
            for name, child in list(parent.named_children()):
                if is_quantized(child):  # a linear LoRA did not adapt
                    setattr(parent, name, _plain(child, dequantized_weight(child)))
    return plain
