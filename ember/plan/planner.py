"""`ember plan`: will it fit, what makes it fit, how long, what cost, how often to checkpoint,
and should it run here at all. Everything but device detection and the optional measurement
(a `Calibration`, taken by ember.doctor.measure) is arithmetic over the recipe and the model's
config; the rules are in docs/boundary.md."""

from __future__ import annotations

import math
import socket
import sqlite3
from dataclasses import asdict, dataclass, field
from typing import Any

from ember.ckpt.interval import Interval, recommend
from ember.errors import EmberError
from ember.hardware import Device, for_run, host_device
from ember.ledger import history
from ember.metrics.cost import Cost, cost
from ember.metrics.flops import flops_per_token, mfu
from ember.metrics.peaks import Bandwidth, Peak, memory_bandwidth, select_peak, with_op_cost
from ember.metrics.report import prices_from
from ember.models import check_against_model, config_fields
from ember.plan.advisor import Advice
from ember.plan.dequant import dequant_bytes, dequantize_once, quantized_calls
from ember.plan.memory import F32, LINEARS, GiB, ModelShape, TrainShape, estimate, optimizer_bytes, trainable_params
from ember.plan.recompute import recomputed_ops
from ember.plan.remedies import Remedy, architecture, fits, recompute_flops, remedies, step_flops, train_shape
from ember.recipe import MethodConfig, Recipe

# Bandwidths for the checkpoint cost when the ledger has no checkpoint of this machine yet
# (measured on the 2-core development VM, bench/async_checkpoint.py: snapshot 15 GB/s, durable 0.7 GB/s).
SNAPSHOT_BYTES_PER_S = 10e9
DURABLE_BYTES_PER_S = 0.5e9
STARTUP_SECONDS = 5.0


GGUF_NOT_MODELLED = ("[method] quantize = 'gguf': the formulas know an NF4 base, not a GGUF file's blocks "
                     "(their dequantization is not priced in the step's time)")


def unmodelled_targets(method: MethodConfig) -> str | None:
    """Why the formulas cannot estimate LoRA on `method`'s target modules (None: they can): they
    know adapters on the decoder layers' linears, named as such, not on other modules (lm_head,
    embed_tokens, a norm), which peft may adapt or refuse."""
    if method.kind != "lora" or method.target_modules == ["all-linear"]:
        return None
    if set(method.target_modules) <= set(LINEARS):
        return None
    return (f"[method] target_modules = {method.target_modules!r}: the formulas know LoRA adapters on the decoder "
            f"layers' linears ({', '.join(LINEARS)}), not on the others")


def modelled_shape(config: Any, method: MethodConfig) -> ModelShape:
    """The model's shape for the formulas, or ValueError saying why they cannot estimate the run:
    a family without formulas (ModelShape.from_config), or LoRA on modules they do not know."""
    m = ModelShape.from_config(config)
    if why := unmodelled_targets(method):
        raise ValueError(why)
    return m


class UnknownArchitecture(EmberError):
    """The estimator has no formula for this model: trace its step (ember.doctor.traced) or
    measure it (calibration)."""


@dataclass(frozen=True)
class Traced:
    """A step counted on the model's own module graph with fake tensors (ember.doctor.traced):
    the peak of its second step and its parts, FLOPs per token of a forward and backward."""
    peak_bytes: int
    weights: int
    gradients: int
    optimizer: int
    flops_per_token: float
    params: int
    trainable: int
    family: str
    # the bytes alive at each local high point of the second step, before the optimizer state's
    # correction (peak_bytes - max(timeline)): two traces that differ only in the micro batch
    # give every other micro batch's peak (ember.plan.fit.peak_between)
    timeline: tuple[int, ...] = ()
    optimizer_int8: int = 0  # the optimizer state's bytes were it 8-bit: the same step, another state
    # QLoRA: a micro-batch's calls into 4-bit linears (forward, recomputed forward, backward) and
    # the bytes they move, each priced as one dequantization of its weight (ember.plan.dequant)
    dequant_calls: int = 0
    dequant_bytes: int = 0


@dataclass(frozen=True)
class Calibration:
    """Measured on this machine: a micro-batch's step time and the step's peak memory."""
    step_seconds: float
    peak_bytes: int


