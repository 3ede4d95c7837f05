"""`ember plan --fit MEM`: the fastest configuration of a recipe that fits a memory budget, by the
plan's own arithmetic (no formula of its own).

The search tries every combination of
    method                    methods(): every [method] kind the recipe takes (full, lora), and QLoRA
                              (lora over a 4-bit base) where bitsandbytes is installed and its
                              dequantization can be priced (the device's memory bandwidth, or a
                              CPU's measured dequantization rate: memory_bandwidth)
    LoRA rank                 half, the recipe's, double (methods with adapters)
    optimizer-state precision fp32, int8 (8-bit AdamW, where bitsandbytes is installed)
    activation checkpointing  off, on
    micro batch x accumulation every split of the recipe's micro_batch x grad_accum (held; past
                              2^40 rows, those with a side of at most 2^20: remedies.divisors)
    sequence length           the recipe's; with allow_seq also 1/2, 1/4, 1/8 of it (down to 16)
Each candidate's peak is ember.plan.memory.estimate over train_shape(the recipe with its changes),
and it fits by ember.plan.remedies.fits ([plan] memory_margin included), as `ember plan` decides;
its step time is the planner's estimate (estimated_seconds: FLOPs, with activation checkpointing's
recomputation, over the device's peak at [plan] assumed_mfu; QLoRA's 4-bit calls: each one's
fixed cost and its dequantization's bytes over that rate, ember.plan.planner.dequant_seconds; and
the recomputation's fixed cost per op on a CPU, ember.plan.recompute.recomputed_ops x Peak.per_op_s).

A family without formulas (traced_candidates) is searched the same way, each configuration's peak
and FLOPs from its step traced on fake tensors (ember.doctor.traced, cached), QLoRA's 4-bit calls
and their bytes counted in the same trace. A configuration is traced at micro batch 1 and 2 (accumulating) and at the
whole batch (not accumulating); the other micro batches are derived from the first two exactly
(peak_between), and int8 optimizer state from the same trace (its state's bytes differ, not its step).

Ranking: the longest sequence first (shorter ones only when nothing fits at a longer one), then
predicted seconds per token, then fewer settings changed, then the larger micro batch. The
planner predicts the same time for every split of the batch (same FLOPs), so each combination of
the other settings is listed once, with the largest micro batch that fits: larger matmuls run
more efficiently, which the estimate does not model. A memory saver (int8 state, activation
checkpointing) that buys no larger micro batch than the same configuration without it is left
out: it would only slow the step, or change the training, for nothing; so is QLoRA that buys no
larger micro batch than LoRA of the same rank and settings.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ember.errors import BadInput, EmberError, NothingToQuantize
from ember.hardware import Device, parse_size
from ember.metrics.peaks import Bandwidth, Peak, memory_bandwidth, select_peak, with_op_cost
from ember.models import check_against_model, config_fields
from ember.plan.dequant import dequantize_once
from ember.plan.memory import ModelShape, TrainShape, estimate
from ember.plan.planner import Traced, estimated_seconds, modelled_shape, planned_devices, priced_dequant
from ember.plan.remedies import bitsandbytes_installed, divisors, fits, size, step_flops, train_shape
from ember.recipe import MethodConfig, Recipe, get_dotted, load_recipe
from ember.paths import ascii_digits

TOP = 5             # the pick and the next four
MIN_SEQ = 16        # allow_seq halves the sequence down to this (or the recipe's, if shorter)
SEQ_HALVINGS = 3    # ... at most this many times


class NothingFits(EmberError):
    """No configuration the search tries fits the budget."""


def methods(qlora: bool = True) -> dict[str, dict[str, Any]]:
    """The methods the search tries, each as the recipe changes that select it: every kind
    [method] kind takes, over the base as it is, and (`qlora`) LoRA over a 4-bit NF4 base. Every
    one but 'full' trains adapters of a rank."""
    kinds = typing.get_args(typing.get_type_hints(MethodConfig)["kind"])
    found = {kind: {"method.kind": kind, "method.quantize": "none"} for kind in kinds}
    return {**found, "qlora": {"method.kind": "lora", "method.quantize": "nf4"}} if qlora else found


def qlora_searched(peak: Peak, bandwidth: Bandwidth | None) -> str | None:
    """Why QLoRA is left out of the search (None: it is searched): its time is FLOPs and the
    dequantization's bytes, so it needs bitsandbytes, the device's peak and its memory bandwidth."""
    if not bitsandbytes_installed():
        return "QLoRA not searched: the bitsandbytes package is not installed"
    if not peak.flops:
        return f"QLoRA not searched: its dequantization cannot be ranked without a step time ({peak.source})"
    if bandwidth is None or not bandwidth.bytes_per_s:
        why = bandwidth.source if bandwidth is not None else "no memory bandwidth"
        return f"QLoRA not searched: the time of its 4-bit dequantization is unknown ({why})"
    return None


@dataclass(frozen=True)
class Candidate:
    """One configuration: what it changes in the recipe, its predicted peak and step time."""
    changes: dict[str, Any]     # dotted recipe keys -> values, only those that differ from the recipe
    method: str
    rank: int | None            # None: no adapters
    state_dtype: str
    activation_checkpointing: bool
    micro_batch: int
    grad_accum: int
    seq_len: int
    peak: int                   # bytes at the step's peak (ember.plan.memory.estimate)
    with_margin: int            # peak x (1 + [plan] memory_margin), what must fit
    fits: bool
    step_seconds: float         # the planner's estimate; nan where the device's peak is unknown
    flops_per_token: float      # the step's FLOPs per token (what the time ranks by)

    def overrides(self) -> list[str]:
        """The changes as `--set` values (section.key=value) that `ember run`/`plan` read back."""
        return [f"{k}={_toml(v)}" for k, v in self.changes.items()]

    def describe(self) -> str:
        """The configuration in words."""
        method = self.method + (f" rank {self.rank}" if self.rank is not None else "")
        return (f"{method}, {self.state_dtype} optimizer state, activation checkpointing "
                f"{'on' if self.activation_checkpointing else 'off'}, micro batch {self.micro_batch} x accum "
                f"{self.grad_accum}, seq {self.seq_len}")


@dataclass
class Fit:
    budget: int
    budget_source: str
    margin: float
    searched: int                       # candidates estimated
    fitting: int                        # of them, how many fit
    best: list[Candidate]               # the fastest that fit, at most TOP, fastest first
    as_written: Candidate | None        # the recipe itself, for comparison
    space: dict[str, list[Any]]         # the values searched, per setting
    time_source: str                    # how the step time is predicted
    notes: list[str] = field(default_factory=list)
    applied: Path | None = None         # where the pick was written (--apply)


def _toml(v: Any) -> str:
    """A value as `--set` reads it back (ember.recipe.parse_override: TOML, else a plain string)."""
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def space(r: Recipe, allow_seq: bool = False, qlora: bool = False) -> dict[str, list[Any]]:
    """The values the search tries for each setting, for recipe `r` (`qlora`: QLoRA too)."""
    rank = r.method.rank
    seqs = [r.data.seq_len]
    while allow_seq and len(seqs) <= SEQ_HALVINGS and seqs[-1] // 2 >= min(MIN_SEQ, r.data.seq_len):
        seqs.append(seqs[-1] // 2)
    return {"method": list(methods(qlora)), "rank": sorted({max(1, rank // 2), rank, 2 * rank}),
            "state_dtype": ["fp32", "int8"] if bitsandbytes_installed() else ["fp32"],
            "activation_checkpointing": [False, True],
            "micro_batch": divisors(r.train.micro_batch * r.train.grad_accum), "seq_len": seqs}


def _changes(r: Recipe, method: str, rank: int | None, state: str, ac: bool, seq: int) -> dict[str, Any]:
    """The recipe changes of a combination (all but the batch split), only those that differ."""
    want = {**methods()[method], "method.rank": rank, "optimizer.state_dtype": state,
            "train.activation_checkpointing": ac, "data.seq_len": seq}
    have = r.to_dict()
    return {k: v for k, v in want.items() if v is not None and v != get_dotted(have, k)}


def candidates(r: Recipe, m: ModelShape, budget: int, peak: Peak, allow_seq: bool = False,
               bandwidth: Bandwidth | None = None) -> list[Candidate]:
    """Every configuration of the search space (module docstring) with its predicted peak and time."""
    s = space(r, allow_seq, qlora_searched(peak, bandwidth) is None)
    margin, effective = r.plan.memory_margin, r.train.micro_batch * r.train.grad_accum
    out = []
    for method in s["method"]:
        for rank in (s["rank"] if method != "full" else [None]):
            for state in s["state_dtype"]:
                for ac in s["activation_checkpointing"]:
                    for seq in s["seq_len"]:
                        changes = _changes(r, method, rank, state, ac, seq)
                        t = train_shape(r.with_changes(changes, "--fit"))  # the planner's own reading
                        per_token = step_flops(m, replace(t, micro_batch=1), 1) / t.seq_len
                        for mb in s["micro_batch"]:
                            accum = effective // mb
                            shape = replace(t, micro_batch=mb, accumulating=accum > 1)
                            seconds = estimated_seconds(m, shape, accum, peak, r.plan.assumed_mfu, bandwidth) \
                                if peak.flops else math.nan
                            out.append(_candidate(r, m, shape, changes, rank, accum, budget, margin, seconds,
                                                  per_token))
    return out


def peak_between(one: Traced, two: Traced, micro_batch: int) -> int | None:
    """The traced peak at `micro_batch` from the same step traced at micro batches 1 and 2: every
    tensor's size is affine in the micro batch, so is the bytes alive at each local high point of
    the step, and the peak is the highest of them. None where the two steps differ in their
    allocations (a chunked loss: its number of chunks grows with the batch)."""
    if not one.timeline or len(one.timeline) != len(two.timeline):
        return None
    correction = one.peak_bytes - max(one.timeline)  # the optimizer state's, the same at every batch
    return correction + max(a + (micro_batch - 1) * (b - a) for a, b in zip(one.timeline, two.timeline))


class _Traces:
    """The traced peaks of one configuration at every split of its batch: traced at micro batches
    1 and 2 (accumulating) and at the whole batch (not accumulating), the others derived
    (peak_between), or traced where they cannot be."""

    def __init__(self, r: Recipe, trace: Callable[[Recipe], Traced]):
        self.r, self.trace, self.steps = r, trace, 0
        self.effective = r.train.micro_batch * r.train.grad_accum

    def at(self, micro_batch: int) -> Traced:
        self.steps += 1
        return self.trace(self.r.with_changes({"train.micro_batch": micro_batch,
                                               "train.grad_accum": self.effective // micro_batch}, "--fit"))

    def peaks(self, micro_batches: list[int]) -> dict[int, tuple[int, Traced]]:
        """Each micro batch's peak and the trace it came from (its FLOPs and optimizer state)."""
        accumulating = [mb for mb in micro_batches if self.effective // mb >= 2]
        one = self.at(1)
        two = self.at(2) if 2 in accumulating else None
        out = {1: (one.peak_bytes, one)} | ({2: (two.peak_bytes, two)} if two else {})
        for mb in micro_batches:
            if mb in out:
                continue
            derived = peak_between(one, two, mb) if two is not None and mb in accumulating else None
            traced = one if derived is not None else self.at(mb)
            out[mb] = (derived if derived is not None else traced.peak_bytes, traced)
        return out


def traced_candidates(r: Recipe, trace: Callable[[Recipe], Traced], budget: int, peak: Peak,
                      allow_seq: bool = False, bandwidth: Bandwidth | None = None
                      ) -> tuple[list[Candidate], int, str | None]:
    """Every configuration of the search space with its traced peak and counted FLOPs (QLoRA: and
    its 4-bit calls counted, priced as the formulas' are), for a family without formulas; how
    many steps were traced; and why QLoRA was not searched, where the model has nothing to quantize."""
    s = space(r, allow_seq, qlora_searched(peak, bandwidth) is None)
    steps, out, skipped = 0, [], None
    for method in s["method"]:  # a model with nothing to quantize refuses QLoRA at its first trace
        try:
            found, traced = _traced_method(r, trace, budget, peak, bandwidth, s, method)
        except NothingToQuantize as e:
            skipped = f"QLoRA not searched: {e}"
            continue
        out += found
        steps += traced
    return out, steps, skipped


def _traced_method(r: Recipe, trace: Callable[[Recipe], Traced], budget: int, peak: Peak,
                   bandwidth: Bandwidth | None, s: dict[str, list[Any]], method: str) -> tuple[list[Candidate], int]:
    """traced_candidates for one method of the search space `s`."""
    margin, effective, steps, out = r.plan.memory_margin, r.train.micro_batch * r.train.grad_accum, 0, []
    for rank in (s["rank"] if method != "full" else [None]):
        for ac in s["activation_checkpointing"]:
            for seq in s["seq_len"]:
                changes = _changes(r, method, rank, "fp32", ac, seq)
                traces = _Traces(r.with_changes(changes, "--fit"), trace)
                for mb, (fp32, t) in traces.peaks(s["micro_batch"]).items():
                    accum, tokens = effective // mb, effective * seq
                    seconds = t.flops_per_token * tokens / (peak.flops * r.plan.assumed_mfu) \
                        + priced_dequant((t.dequant_calls, t.dequant_bytes), accum, bandwidth) \
                        if peak.flops else math.nan
                    split = {} if (mb, accum) == (r.train.micro_batch, r.train.grad_accum) else \
                        {"train.micro_batch": mb, "train.grad_accum": accum}
                    for state in s["state_dtype"]:
                        bytes_ = fp32 + (t.optimizer_int8 - t.optimizer if state == "int8" else 0)
                        more = {"optimizer.state_dtype": state} if state != r.optimizer.state_dtype else {}
                        out.append(Candidate({**_drop(changes, "optimizer.state_dtype"), **more, **split},
                                             method, rank, state, ac, mb, accum, seq, bytes_,
                                             int(bytes_ * (1 + margin)), fits(bytes_, budget, margin),
                                             seconds, t.flops_per_token))
                steps += traces.steps
    return out, steps


def _drop(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _candidate(r: Recipe, m: ModelShape, t: TrainShape, changes: dict[str, Any], rank: int | None, accum: int,
               budget: int, margin: float, seconds: float, per_token: float) -> Candidate:
    """One point of the search: the memory estimate for shape `t`, and the planner's time."""
    split = {} if (t.micro_batch, accum) == (r.train.micro_batch, r.train.grad_accum) else \
        {"train.micro_batch": t.micro_batch, "train.grad_accum": accum}
    b = estimate(m, t)
    method = "qlora" if t.quantize == "nf4" else changes.get("method.kind", r.method.kind)
    return Candidate({**changes, **split}, method, rank, changes.get("optimizer.state_dtype", r.optimizer.state_dtype),
                     t.activation_checkpointing, t.micro_batch, accum, t.seq_len, b.peak, b.with_margin(margin),
                     fits(b.peak, budget, margin), seconds, per_token)


def _knobs(c: Candidate) -> int:
    """Settings a candidate changes, a batch split counting once."""
    return len(set(c.changes) - {"train.grad_accum"})


def _order(c: Candidate) -> tuple:
    # seconds per token (the effective batch is held), to 9 digits: splits of one batch that tie
    # in exact arithmetic tie here too, and fall to the next keys
    per_token = float(f"{c.step_seconds / (c.micro_batch * c.grad_accum):.9g}") if c.step_seconds == c.step_seconds \
        else 0.0
    return -c.seq_len, per_token, c.flops_per_token, _knobs(c), -c.micro_batch


def _buys_nothing(c: Candidate, kept: dict[tuple, Candidate]) -> bool:
    """`c` turns on a memory saver (int8 state, activation checkpointing, a 4-bit base) that buys no
    larger micro batch: the same configuration without it fits a micro batch as large, as fast or faster."""
    def key(x: Candidate, state: str, ac: bool, method: str | None = None) -> tuple:
        return method or x.method, x.rank, state, ac, x.seq_len
    without = [key(c, "fp32", c.activation_checkpointing) if c.state_dtype != "fp32" else None,
               key(c, c.state_dtype, False) if c.activation_checkpointing else None,
               key(c, c.state_dtype, c.activation_checkpointing, "lora") if c.method == "qlora" else None]
    return any(k in kept and kept[k].micro_batch >= c.micro_batch for k in without if k is not None)


def rank_fitting(found: list[Candidate]) -> list[Candidate]:
    """The candidates that fit, each combination once (its largest micro batch), fastest first,
    without the memory savers that buy nothing."""
    best: dict[tuple, Candidate] = {}
    for c in (c for c in found if c.fits):
        key = (c.method, c.rank, c.state_dtype, c.activation_checkpointing, c.seq_len)
        if key not in best or c.micro_batch > best[key].micro_batch:
            best[key] = c
    return sorted((c for c in best.values() if not _buys_nothing(c, best)), key=_order)


def search(r: Recipe, m: ModelShape | None, budget: int, peak: Peak, allow_seq: bool = False,
           budget_source: str = "", bandwidth: Bandwidth | None = None,
           trace: Callable[[Recipe], Traced] | None = None) -> Fit:
    """The fastest configurations of recipe `r` that fit `budget` bytes (module docstring);
    NothingFits, with the smallest peak found and what to try, when none does. `m` None: a family
    without formulas, each configuration's step traced by `trace`."""
    left_out = qlora_searched(peak, bandwidth)
    if m is None:
        found, steps, skipped = traced_candidates(r, trace, budget, peak, allow_seq, bandwidth)
        left_out = left_out or skipped
    else:
        found, steps = candidates(r, m, budget, peak, allow_seq, bandwidth), 0
    ranked = rank_fitting(found)
    margin = r.plan.memory_margin
    where = f"{size(budget)}" + (f" ({budget_source})" if budget_source else "")
    if not ranked:
        low = min(found, key=lambda c: c.peak)
        tries = ["a budget of at least " + size(low.with_margin)]
        if not allow_seq:
            tries.append("--fit-seq to allow shorter sequences")
        if "int8" not in space(r)["state_dtype"]:
            tries.append("installing bitsandbytes (8-bit optimizer state, QLoRA)")
        elif left_out is not None:
            tries.append("[cost] memory_gbps (the device's memory bandwidth: QLoRA is searched with it)")
        tries.append("sharding over devices (`ember plan RECIPE` lists the FSDP remedy) or a smaller model")
        raise NothingFits(
            f"--fit: nothing fits {where}: the smallest predicted peak of the {len(found)} configurations "
            f"searched is {size(low.peak)} ({size(low.with_margin)} with the {margin:.0%} [plan] memory_margin), "
            f"for {low.describe()}; try {', '.join(tries)}")
    how = (f"FLOPs (with activation checkpointing's recomputation{', counted on the traced step' if steps else ''}) "
           f"over {peak.source} at [plan] assumed_mfu {r.plan.assumed_mfu:.0%}" if peak.flops
           else f"unknown ({peak.source}): ranked by FLOPs per token")
    how += f"; activation checkpointing's recomputed ops: {peak.per_op_s * 1e6:.1f} µs each" if peak.per_op_s else ""
    if left_out is None:
        fixed = f"{bandwidth.per_call_s * 1e6:,.1f} µs a call and " if bandwidth.per_call_s else ""
        how += (f"; QLoRA's 4-bit calls: {fixed}their bytes over {bandwidth.bytes_per_s / 1e9:.4g} GB/s "
                f"({bandwidth.source})")
    notes = [] if "int8" in space(r)["state_dtype"] else \
        ["int8 optimizer state not searched: the bitsandbytes package is not installed"]
    notes += [left_out] if left_out is not None else []
    if steps:
        notes.append(f"memory traced on the model's module graph (fake tensors): {steps} steps traced (cached in "
                     f"$EMBER_HOME/cache/traced), each configuration at micro batch 1, 2 and the whole batch; the "
                     f"other micro batches derived from the first two exactly (each tensor's size is affine in the "
                     f"micro batch), or traced where the steps differ")
    as_written = next((c for c in found if not c.changes), None)  # None: int8 or QLoRA not searched
    return Fit(budget, where, margin, len(found), sum(c.fits for c in found), ranked[:TOP], as_written,
               space(r, allow_seq, left_out is None), how, notes)


@dataclass
class FitRequest:
    recipe_file: Path
    overrides: list[str] = field(default_factory=list)
    budget: str = "device"              # a size ("8GiB"), or "device": the device's free memory
    allow_seq: bool = False
    device_memory_gib: float | None = None
    apply: Path | None = None           # write the recipe with the pick applied


def budget_bytes(text: str, devices: list[Device]) -> tuple[int, str]:
    """`--fit`'s value in bytes, and where it came from: a size with its unit, or 'device'."""
    if text == "device":
        d = devices[0]
        return d.free, f"free memory of {d.name}"
    number = text.strip().replace(".", "", 1)
    if ascii_digits(number):  # not '²': a unit after it is no size either
        raise BadInput(f"--fit {text}: give a unit, e.g. --fit {text}GiB, or --fit device")
    n = parse_size(text, f"--fit {text}")
    if n <= 0:
        raise BadInput(f"--fit {text}: must be more than 0 bytes")
    return n, f"--fit {text}"


def fit_recipe(req: FitRequest, warn: Callable[[str], None] | None = None,
               trace: Callable[[Recipe], Traced] | None = None) -> Fit:
    """`ember plan RECIPE --fit`: load the recipe, find its model's shape and the device, search;
    a family without formulas by its steps traced with `trace` (ember.doctor.traced.traced_step)."""
    r = load_recipe(req.recipe_file, req.overrides, warn)
    devices = planned_devices(r, req.device_memory_gib)
    budget, source = budget_bytes(req.budget, devices)
    cfg = config_fields(r.model.path)
    for changes in methods().values():  # what `ember run` would refuse of each method, refused here
        check_against_model(r.data.seq_len, r.with_changes(changes, "--fit").method, cfg)
    try:
        m: ModelShape | None = modelled_shape(cfg, r.method)
    except ValueError as e:
        if trace is None:
            raise EmberError(f"--fit: {e}, and no tracer was given to plan its steps") from None
        m = None
    d = devices[0]
    peak = select_peak(r.cost.peak_tflops, d.kind, d.name, r.precision.mode, r.train.threads)
    if m is not None:  # the recomputed ops' fixed cost
        peak = with_op_cost(peak, d.kind, r.train.threads, bool(r.cost.peak_tflops))
    bandwidth = memory_bandwidth(r.cost.memory_gbps, d.kind, d.name, r.train.threads, dequantize_once) \
        if bitsandbytes_installed() else None  # a CPU measures its rate (cached), for QLoRA's time
    result = search(r, m, budget, peak, req.allow_seq, source, bandwidth, trace)
    if req.apply is not None:
        req.apply.write_text(r.with_changes(result.best[0].changes, "--fit").to_toml())
        result.applied = req.apply
    return result
