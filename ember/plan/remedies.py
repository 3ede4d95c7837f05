"""Remedies for a recipe that does not fit: each alone with its predicted peak and compute cost,
then the cheapest combination that fits; ranked cheapest-that-fits first. Pure arithmetic over
the memory estimate (ember/plan/memory.py); sharding over ranks is the registry's FSDP arithmetic
(ember/plan/layout.py, ember/parallel/fsdp.py), the same figures `ember plan`'s advisor prints."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from typing import Any

from ember.hardware import Device
from ember.metrics.flops import Architecture, flops_per_token
from ember.plan.layout import rank_memory
from ember.plan.memory import (LINEARS, GiB, MiB, Breakdown, ModelShape, TrainShape, estimate, qlora,
                               trainable_params)
from ember.recipe import Recipe


def train_shape(r: Recipe) -> TrainShape:
    """What the memory estimate needs from a recipe."""
    targets = set(LINEARS) if r.method.target_modules == ["all-linear"] else set(r.method.target_modules)
    return TrainShape(r.train.micro_batch, r.data.seq_len, lora=r.method.kind == "lora",
                      lora_rank=r.method.rank, lora_targets=frozenset(targets & set(LINEARS)),
                      lora_dropout=r.method.dropout, activation_checkpointing=r.train.activation_checkpointing,
                      autocast=r.precision.mode != "fp32", loss_chunk=r.train.loss_chunk,
                      optimizer="adamw8bit" if r.optimizer.state_dtype == "int8" else "adamw",
                      quantize=r.method.quantize, accumulating=r.train.grad_accum > 1)


def architecture(m: ModelShape, t: TrainShape) -> Architecture:
    """What the FLOPs formula needs, from the model's shape and the training shape."""
    embed = m.vocab * m.hidden
    matmul = m.params() - embed + (embed if m.tied else 0)
    return Architecture(matmul, trainable_params(m, t), m.layers, m.heads, m.head_dim, t.seq_len, t.lora)


def recompute_flops(m: ModelShape, t: TrainShape) -> float:
    """FLOPs per token a step spends beyond the FLOPs formula: activation checkpointing's second
    forward through the layers (2N and a third of attention), the chunked loss's second pass
    through the output layer."""
    a, extra = architecture(m, t), 0.0
    if t.activation_checkpointing:
        extra += 2 * (a.matmul_params - m.vocab * m.hidden) + 4 * a.layers * a.heads * a.head_dim * a.seq_len
    if t.loss_chunk:
        extra += 2 * m.hidden * m.vocab
    return extra


def step_flops(m: ModelShape, t: TrainShape, grad_accum: int) -> float:
    """FLOPs of one optimizer step: the FLOPs formula and `recompute_flops` over its tokens."""
    return (flops_per_token(architecture(m, t)).total + recompute_flops(m, t)) * t.tokens * grad_accum


def bitsandbytes_installed() -> bool:
    """Whether 8-bit optimizer state can run here (found, not imported: planning stays torch-free)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def size(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def fits(peak: int, free: int, margin: float) -> bool:
    """The rule of docs/boundary.md: the peak plus its margin within the device's free memory."""
    return peak * (1 + margin) <= free


@dataclass
class Remedy:
    name: str
    changes: dict[str, Any]  # dotted recipe keys -> new values
    peak: int
    flops_factor: float  # compute per optimizer step relative to the recipe's (1.0 = same)
    fits: bool
    how: str  # the arithmetic, in words
    available: bool = True  # False: ember cannot apply it here (named in `how`)
    launch: str = ""  # the `ember run` flags it needs besides `changes` ("" : none)


FSDP_RANKS = 2  # the smallest sharding


def remedies(m: ModelShape, r: Recipe, devices: list[Device], margin: float) -> list[Remedy]:
    """Each remedy alone, then the cheapest combination that fits; ranked by compute cost.
    `devices`: the run's (ember.hardware.for_run), the one a process trains on first."""
    t = train_shape(r)
    budget = devices[0].free
    out = (_applicable(m, r, t, budget, margin) + _sharded(m, r, t, devices, margin)
           + _not_applicable(estimate(m, t), devices[0], margin))
    if not any(x.fits and x.available for x in out):
        out += _combined(m, r, out, budget, margin)
    return sorted(out, key=lambda x: (not x.fits, not x.available, x.flops_factor))


