"""Remedies for a recipe that does not fit: each alone with its predicted peak and compute cost,
then the cheapest combination that fits; ranked cheapest-that-fits first. Pure arithmetic over
the memory estimate (ember/plan/memory.py)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any

from ember.metrics.flops import Architecture, flops_per_token
from ember.plan.memory import LINEARS, GiB, Breakdown, ModelShape, TrainShape, estimate, trainable_params
from ember.recipe import Recipe


def train_shape(r: Recipe) -> TrainShape:
    """What the memory estimate needs from a recipe."""
    targets = set(LINEARS) if r.method.target_modules == ["all-linear"] else set(r.method.target_modules)
    return TrainShape(r.train.micro_batch, r.data.seq_len, lora=r.method.kind == "lora",
                      lora_rank=r.method.rank, lora_targets=frozenset(targets & set(LINEARS)),
                      lora_dropout=r.method.dropout, activation_checkpointing=r.train.activation_checkpointing,
                      autocast=r.precision.mode != "fp32", loss_chunk=r.train.loss_chunk,
                      optimizer="adamw8bit" if r.optimizer.state_dtype == "int8" else "adamw")


def architecture(m: ModelShape, t: TrainShape) -> Architecture:
    """What the FLOPs formula needs, from the model's shape and the training shape."""
    embed = m.vocab * m.hidden
    matmul = m.params() - embed + (embed if m.tied else 0)
    return Architecture(matmul, trainable_params(m, t), m.layers, m.heads, m.head_dim, t.seq_len, t.lora)


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


def remedies(m: ModelShape, r: Recipe, budget: int, margin: float) -> list[Remedy]:
    """Each remedy alone, then the cheapest combination that fits; ranked by compute cost."""
    t = train_shape(r)
    out = _applicable(m, r, t, budget, margin) + _not_applicable(estimate(m, t), budget, margin)
    if not any(x.fits and x.available for x in out):
        out += _combined(m, r, out, budget, margin)
    return sorted(out, key=lambda x: (not x.fits, not x.available, x.flops_factor))


def _applicable(m: ModelShape, r: Recipe, t: TrainShape, budget: int, margin: float) -> list[Remedy]:
    """The remedies ember applies, each alone, for the changes the recipe does not have yet."""
    f = flops_per_token(architecture(m, t)).total
    out = _accumulation(m, r, t, budget, margin)
    if not t.activation_checkpointing:
        b = estimate(m, replace(t, activation_checkpointing=True))
        a = architecture(m, t)  # one more forward through the layers: 2N and a third of attention
        extra = (2 * (a.matmul_params - m.vocab * m.hidden) + 4 * a.layers * a.heads * a.head_dim * a.seq_len) / f
        out.append(Remedy("activation checkpointing", {"train.activation_checkpointing": True}, b.peak,
                          1 + extra, fits(b.peak, budget, margin), f"keep each layer's input only and recompute the layer in "
                          f"backward: one more forward through the layers, +{extra:.0%} FLOPs"))
    if not t.loss_chunk:
        chunk = min(1024, t.tokens)
        b = estimate(m, replace(t, loss_chunk=chunk))
        extra = 2 * m.hidden * m.vocab / max(f, 1)
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
    return out


def _accumulation(m: ModelShape, r: Recipe, t: TrainShape, budget: int, margin: float) -> list[Remedy]:
    """The largest smaller micro batch that fits (else 1), accumulated to the same tokens per step."""
    mb = r.train.micro_batch
    for smaller in sorted((d for d in range(1, mb) if mb % d == 0), reverse=True):
        b = estimate(m, replace(t, micro_batch=smaller))
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
    installed = importlib.util.find_spec("bitsandbytes") is not None  # not imported: planning stays torch-free
    return Remedy("8-bit optimizer state", {"optimizer.state_dtype": "int8"}, b.peak, 1.0, fits(b.peak, budget, margin),
                  f"AdamW moments in 8 bits (bitsandbytes' blockwise AdamW8bit): {_size(full.optimizer)} -> "
                  f"{_size(b.optimizer)}; same FLOPs, but on CPU the update is slower and dequantizes each "
                  f"tensor's moments to fp32 while it updates it, which can raise the peak where one tensor (a "
                  f"large embedding) dominates (bench/optimizer_state.py); training differs a little from fp32 "
                  f"moments; one process only"
                  + ("" if installed else "; needs the bitsandbytes package, which is not installed here"),
                  available=installed)


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _not_applicable(full: Breakdown, budget: int, margin: float) -> list[Remedy]:
    """The remedies ember cannot apply yet, listed with what they would save."""
    out = []
    n = 2  # the smallest sharding: what two devices would each hold
    sharded = full.peak - (full.weights + full.gradients + full.optimizer) * (n - 1) // n
    out.append(Remedy(f"FSDP across {n} devices", {}, sharded, 1.0, fits(sharded, budget, margin),
                      f"weights, gradients and optimizer state sharded {n} ways: "
                      f"{(full.weights + full.optimizer) / GiB:.2f} GiB -> "
                      f"{(full.weights + full.optimizer) / n / GiB:.2f} GiB per device, plus the "
                      f"gathers' traffic; needs {n} devices and distributed training, which ember does "
                      f"not do yet: remote compute", available=False))
    offload = full.peak - full.optimizer
    out.append(Remedy("CPU offload of the optimizer state", {}, offload, 1.0, fits(offload, budget, margin),
                      f"AdamW moments ({full.optimizer / GiB:.2f} GiB) in host memory, the update on the "
                      f"CPU: for accelerators only; ember does not do it yet", available=False))
    return out


def _combined(m: ModelShape, r: Recipe, single: list[Remedy], budget: int, margin: float) -> list[Remedy]:
    """When no single remedy fits: the available ones but LoRA added in order of cost until the
    estimate fits; that combination, or none."""
    combo: dict[str, Any] = {}
    factor = 1.0
    for rem in sorted((x for x in single if x.available and x.name != "LoRA instead of full fine-tuning"),
                      key=lambda x: x.flops_factor):
        combo.update(rem.changes)
        factor *= rem.flops_factor
        b = estimate(m, train_shape(r.with_changes(combo, "a combined remedy")))
        if fits(b.peak, budget, margin):
            return [Remedy("combined", dict(combo), b.peak, factor, True,
                           "cheapest first: " + " + ".join(
                               x.name for x in single if x.changes and set(x.changes) <= set(combo)))]
    return []
