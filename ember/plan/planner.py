"""`ember plan`: will it fit, what makes it fit, how long, what cost, how often to checkpoint,
and should it run here at all. Everything but device detection and the optional calibration is
arithmetic over the recipe and the model's config (the rules are in docs/boundary.md)."""

from __future__ import annotations

import math
import os
import socket
import sqlite3
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ember.errors import EmberError
from ember.metrics.flops import Architecture, flops_per_token
from ember.metrics.peaks import Peak, lookup_peak, measured_cpu_peak
from ember.plan.interval import mtbf_seconds, recommend
from ember.plan.memory import (
    F32,
    LINEARS,
    GiB,
    ModelShape,
    TrainShape,
    estimate,
    trainable_params,
)
from ember.recipe import Recipe

# Bandwidths for the checkpoint cost when the ledger has no checkpoint of this machine yet
# (measured on the 2-core development VM, bench/async_checkpoint.py: snapshot 15 GB/s, durable 0.7 GB/s).
SNAPSHOT_BYTES_PER_S = 10e9
DURABLE_BYTES_PER_S = 0.5e9
STARTUP_SECONDS = 5.0


class UnknownArchitecture(EmberError):
    """The estimator has no formula for this model: measure instead (calibration)."""


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cpu" or an accelerator type
    total: int
    free: int


def detect_devices(requested: str) -> list[Device]:
    """The devices a run of this recipe would use: each accelerator's memory, or host RAM."""
    want = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EmberError(f"[train] device = {requested!r}: no CUDA device on this machine")
        first = int(want.split(":")[1]) if ":" in want else 0  # the device the run would use first
        order = [first] + [i for i in range(torch.cuda.device_count()) if i != first]
        out = []
        for i in order:
            free, total = torch.cuda.mem_get_info(i)
            out.append(Device(f"{torch.cuda.get_device_name(i)} (cuda:{i})", "cuda", total, free))
        return out
    return [host_memory()]


def host_memory() -> Device:
    """Host RAM: total, and available (MemAvailable) to a new process."""
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    kib = {k: int(v.split()[0]) * 1024 for k, v in info.items() if k in ("MemTotal", "MemAvailable")}
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "CPU")
    return Device(f"host RAM ({model}, {os.cpu_count()} cores)", "cpu", kib["MemTotal"], kib["MemAvailable"])


def replace_memory(devices: list[Device], free: int) -> list[Device]:
    """The same devices with `free` bytes each (planning for another machine, or a cap)."""
    return [Device(f"{d.name} (capped at {free / GiB:.3g} GiB)", d.kind, free, free) for d in devices]


def model_config(recipe: Recipe) -> Any:
    """The model's transformers config, without loading its weights."""
    from ember.paths import cached_sha256
    from ember.train.model import convert_gguf, resolve_path, tiny_config
    spec = recipe.model.path
    if spec == "builtin:tiny":
        return tiny_config()
    path = resolve_path(spec)
    if path.is_file() and path.suffix == ".gguf":
        path = convert_gguf(path, cached_sha256(path))
    if not (path / "config.json").is_file():
        raise EmberError(f"[model] path = {spec!r}: no config.json in {path}; the plan needs the "
                         f"model's architecture (a Hugging Face model folder or a .gguf file)")
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise EmberError(f"[model] path = {spec!r}: transformers cannot read its config: {e}") from None


def train_shape(r: Recipe) -> TrainShape:
    targets = set(LINEARS) if r.method.target_modules == ["all-linear"] else set(r.method.target_modules)
    return TrainShape(r.train.micro_batch, r.data.seq_len, lora=r.method.kind == "lora",
                      lora_rank=r.method.rank, lora_targets=frozenset(targets & set(LINEARS)),
                      lora_dropout=r.method.dropout, activation_checkpointing=r.train.activation_checkpointing,
                      autocast=r.precision.mode != "fp32", loss_chunk=r.train.loss_chunk)


def architecture(m: ModelShape, t: TrainShape) -> Architecture:
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


def apply_changes(r: Recipe, changes: dict[str, Any]) -> Recipe:
    sections = {}
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        sections.setdefault(section, {})[key] = value
    return replace(r, **{s: replace(getattr(r, s), **{("async_" if k == "async" else k): v
                                                       for k, v in kv.items()})
                         for s, kv in sections.items()})