def _applicable(m: ModelShape, r: Recipe, t: TrainShape, budget: int, margin: float) -> list[Remedy]:
    """The remedies ember applies, each alone, for the changes the recipe does not have yet."""
    f = flops_per_token(architecture(m, t)).total
    out = _accumulation(m, r, t, budget, margin)
    if not t.activation_checkpointing:
        b = estimate(m, replace(t, activation_checkpointing=True))
        extra = recompute_flops(m, replace(t, activation_checkpointing=True, loss_chunk=0)) / f
        out.append(Remedy("activation checkpointing", {"train.activation_checkpointing": True}, b.peak,
                          1 + extra, fits(b.peak, budget, margin), f"keep each layer's input only and recompute the layer in "
                          f"backward: one more forward through the layers, +{extra:.0%} FLOPs"))
    if not t.loss_chunk:
        chunk = min(1024, t.tokens)
        b = estimate(m, replace(t, loss_chunk=chunk))
        extra = recompute_flops(m, replace(t, activation_checkpointing=False, loss_chunk=chunk)) / max(f, 1)
        out.append(Remedy("chunked loss", {"train.loss_chunk": chunk}, b.peak, 1 + extra, fits(b.peak, budget, margin),
                          f"cross-entropy over {chunk}-token chunks: the {t.tokens} x {m.vocab} fp32 "
                          f"logits never exist at once; the output layer runs twice, +{extra:.0%} FLOPs"))
    if not t.autocast:
        b = estimate(m, replace(t, autocast=True))
        out.append(Remedy("bf16 mixed precision", {"precision.mode": "bf16"}, b.peak, 1.0, fits(b.peak, budget, margin),
                          "bf16 activations, fp32 master weights and optimizer state; same FLOPs, "
                          "faster on GPUs with bf16 tensor cores, often slower on CPUs; results differ "
                          "from fp32 in the low bits"))
    if t.optimizer != "adamw8bit":
        out.append(_eight_bit(m, t, budget, margin))
    if not t.lora:
        lt = replace(t, lora=True, lora_rank=16, lora_targets=frozenset(LINEARS))
        b = estimate(m, lt)
        ratio = flops_per_token(architecture(m, lt)).total / f
        out.append(Remedy("LoRA instead of full fine-tuning", {"method.kind": "lora", "method.rank": 16},
                          b.peak, ratio, fits(b.peak, budget, margin),
                          f"train rank-16 adapters ({trainable_params(m, lt):,} parameters) instead of all "
                          f"{m.params():,}: gradients and optimizer state only for the adapters; no weight "
                          f"gradients for the base ({ratio - 1:+.0%} FLOPs); a different job: adapters, "
                          f"not new weights"))
    if t.quantize != "nf4":
        out.append(_qlora(m, t, budget, margin))
    return out


DIVISOR_SEARCH = 2**20  # trial division stops here: every divisor of a batch of up to 2^40 rows


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, found in pairs up to its square root: all of them for n up
    to DIVISOR_SEARCH^2; beyond, those up to DIVISOR_SEARCH and their co-divisors (trying every
    number up to n, a micro batch of 2^40 kept `ember plan` from ever finishing)."""
    small = [d for d in range(1, min(math.isqrt(n), DIVISOR_SEARCH) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _accumulation(m: ModelShape, r: Recipe, t: TrainShape, budget: int, margin: float) -> list[Remedy]:
    """The largest smaller micro batch that fits (else 1), accumulated to the same tokens per step."""
    mb = r.train.micro_batch
    for smaller in reversed(divisors(mb)[:-1]):
        b = estimate(m, replace(t, micro_batch=smaller, accumulating=True))
        if fits(b.peak, budget, margin) or smaller == 1:
            return [Remedy("gradient accumulation", {"train.micro_batch": smaller,
                                                     "train.grad_accum": r.train.grad_accum * mb // smaller},
                           b.peak, 1.0, fits(b.peak, budget, margin),
                           f"micro batch {mb} -> {smaller} x {mb // smaller} accumulated: same tokens per "
                           f"optimizer step and FLOPs; activations and loss buffers shrink {mb // smaller}x; "
                           f"smaller matmuls may run less efficiently (measure with `ember doctor`)")]
    return []


def _eight_bit(m: ModelShape, t: TrainShape, budget: int, margin: float) -> Remedy:
    """AdamW's moments in 8 bits ([optimizer] state_dtype = 'int8'), when bitsandbytes is installed."""
    full, b = estimate(m, t), estimate(m, replace(t, optimizer="adamw8bit"))
    installed = bitsandbytes_installed()
    return Remedy("8-bit optimizer state", {"optimizer.state_dtype": "int8"}, b.peak, 1.0, fits(b.peak, budget, margin),
                  f"AdamW moments in 8 bits (bitsandbytes' blockwise AdamW8bit): {size(full.optimizer)} -> "
                  f"{size(b.optimizer)}; same FLOPs, but on CPU the update is slower and dequantizes each "
                  f"tensor's moments to fp32 while it updates it, which can raise the peak where one tensor (a "
                  f"large embedding) dominates (bench/optimizer_state.py); training differs a little from fp32 "
                  f"moments; one process only"
                  + ("" if installed else "; needs the bitsandbytes package, which is not installed here"),
                  available=installed)