@dataclass
class PlanRecipe:
    model: str
    method: str
    micro_batch: int
    seq_len: int
    grad_accum: int
    precision: str
    activation_checkpointing: bool
    loss_chunk: int
    max_steps: int
    optimizer_state: str = "fp32"  # [optimizer] state_dtype
    quantize: str = "none"  # [method] quantize: 'nf4' stores the base's linears in 4 bits (QLoRA)


@dataclass
class ModelInfo:
    shape: ModelShape | None  # None: a family without formulas, planned from its traced step
    params: int
    trainable: int
    family: str = ""


@dataclass
class Memory:
    peak: int              # estimated (or, for an unknown architecture, measured) peak of a step
    phase: str             # where in the step the peak falls
    margin: float
    with_margin: int
    weights: int | None = None
    gradients: int | None = None
    optimizer: int | None = None
    activations: int | None = None
    loss_buffers: int | None = None
    temporaries: int | None = None
    phases: dict[str, int] = field(default_factory=dict)
    measured_peak: int | None = None
    error: float | None = None   # estimate / measured - 1


@dataclass
class PlanTime:
    step_seconds: float
    how: str
    steps: int
    compute_seconds: float
    wall_seconds: float
    tokens: int
    mfu: float | None      # the MFU the time assumes, or the one the measured steps achieved


@dataclass
class CheckpointPlan:
    bytes: int
    delta_seconds: float
    delta_source: str
    mtbf_seconds: float
    mtbf_source: str
    interval: Interval
    asynchronous: bool

    @property
    def seconds(self) -> float:
        return self.interval.seconds


@dataclass
class Plan:
    recipe: PlanRecipe
    devices: list[Device]
    model: ModelInfo | None
    memory: Memory
    fits: bool
    remedies: list[Remedy]
    time: PlanTime
    cost: Cost
    checkpoint: CheckpointPlan
    verdict: str
    reasons: list[str]
    notes: list[str] = field(default_factory=list)
    parallel: Advice | None = None  # the parallelism advice, when the interconnect was measured

    def to_dict(self) -> dict:
        d = asdict(self)
        d["checkpoint"].update(d["checkpoint"].pop("interval"))  # flat, as `ember plan --json` has it
        return d


@dataclass(frozen=True)
class MemoryPlan:
    """The memory part of a plan alone: what a launcher checks before anything is built."""
    model: ModelShape | None
    memory: Memory
    fits: bool
    remedies: list
    devices: list[Device]
    notes: list[str]


def planned_devices(r: Recipe, device_memory_gib: float | None = None) -> list[Device]:
    """The devices recipe `r` would run on (ember.hardware.for_run), each capped at
    `device_memory_gib` GiB free when given (`--device-memory`: another machine, or a cap)."""
    devices = for_run(r.train.device)
    if device_memory_gib is None:
        return devices
    if not 0 < device_memory_gib < math.inf:  # nan too: it compares false with everything
        raise EmberError(f"--device-memory {device_memory_gib:g}: must be a finite number of GiB > 0")
    return [d.capped(int(device_memory_gib * GiB)) for d in devices]


def has_formulas(r: Recipe) -> bool:
    """Whether the memory estimate has formulas for the recipe's model family and method (else
    its step is traced: ember.doctor.traced)."""
    if r.method.quantize == "gguf" or unmodelled_targets(r.method):
        return False
    try:
        ModelShape.from_config(config_fields(r.model.path))
    except ValueError:
        return False
    return True


