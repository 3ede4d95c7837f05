"""The step of ember.doctor.traced run on fake tensors: imports torch, transformers and peft, so
it is imported only when a trace is not cached."""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from ember.device import autocast
from ember.errors import EmberError
from ember.models import model_config, resolve_path
from ember.plan.dequant import dequantize_once
from ember.plan.memory import moment_bytes
from ember.plan.planner import Traced
from ember.recipe import Recipe
from ember.train.loss import causal_lm_loss
from ember.train.model import prepare_model, trainable_parameters
from ember.train.parts import build_optimizer


def trace(r: Recipe) -> Traced:
    """Build the recipe's model on fake tensors and count two of its steps (see the module)."""
    from transformers import AutoModelForCausalLM

    config = model_config(r.model.path)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError) as e:
        raise EmberError(f"[model] path = {r.model.path!r}: transformers cannot build a causal LM from its "
                         f"config: {e}") from None
    gguf = resolve_path(r.model.path) if r.method.quantize == "gguf" else None  # its blocks' sizes
    model = prepare_model(model, r.method, r.train.activation_checkpointing, make_4bit=_meta_4bit, gguf=gguf,
                          spec=r.model.path)
    model.train()
    cpu = torch.device("cpu")
    accum = min(r.train.grad_accum, 2)  # from the second micro-batch on, every one is the same
    tokens = r.train.micro_batch * r.data.seq_len
    with FakeTensorMode():
        _fake_parameters(model)
        params = trainable_parameters(model)
        optimizer = build_optimizer(model, dataclasses.replace(r.optimizer, state_dtype="fp32"))
        ids = torch.randint(0, config.vocab_size, (r.train.micro_batch, r.data.seq_len))
        flops = FlopCounterMode(display=False)

        def step(counting: Any = nullcontext()) -> None:
            for i in range(accum):
                with counting if i == 0 else nullcontext():
                    with autocast(cpu, r.precision.mode):
                        loss = causal_lm_loss(model, ids, r.train.loss_chunk, tokens * accum)
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(params, r.optimizer.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        held = [*model.parameters(), *model.buffers(), *_quantization_state(model)]  # the weights, faked
        live = LiveBytes(held)
        with live, _rows_read_as_unpacked():
            step(flops)
            live.peak = live.now  # the plan is the second step's: the optimizer state exists
            live.timeline = [live.now]
            step()
            live.timeline.append(live.now)
    per_micro_batch = 2 * accum  # the two steps' micro-batches, every one the same
    weights = sum(t.numel() * t.element_size() for t in held)
    state = live.now - weights
    sizes = [p.numel() for p in params]
    kind = "adamw8bit" if r.optimizer.state_dtype == "int8" else "adamw"
    wanted = sum(moment_bytes(n, kind) for n in sizes)
    eight_bit = sum(moment_bytes(n, "adamw8bit") for n in sizes)
    return Traced(peak_bytes=live.peak - state + wanted, weights=weights, optimizer=wanted,
                  gradients=sum(p.numel() * p.element_size() for p in params),
                  flops_per_token=flops.get_total_flops() / tokens, trainable=sum(sizes),
                  params=_weight_count(model), family=config.model_type,
                  timeline=tuple(live.timeline), optimizer_int8=eight_bit,
                  dequant_calls=len(live.dequantized) // per_micro_batch,
                  dequant_bytes=sum(map(dequantize_once, live.dequantized)) // per_micro_batch)


def _weight_count(model: Any) -> int:
    """The model's parameters as weights, not storage: a quantized linear's packed weight counts
    its in x out weights (its numel is bytes, or NF4 codes two to a byte)."""
    from ember.train.quantize import is_quantized
    quantized = {id(m.weight): m.in_features * m.out_features for m in model.modules() if is_quantized(m)}
    return sum(quantized.get(id(p), p.numel()) for p in model.parameters())


def _fake_parameters(model: Any) -> None:
    """Each parameter and buffer of a meta-device model replaced by a fake CPU tensor (tied ones
    stay tied). Run inside FakeTensorMode."""
    made: dict[int, Any] = {}

    def fake(t: Any, parameter: bool) -> Any:
        if id(t) not in made:
            x = torch.empty(t.shape, dtype=t.dtype)
            made[id(t)] = torch.nn.Parameter(x, requires_grad=t.requires_grad) if parameter else x
            state = getattr(t, "quant_state", None)
            if state is not None:  # a 4-bit weight (bitsandbytes' Params4bit cannot hold a fake tensor):
                # a plain parameter with what Linear4bit reads from one
                made[id(t)].quant_state = _fake_state(state)
                for name in ("quant_type", "blocksize", "compress_statistics", "quant_storage", "bnb_quantized"):
                    setattr(made[id(t)], name, getattr(t, name))
        return made[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake(p, True)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b, False)


def _meta_4bit(child: Any) -> Any:
    """The 4-bit layer ember.train.quantize makes of `child` (NF4, double quantization), on the
    meta device: its packed codes and quantization state of the sizes bitsandbytes gives them,
    no values (`_fake_parameters` makes them fake, quantization state included)."""
    from ember.train.quantize import NESTED_BLOCK, NF4_BLOCK, bnb_for_nf4, linear_4bit
    bnb = bnb_for_nf4()
    meta, f32 = torch.device("meta"), torch.float32
    n = child.in_features * child.out_features
    blocks = -(-n // NF4_BLOCK)
    nested = bnb.functional.QuantState(absmax=torch.empty(-(-blocks // NESTED_BLOCK), dtype=f32, device=meta),
                                       code=torch.empty(256, dtype=f32, device=meta), blocksize=NESTED_BLOCK, dtype=f32)
    state = bnb.functional.QuantState(
        absmax=torch.empty(blocks, dtype=torch.uint8, device=meta), shape=torch.Size((child.out_features, child.in_features)),
        code=torch.empty(16, dtype=f32, device=meta), blocksize=NF4_BLOCK, quant_type="nf4", dtype=f32,
        offset=torch.empty((), dtype=f32, device=meta), state2=nested)
    q = linear_4bit(child)
    q.weight = bnb.nn.Params4bit(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=meta), requires_grad=False,
                                 quant_state=state, blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4",
                                 quant_storage=torch.uint8, module=q, bnb_quantized=True)
    if child.bias is not None:
        q.bias = child.bias
    return q


def _quantization_state(model: Any) -> list[Any]:
    """The tensors of the 4-bit layers' quantization state (neither parameters nor buffers)."""
    out = []
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            out += [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
    return out


def _fake_state(state: Any) -> Any:
    """A 4-bit weight's quantization state with fake tensors of its tensors' shapes and dtypes."""
    fake = {k: torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v
            for k, v in vars(state).items() if k != "nested"}
    fake["state2"] = _fake_state(state.state2) if state.state2 is not None else None
    return type(state)(**fake)


@contextmanager
def _rows_read_as_unpacked() -> Iterator[None]:
    """transformers told, while the trace runs, what it reads in the real step: one sequence per row."""
    # The real step (ids only, as calibration and "mixed" packing run it) leaves the position ids
    # to the model: 0..n-1 in every row. transformers reads them (find_packed_sequence_indices),
    # sees no packed rows and calls SDPA with is_causal, no mask and grouped K/V. A fake tensor
    # cannot be read, so it would assume packing and build the float mask, K/V repeated to every
    # head and their gradients: +1 to +5% on GPT-NeoX, OLMo, StableLM, Gemma 3, GPT-J, Phi-3.
    from transformers import masking_utils
    read = getattr(masking_utils, "find_packed_sequence_indices", None)
    if read is None:  # another transformers: the trace over-counts (tests/plan/test_traced.py says so)
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = read


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages alive, counted as the ops create them (each storage
    once, freed when it dies), and their high point; once `timeline` is a list, the bytes alive
    at each local high point (the last count before a free) are appended to it."""

    def __init__(self, existing: list[Any]):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0
        self.timeline: list[int] | None = None
        self.rising = False
        self.dequantized: list[int] = []  # each 4-bit call's weight elements (forward's and backward's)
        for t in existing:
            self._count(t)

    def _count(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.now += self.sizes[key]
        self.peak = max(self.peak, self.now)
        self.rising = True
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        if self.rising and self.timeline is not None and key in self.sizes:
            self.timeline.append(self.now)
        self.rising = False
        self.now -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        op = getattr(func, "name", lambda: "")()
        if op == "bitsandbytes::gemm_4bit":  # a 4-bit forward: (A, B, shape of B, ...)
            self._within_gemm_4bit(out, *args, **(kwargs or {}))
            self.dequantized.append(math.prod(args[2]))
        elif op == "bitsandbytes::dequantize_4bit":  # backward's, for its input's gradient: (A, absmax, blocksize, quant_type, shape, dtype)
            self.dequantized.append(math.prod(args[4]))
        for t in tree_leaves(out):
            self._count(t)
        if torch.Tag.pointwise in getattr(func, "tags", ()):
            self._within_pointwise(out, args, kwargs or {})
        return out

    def _within_pointwise(self, out: Any, args: Any, kwargs: Any) -> None:
        """A pointwise op's own high point on the CPU, which its fake kernel does not allocate:
        an input of another dtype than the result's (autocast's bf16 beside an fp32 residual, a
        LoRA output added to a 4-bit layer's) is first copied to the result's dtype, whole, and
        that copy lives while the op writes its output (TensorIterator promotes CPU inputs by
        temporaries; a 0-dim input, a scalar, is not copied). The trace runs on fake CPU tensors
        for every device: on CUDA, which casts inside its kernels, this counts copies it will not
        make (on the safe side)."""
        result = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        if result is None or not result.dtype.is_floating_point:
            return
        copies = sum(t.numel() * result.element_size() for t in tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor) and t.dim() > 0 and t.dtype.is_floating_point
                     and t.dtype != result.dtype)
        if copies:
            self._high_point(self.now + copies)

    def _within_gemm_4bit(self, out: Any, a: Any, b: Any, shape_b: Any, *args: Any, absmax_8bit: Any = None,
                          **kwargs: Any) -> None:
        """A 4-bit forward's own high point, which its fake kernel does not allocate: on the CPU
        bitsandbytes' gemm_4bit dequantizes the block scales (to fp32) and the whole weight (to
        the input's dtype), then multiplies, all three alive as the output is made
        (bitsandbytes.backends.default.ops). Its backward dequantizes in ops of its own, counted."""
        scales = absmax_8bit.numel() * 4 if absmax_8bit is not None else 0
        weight = shape_b[0] * shape_b[1] * a.element_size()
        self._high_point(self.now + scales + weight + out.untyped_storage().nbytes())

    def _high_point(self, alive: int) -> None:
        """A high point inside an op: the peak, and a point of the timeline (plan --fit derives
        a micro batch's peak from the timeline's points: ember.plan.fit.peak_between)."""
        self.peak = max(self.peak, alive)
        if self.timeline is not None:
            self.timeline.append(alive)