def _qlora(m: ModelShape, t: TrainShape, budget: int, margin: float) -> Remedy:
    """The base's decoder linears in 4-bit NF4 under LoRA adapters ([method] quantize = 'nf4'):
    a LoRA recipe keeps its adapters; a full one becomes rank-16 LoRA on every linear."""
    q = replace(t, quantize="nf4") if t.lora else qlora(t)
    b, before = estimate(m, q), estimate(m, t)
    changes: dict[str, Any] = {"method.quantize": "nf4"}
    if not t.lora:
        changes = {"method.kind": "lora", "method.rank": q.lora_rank, **changes}
    installed = importlib.util.find_spec("bitsandbytes") is not None  # not imported: planning stays torch-free
    ratio = flops_per_token(architecture(m, q)).total / flops_per_token(architecture(m, t)).total
    return Remedy("QLoRA (4-bit base)", changes, b.peak, ratio, fits(b.peak, budget, margin),
                  f"the decoder layers' linears in 4-bit NF4 (bitsandbytes, double quantization), weights "
                  f"{size(before.weights)} -> {size(b.weights)}; each matmul dequantizes its weight, slower "
                  f"on CPU; the adapters learn over the quantized base, so results differ from LoRA's"
                  + ("" if t.lora else f"; a different job: rank-{q.lora_rank} adapters, not new weights")
                  + "; one process only"
                  + ("" if installed else "; needs the bitsandbytes package, which is not installed here"),
                  available=installed)


def _sharded(m: ModelShape, r: Recipe, t: TrainShape, devices: list[Device], margin: float) -> list[Remedy]:
    """FSDP over two ranks, one per accelerator of this machine; where it has one accelerator, or
    none (CPU ranks are processes sharing its RAM), over two machines like it: not here."""
    n, one = FSDP_RANKS, estimate(m, t).peak
    changes: dict[str, Any] = {} if r.distributed.strategy == "fsdp" else {"distributed.strategy": "fsdp"}
    if t.loss_chunk:  # a distributed run refuses the chunked loss (ember.train.sharding)
        changes["train.loss_chunk"] = 0
    here = rank_memory(m, replace(t, loss_chunk=0), "fsdp", n, n, devices)
    per, name = size(here.per_rank), f"FSDP across {n} devices"
    how = (f"weights, gradients and optimizer state sharded {n} ways (FSDP2 over torchrun ranks, [distributed] "
           f"strategy = \"fsdp\"): {per} per rank at the step's peak against {size(one)} in one "
           f"process; the compute splits over the ranks, which add two all-gathers of the weights per micro-batch "
           f"and a reduce-scatter of the gradients per step (`ember doctor --comm`, then `ember plan`, prices them)")
    kind = devices[0].kind
    if not here.shared and not here.missing:
        return [Remedy(name, changes, here.per_rank, 1.0, fits(here.need, here.free, margin),
                       how + f"; one rank on each of {n} of this machine's {len(devices)} {kind} devices "
                       f"({size(here.free)} free on the fuller): `ember run RECIPE --out DIR --nproc {n}`",
                       launch=f"--nproc {n}")]
    nodes = (f"across {n} machines like this one, one rank each (`ember run RECIPE --out DIR --nnodes {n} "
             f"--node-rank K --rdzv HOST:PORT` on each, DIR shared), each holds {per}")
    if here.shared:
        where = (f"this machine has no accelerator: {n} ranks here (`--nproc {n}`, gloo) are processes sharing its "
                 f"host RAM, {n} x {per} = {size(here.need)} in all, more than one process needs; {nodes}")
    else:
        where = (f"this machine has {len(devices)} {kind} device: on a machine with {n} (`--nproc {n}`), or {nodes}")
    return [Remedy(name, changes, here.per_rank, 1.0, fits(here.per_rank, devices[0].free, margin),
                   how + "; " + where, available=False, launch=f"--nnodes {n} --node-rank K --rdzv HOST:PORT")]


def _not_applicable(full: Breakdown, device: Device, margin: float) -> list[Remedy]:
    """The remedies ember does not apply yet, listed with what they would save (8-bit optimizer
    state is `_eight_bit`: applied where bitsandbytes is installed)."""
    budget = device.free
    out = []
    if device.accelerator:
        offload = full.peak - full.optimizer
        how = (f"AdamW moments ({size(full.optimizer)}) in host memory, the update on the CPU; "
               f"ember does not do it yet")
    else:  # the optimizer state is in host RAM already
        offload = full.peak
        how = ("for accelerators only: on this machine the optimizer state is in host RAM already, so moving "
               "it saves nothing (ember does not do it on accelerators yet either)")
    out.append(Remedy("CPU offload of the optimizer state", {}, offload, 1.0, fits(offload, budget, margin), how,
                      available=False))
    return out


def _combined(m: ModelShape, r: Recipe, single: list[Remedy], budget: int, margin: float) -> list[Remedy]:
    """When no single remedy fits: the available ones of one process (not a switch to LoRA, not sharding)
    added in order of cost until the estimate fits; that combination, or none."""
    combo: dict[str, Any] = {}
    factor = 1.0
    for rem in sorted((x for x in single if x.available and not x.launch
                       and "method.kind" not in x.changes),  # LoRA, QLoRA from full: another job
                      key=lambda x: x.flops_factor):
        combo.update(rem.changes)
        factor *= rem.flops_factor
        b = estimate(m, train_shape(r.with_changes(combo, "a combined remedy")))
        if fits(b.peak, budget, margin):
            return [Remedy("combined", dict(combo), b.peak, factor, True,
                           "cheapest first: " + " + ".join(
                               x.name for x in single if x.changes and set(x.changes) <= set(combo)))]
    return []