def plan_memory(r: Recipe, calibration: Calibration | None = None,
                devices: list[Device] | None = None, traced: Traced | None = None) -> MemoryPlan:
    """The estimated peak per device for recipe `r`, whether it fits, and the remedies; from the
    model's config alone, torch-free (no speed estimate: that may measure this CPU's peak); for a
    family without formulas, from its traced step."""
    notes: list[str] = []
    cfg = config_fields(r.model.path)  # plain fields: planning stays torch-free
    check_against_model(r.data.seq_len, r.method, cfg)  # what `ember run` would refuse, refused here
    devices = devices or for_run(r.train.device)
    try:
        m = ModelShape.from_config(cfg)
        if r.method.quantize == "gguf":
            raise ValueError(GGUF_NOT_MODELLED)
        if why := unmodelled_targets(r.method):
            raise ValueError(why)
    except ValueError as e:
        if calibration is None and traced is None:
            raise UnknownArchitecture(str(e)) from None
        m = None
        notes.append(f"{e}: the memory figure is " + ("traced on the model's module graph (fake tensors)"
                                                      if traced else "measured (calibration), not estimated"))
    memory = _memory(m, train_shape(r), calibration, r.plan.memory_margin, traced)
    free = devices[0].free
    rems = remedies(m, r, devices, r.plan.memory_margin) if m is not None else []
    return MemoryPlan(m, memory, fits(memory.peak, free, r.plan.memory_margin), rems, devices, notes)