def remedies(m: ModelShape, r: Recipe, budget: int, margin: float) -> list[Remedy]:
    """Each remedy alone, then the cheapest combination that fits; ranked by compute cost."""
    t = train_shape(r)
    f = flops_per_token(architecture(m, t)).total

    out: list[Remedy] = []
    mb = r.train.micro_batch
    for smaller in sorted((d for d in range(1, mb) if mb % d == 0), reverse=True):
        b = estimate(m, replace(t, micro_batch=smaller))
        if fits(b.peak, budget, margin) or smaller == 1:
            out.append(Remedy("gradient accumulation", {"train.micro_batch": smaller,
                                                        "train.grad_accum": r.train.grad_accum * mb // smaller},
                              b.peak, 1.0, fits(b.peak, budget, margin),
                              f"micro batch {mb} -> {smaller} x {mb // smaller} accumulated: same tokens per "
                              f"optimizer step and FLOPs; activations and loss buffers shrink {mb // smaller}x; "
                              f"smaller matmuls may run less efficiently (measure with `ember doctor`)"))
            break
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
    full = estimate(m, t)
    opt8 = full.peak - full.optimizer + full.optimizer // 4
    out.append(Remedy("8-bit optimizer state", {}, opt8, 1.0, fits(opt8, budget, margin),
                      f"AdamW moments in 8 bits: {full.optimizer / GiB:.2f} GiB -> "
                      f"{full.optimizer / 4 / GiB:.2f} GiB; needs bitsandbytes, which ember does not use yet",
                      available=False))
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
    if any(x.fits and x.available for x in out):
        return sorted(out, key=lambda x: (not x.fits, not x.available, x.flops_factor))
    # No single remedy fits: add them in order of cost until the estimate fits.
    combo: dict[str, Any] = {}
    factor = 1.0
    for rem in sorted((x for x in out if x.available and x.name != "LoRA instead of full fine-tuning"),
                      key=lambda x: x.flops_factor):
        combo.update(rem.changes)
        factor *= rem.flops_factor
        b = estimate(m, train_shape(apply_changes(r, combo)))
        if fits(b.peak, budget, margin):
            out.append(Remedy("combined", dict(combo), b.peak, factor, True,
                              "cheapest first: " + " + ".join(
                                  x.name for x in out if x.changes and set(x.changes) <= set(combo))))
            break
    order = sorted(out, key=lambda x: (not x.fits, not x.available, x.flops_factor))
    return order


@dataclass
class Plan:
    recipe: dict[str, Any]
    devices: list[dict[str, Any]]
    model: dict[str, Any]
    memory: dict[str, Any]
    fits: bool
    remedies: list[dict[str, Any]]
    time: dict[str, Any]
    cost: dict[str, Any]
    checkpoint: dict[str, Any]
    verdict: str
    reasons: list[str]
    notes: list[str] = field(default_factory=list)


def make_plan(r: Recipe, con: sqlite3.Connection | None = None, calibration: dict[str, float] | None = None,
              devices: list[Device] | None = None) -> Plan:
    """The whole plan for recipe `r`. `calibration`: measured {"step_seconds", "peak_bytes"}."""
    from ember.metrics.cost import cost
    from ember.metrics.report import prices_from
    notes: list[str] = []
    cfg = model_config(r)
    devices = devices or detect_devices(r.train.device)
    dev = devices[0]
    t = train_shape(r)
    try:
        m = ModelShape.from_config(cfg)
    except ValueError as e:
        if calibration is None:
            raise UnknownArchitecture(str(e)) from None
        m = None
        notes.append(f"{e}: the memory figure is measured (calibration), not estimated")
    margin = r.plan.memory_margin
    budget = dev.free
    if m is not None:
        b = estimate(m, t)
        memory = asdict(b) | {"with_margin": b.with_margin(margin), "margin": margin}
        peak = b.peak
    else:
        peak = int(calibration["peak_bytes"])
        memory = {"peak": peak, "phase": "measured", "with_margin": int(peak * (1 + margin)), "margin": margin}
    if calibration and "peak_bytes" in calibration:
        memory["measured_peak"] = int(calibration["peak_bytes"])
        memory["error"] = peak / calibration["peak_bytes"] - 1
    fits_here = fits(peak, budget, margin)
    rems = remedies(m, r, budget, margin) if m is not None else []

    # Time: measured steps, else FLOPs over peak at an assumed MFU.
    arch = architecture(m, t) if m is not None else None
    tokens_per_step = r.train.micro_batch * r.data.seq_len * r.train.grad_accum
    if calibration and "step_seconds" in calibration:
        step_s = calibration["step_seconds"] * r.train.grad_accum
        how = f"measured: {calibration['step_seconds']:.4g} s per micro-batch (calibration)"
    elif arch is not None:
        peak_fl = _peak(r, dev)
        fpt = flops_per_token(arch)
        step_s = fpt.total * tokens_per_step / (peak_fl.flops * r.plan.assumed_mfu)
        how = (f"{fpt.formula} = {fpt.total:.3g} FLOPs/token x {tokens_per_step} tokens / "
               f"({peak_fl.flops / 1e12:.3g} TFLOP/s peak, {peak_fl.source}, x assumed MFU "
               f"{r.plan.assumed_mfu:.0%})")
    else:
        step_s, how = float("nan"), "unknown"
    compute_s = step_s * r.train.max_steps

    # Checkpoint interval (Young/Daly) from the checkpoint's size and this machine's history.
    ck_bytes = _checkpoint_bytes(m, t) if m is not None else peak // 3
    snap_rate, durable_rate, rate_src = _rates(con, socket.gethostname())
    delta = ck_bytes / (snap_rate if r.checkpoint.async_ else durable_rate)
    mtbf, mtbf_src = mtbf_seconds(r.checkpoint.interruption_hours, con, socket.gethostname())
    iv = recommend(delta, mtbf, restart=STARTUP_SECONDS)
    wall = STARTUP_SECONDS + compute_s / max(1e-9, 1 - iv.checkpoint_share - iv.lost_share)
    prices = prices_from(asdict(r.cost), len(devices) if dev.kind != "cpu" else 1)
    c = cost(prices, wall, tokens_per_step * r.train.max_steps)

    verdict, reasons = _verdict(fits_here, rems, wall, r, devices)
    return Plan(
        recipe={"model": r.model.path, "method": r.method.kind, "micro_batch": r.train.micro_batch,
                "seq_len": r.data.seq_len, "grad_accum": r.train.grad_accum, "precision": r.precision.mode,
                "activation_checkpointing": r.train.activation_checkpointing,
                "loss_chunk": r.train.loss_chunk, "max_steps": r.train.max_steps},
        devices=[asdict(d) for d in devices] + ([asdict(host_memory())] if dev.kind != "cpu" else []),
        model=asdict(m) | {"params": m.params(), "trainable": trainable_params(m, t)} if m else {},
        memory=memory, fits=fits_here, remedies=[asdict(x) for x in rems],
        time={"step_seconds": step_s, "how": how, "steps": r.train.max_steps, "compute_seconds": compute_s,
              "wall_seconds": wall, "tokens": tokens_per_step * r.train.max_steps},
        cost=asdict(c),
        checkpoint={"bytes": ck_bytes, "delta_seconds": delta, "delta_source": rate_src,
                    "mtbf_seconds": mtbf, "mtbf_source": mtbf_src, **asdict(iv),
                    "async": r.checkpoint.async_, "recipe_every_seconds": r.checkpoint.every_seconds},
        verdict=verdict, reasons=reasons, notes=notes)


def _peak(r: Recipe, dev: Device) -> Peak:
    if r.cost.peak_tflops:
        return Peak(r.cost.peak_tflops * 1e12, "recipe [cost] peak_tflops")
    if dev.kind == "cpu":
        return measured_cpu_peak(r.train.threads or os.cpu_count() or 1)
    return lookup_peak(dev.name, r.precision.mode)


def _checkpoint_bytes(m: ModelShape, t: TrainShape) -> int:
    """Model weights (all of them, or the adapters) and AdamW's two moments."""
    trainable = trainable_params(m, t)
    return (trainable if t.lora else m.params()) * F32 + 2 * trainable * F32


def _rates(con: sqlite3.Connection | None, host: str) -> tuple[float, float, str]:
    """Snapshot and durable-save bytes per second: this machine's checkpoints in the ledger."""
    if con is not None:
        rows = con.execute(
            "SELECT c.bytes, c.blocked_seconds, c.durable_seconds FROM checkpoints c JOIN attempts a "
            "ON a.run_id = c.run_id AND a.attempt = c.attempt WHERE a.host = ? AND c.bytes > 1e6 "
            "ORDER BY c.created DESC LIMIT 50", (host,)).fetchall()
        if rows:
            snap = sorted(b / max(s, 1e-6) for b, s, _ in rows)[len(rows) // 2]
            durable = sorted(b / max(d, 1e-6) for b, _, d in rows)[len(rows) // 2]
            return snap, durable, f"median of {len(rows)} checkpoints of this machine in the ledger"
    return SNAPSHOT_BYTES_PER_S, DURABLE_BYTES_PER_S, (
        f"assumed {SNAPSHOT_BYTES_PER_S / 1e9:g} GB/s snapshot, {DURABLE_BYTES_PER_S / 1e9:g} GB/s "
        f"durable (no checkpoint of this machine in the ledger)")


def _verdict(fits_here: bool, rems: list[Remedy], wall: float, r: Recipe, devices: list[Device]) -> tuple[str, list[str]]:
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
    return "local", [f"fits in {devices[0].name} and takes about {wall / 3600:.2g} h, within "
                     f"[plan] local_max_hours = {r.plan.local_max_hours:g}"]