def make_plan(r: Recipe, con: sqlite3.Connection | None = None, calibration: Calibration | None = None,
              devices: list[Device] | None = None, traced: Traced | None = None) -> Plan:
    """The whole plan for recipe `r`, from its model's config (and a measurement or a traced
    step, if given)."""
    mp = plan_memory(r, calibration, devices, traced)
    m, memory, fits_here, rems, devices, notes = mp.model, mp.memory, mp.fits, mp.remedies, mp.devices, mp.notes
    dev = devices[0]
    t = train_shape(r)
    time_ = _time(r, m, t, dev, calibration, traced)

    # Checkpoint interval (Young/Daly) from the checkpoint's size and this machine's history.
    host = socket.gethostname()
    ck_bytes = (_checkpoint_bytes(m, t) if m is not None else
                traced.trainable * F32 + traced.optimizer if traced is not None else memory.peak // 3)
    measured = history.checkpoint_rates(con, host)
    if measured:
        snap_rate, durable_rate, n = measured
        rate_src = f"median of {n} checkpoints of this machine in the ledger"
    else:
        snap_rate, durable_rate = SNAPSHOT_BYTES_PER_S, DURABLE_BYTES_PER_S
        rate_src = (f"assumed {SNAPSHOT_BYTES_PER_S / 1e9:g} GB/s snapshot, {DURABLE_BYTES_PER_S / 1e9:g} GB/s "
                    f"durable (no checkpoint of this machine in the ledger)")
    delta = ck_bytes / (snap_rate if r.checkpoint.async_ else durable_rate)
    mtbf, mtbf_src = history.mtbf_seconds(r.checkpoint.interruption_hours, con, host)
    iv = recommend(delta, mtbf, restart=STARTUP_SECONDS)
    time_.wall_seconds = STARTUP_SECONDS + time_.compute_seconds / max(1e-9, 1 - iv.checkpoint_share - iv.lost_share)
    prices = prices_from(asdict(r.cost), len(devices) if dev.accelerator else 1)
    c = cost(prices, time_.wall_seconds, time_.tokens)

    verdict, reasons = _verdict(fits_here, rems, time_.wall_seconds, r, devices)
    return Plan(
        recipe=PlanRecipe(r.model.path, r.method.kind, r.train.micro_batch, r.data.seq_len, r.train.grad_accum,
                          r.precision.mode, r.train.activation_checkpointing, r.train.loss_chunk, r.train.max_steps,
                          r.optimizer.state_dtype, r.method.quantize),
        devices=devices + ([host_device()] if dev.accelerator else []),
        model=(ModelInfo(m, m.params(), trainable_params(m, t)) if m else
               ModelInfo(None, traced.params, traced.trainable, traced.family) if traced else None),
        memory=memory, fits=fits_here, remedies=rems, time=time_, cost=c,
        checkpoint=CheckpointPlan(ck_bytes, delta, rate_src, mtbf, mtbf_src, iv, r.checkpoint.async_),
        verdict=verdict, reasons=reasons, notes=notes)


def _memory(m: ModelShape | None, t: TrainShape, calibration: Calibration | None, margin: float,
            traced: Traced | None = None) -> Memory:
    """The estimated peak and its parts (or, for an architecture not modelled, the traced step's,
    else the measured peak)."""
    if m is not None:
        b = estimate(m, t)
        out = Memory(b.peak, b.phase, margin, b.with_margin(margin), b.weights, b.gradients, b.optimizer,
                     b.activations, b.loss_buffers, b.temporaries, b.phases)
    elif traced is not None:
        x = traced
        out = Memory(x.peak_bytes, "the traced step's high point", margin, int(x.peak_bytes * (1 + margin)),
                     x.weights, x.gradients, x.optimizer)
    else:
        peak = int(calibration.peak_bytes)
        out = Memory(peak, "measured", margin, int(peak * (1 + margin)))
    if calibration is not None:
        out.measured_peak = int(calibration.peak_bytes)
        out.error = out.peak / calibration.peak_bytes - 1
    return out


def _time(r: Recipe, m: ModelShape | None, t: TrainShape, dev: Device, calibration: Calibration | None,
          traced: Traced | None = None) -> PlanTime:
    """Compute time: measured steps, else FLOPs over the device's peak at an assumed MFU."""
    tokens_per_step = r.train.micro_batch * r.data.seq_len * r.train.grad_accum
    arch = architecture(m, t) if m is not None else None
    fpt = flops_per_token(arch) if arch is not None else None
    if fpt is None and traced is not None:
        fpt = CountedFlops(traced.flops_per_token)
    peak = select_peak(r.cost.peak_tflops, dev.kind, dev.name, r.precision.mode, r.train.threads)
    if calibration is not None:
        step_s = calibration.step_seconds * r.train.grad_accum
        how = f"measured: {calibration.step_seconds:.4g} s per micro-batch (calibration)"
        achieved = mfu(tokens_per_step / step_s, fpt.total, peak.flops) if fpt else None
    elif fpt is not None and peak.flops:
        achieved = r.plan.assumed_mfu
        bandwidth = memory_bandwidth(r.cost.memory_gbps, dev.kind, dev.name, r.train.threads, dequantize_once) \
            if t.quantize == "nf4" else None  # a CPU measures its rate: only where there is something to price
        if m is not None:
            if t.activation_checkpointing:
                peak = with_op_cost(peak, dev.kind, r.train.threads, bool(r.cost.peak_tflops))
            step_s = estimated_seconds(m, t, r.train.grad_accum, peak, achieved, bandwidth)
            extra = recompute_flops(m, t)
        else:  # the traced count has the recomputation in it (its backward ran it), and its 4-bit calls
            step_s, extra = fpt.total * tokens_per_step / (peak.flops * achieved), 0
            step_s += priced_dequant(_traced_dequant(traced), r.train.grad_accum, bandwidth)
        again = f" + {extra:.3g} recomputed" if extra else ""
        how = (f"({fpt.formula} = {fpt.total:.3g}{again}) FLOPs/token x {tokens_per_step} tokens / "
               f"({peak.flops / 1e12:.3g} TFLOP/s peak, {peak.source}, x assumed MFU {achieved:.0%})"
               + (_dequant_how(dequant_counts(m, t) if m is not None else _traced_dequant(traced),
                               r.train.grad_accum, bandwidth) if bandwidth is not None else "")
               + (f" + {recomputed_ops(m, t) * r.train.grad_accum:,.0f} recomputed ops x "
                  f"{peak.per_op_s * 1e6:.1f} µs" if m is not None and peak.per_op_s and extra else ""))
    else:
        step_s, achieved = float("nan"), None
        how = f"unknown: {peak.source}" if fpt is not None else "unknown"
    return PlanTime(step_s, how, r.train.max_steps, step_s * r.train.max_steps, float("nan"),
                    tokens_per_step * r.train.max_steps, achieved)


def _traced_dequant(traced: Traced | None) -> tuple[int, int] | None:
    return (traced.dequant_calls, traced.dequant_bytes) if traced is not None and traced.dequant_calls else None


def _dequant_how(counts: tuple[int, int] | None, grad_accum: int, bandwidth: Bandwidth) -> str:
    """The 4-bit dequantization's part of the time, in words (`counts`: dequant_counts)."""
    if counts is None or not bandwidth.bytes_per_s:
        return f"; 4-bit dequantization not priced ({bandwidth.source if counts is not None else 'no 4-bit call counted'})"
    calls, moved = counts
    fixed = f"{calls * grad_accum} 4-bit calls x {bandwidth.per_call_s * 1e6:,.1f} µs + " if bandwidth.per_call_s else ""
    return (f" + {fixed}{moved * grad_accum / 1e6:.4g} MB of 4-bit dequantization / "
            f"({bandwidth.bytes_per_s / 1e9:.4g} GB/s, {bandwidth.source})")


@dataclass(frozen=True)
class CountedFlops:
    """FLOPs per token counted on the traced step (torch's FlopCounterMode), not by formula."""
    total: float
    formula: str = "counted on the model's module graph"


def estimated_seconds(m: ModelShape, t: TrainShape, grad_accum: int, peak: Peak, assumed_mfu: float,
                      bandwidth: Bandwidth | None = None) -> float:
    """The optimizer step's time without measuring: its FLOPs over the peak at the assumed MFU,
    and (QLoRA) its 4-bit calls' fixed cost and bytes over the memory bandwidth, where known, and
    (activation checkpointing) each recomputed op's fixed cost (Peak.per_op_s)."""
    return step_flops(m, t, grad_accum) / (peak.flops * assumed_mfu) + dequant_seconds(m, t, grad_accum, bandwidth) \
        + grad_accum * recomputed_ops(m, t) * peak.per_op_s


def dequant_seconds(m: ModelShape, t: TrainShape, grad_accum: int, bandwidth: Bandwidth | None) -> float:
    """Seconds an optimizer step spends in its 4-bit linears beyond plain ones (priced_dequant of
    the formulas' counts)."""
    return priced_dequant(dequant_counts(m, t), grad_accum, bandwidth)


def dequant_counts(m: ModelShape, t: TrainShape) -> tuple[int, int]:
    """A micro-batch's 4-bit calls and the bytes they move, by the formulas (ember.plan.dequant)."""
    return sum(c for _, c in quantized_calls(m, t)), dequant_bytes(m, t)


def priced_dequant(counts: tuple[int, int] | None, grad_accum: int, bandwidth: Bandwidth | None) -> float:
    """Seconds of a step's 4-bit calls from a micro-batch's (calls, bytes): each call's fixed cost
    and the bytes over the rate (0 where there are none or the rate is unknown: the time says so,
    see _time)."""
    if counts is None or bandwidth is None or not bandwidth.bytes_per_s:
        return 0.0
    calls, moved = counts
    return grad_accum * (calls * bandwidth.per_call_s + moved / bandwidth.bytes_per_s)


def _checkpoint_bytes(m: ModelShape, t: TrainShape) -> int:
    """Model weights (all of them, or the adapters) and AdamW's two moments."""
    return (trainable_params(m, t) if t.lora else m.params()) * F32 + optimizer_bytes(m, t)


def _verdict(fits_here: bool, rems: list[Remedy], wall: float, r: Recipe, devices: list[Device]) -> tuple[str, list[str]]:
    """local, local with remedies, or remote, with the reasons (docs/boundary.md)."""
    reasons = []
    limit = r.plan.local_max_hours * 3600
    usable = [x for x in rems if x.fits and x.available]
    if not fits_here and not usable:
        reasons.append("does not fit this machine's memory even with every remedy ember can apply "
                       "here; needs sharding across more devices (FSDP) or larger devices")
    if math.isfinite(wall) and wall > limit:
        reasons.append(f"predicted wall-clock {wall / 3600:.1f} h is beyond [plan] local_max_hours = "
                       f"{r.plan.local_max_hours:g}")
    if reasons:
        return "remote", reasons
    if not fits_here:
        best = usable[0]
        return "local with remedies", [f"does not fit as written; {best.name} makes it fit "
                                       f"({best.peak / GiB:.2f} GiB peak)"]
    if not math.isfinite(wall):
        return "local", [f"fits in {devices[0].name}; how long it takes is unknown (set [cost] peak_tflops, "
                         f"the device's peak TFLOP/s, or plan with --calibrate to measure a few steps)"]
    return "local", [f"fits in {devices[0].name} and takes about {wall / 3600:.2g} h, within "
                     f"[plan] local_max_hours = {r.plan.local_max_hours:g}"]
