"""From the doctor's measured figures to a ranked list of causes: pure arithmetic.

The figures are typed (`Figures`, filled by ember.doctor.experiments); every comparison in them
is two lists of repeated measurements taken interleaved (A, B, A, B...), so a load that comes
and goes on a shared machine lands on both sides, and where they were taken one for one, in
rounds, per-round differences are compared. A cause gets a saving only when its evidence shows
a difference whose bootstrap interval lies above zero (`difference`); a cause whose evidence
shows none gets no saving and ranks below compute.

Each cause carries its evidence, the step time its remedy would save (`saving_seconds`: what
this cause costs that the remedy removes), the step predicted after the remedy's `changes`
(`predicted_step_seconds`, every effect of the change included, in the current step's tokens),
and the remedy. Causes that save at least `THRESHOLD` of the step rank first, by saving; then
compute-bound (the compute phases' share of the step); then the rest.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

from ember.ckpt.interval import recommend

THRESHOLD = 0.10  # a cause must save at least this share of the step to rank above compute
PHASES = ("data", "h2d", "forward", "backward", "sync", "optimizer", "checkpoint", "other")
COMPUTE = ("h2d", "forward", "backward", "optimizer")


@dataclass
class Shape:
    """The recipe settings the causes are about."""
    micro_batch: int
    grad_accum: int
    seq_len: int
    workers: int
    threads: int                  # torch threads the run uses (train.threads resolved)
    cores: int
    checkpoint_async: bool
    checkpoint_every_steps: int   # the recipe's [checkpoint] every_steps (0 = off)
    checkpoint_every_seconds: float | str  # the recipe's every_seconds: seconds, 0, or "auto"


@dataclass
class Baseline:
    """The recipe as written, in the real loop (ember.train.loop.train): whole iterations, each
    the step, the checkpoint the recipe makes after it, and the loop's bookkeeping."""
    iterations: list[float]       # seconds per loop iteration
    train_step: list[float]       # of which train_step alone
    phases: dict[str, float]      # mean seconds per phase, "other" included: they sum to step_seconds
    step_seconds: float           # the real step: the mean iteration (checkpoints amortised)
    step_p50: float
    step_p99: float
    tokens_per_step: int
    tokens_per_second: float
    mfu: float | None
    peak_source: str
    device: str


@dataclass
class InputFigures:
    """train_step on the real input pipeline against the same step on one in-memory micro-batch."""
    real: list[float]             # seconds per step, real loader (interleaved with...)
    in_memory: list[float]        # ... the in-memory micro-batch
    data_wait: float              # median seconds per step the real steps waited for data
    loader_batches_per_second: float | None  # the pipeline alone, nothing consuming (None: not measured)
    per_worker_batches_per_second: float     # what one loader (worker, or the main process) delivers
    suggested_workers: int


@dataclass
class CheckpointFigures:
    """The real loop as written against the real loop with the checkpoint changed one way."""
    variant: str                  # "off": no checkpoints; "every": one every `every` steps, against none
    every: int                    # steps between checkpoints in the "every" variant
    baseline: list[float]         # loop iterations of the recipe as written (interleaved with...)
    changed: list[float]          # ... loop iterations of the variant
    blocked: float                # mean seconds a checkpoint blocked the training thread (loop rows)
    snapshot_seconds: float       # the blocking part of an asynchronous checkpoint (in-memory copy)
    every_steps: float            # the recipe's checkpoints, in steps between them (inf: none)
    mtbf_seconds: float           # expected time between interruptions, for Young/Daly


@dataclass
class SweepPoint:
    micro_batch: int
    steps: list[float]            # train_step seconds at this micro batch, grad_accum 1
    compute: list[float]          # of which h2d + forward + backward
    reference: list[float]        # h2d + forward + backward at the recipe's micro batch, interleaved


@dataclass
class SweepFigures:
    """Micro batches that fit (the memory plan), each measured interleaved with the recipe's."""
    points: list[SweepPoint]
    fits: dict[int, int]          # micro batch -> planned peak bytes
    loader_seconds: dict[int, float] = field(default_factory=dict)  # the input alone: seconds a micro-batch


@dataclass
class ContentionFigures:
    """Other processes taking the cores: /proc during the baseline, and fewer threads measured."""
    load_average: float           # 1-minute
    runnable: int                 # procs_running at the end of the baseline (this process included)
    others_cores: float           # cores' worth of CPU other processes used during the baseline
    steal_share: float            # of the machine's CPU time, taken by the hypervisor
    wait_share: float             # this process's threads: run-queue wait over their run + wait
    wait_per_step: float          # seconds per step the training thread waited for a CPU
    fewer_threads: int | None = None   # the thread count measured against the recipe's
    at_threads: list[float] = field(default_factory=list)  # train_step seconds, recipe's threads
    at_fewer: list[float] = field(default_factory=list)    # ... and fewer, interleaved


@dataclass
class DdpFigures:
    """N processes on loopback (gloo), the loop's train_step under DDP against the bare model."""
    world: int
    backend: str
    synced: list[float]           # seconds per optimizer step with gradient synchronisation
    unsynced: list[float]         # ... without (the bare model), interleaved
    allreduce: list[float]        # the gradients' all-reduce alone


@dataclass
class TopOp:
    name: str
    share: float
    calls: int
    seconds: float                # per step


@dataclass
class Figures:
    shape: Shape
    baseline: Baseline
    step_seconds: float = 0.0     # the step the causes rank against (reference_step)
    input: InputFigures | None = None
    checkpoint: CheckpointFigures | None = None
    sweep: SweepFigures | None = None
    contention: ContentionFigures | None = None
    ddp: DdpFigures | None = None
    top_ops: list[TopOp] = field(default_factory=list)
    # An fp32 recipe on a CPU: this CPU's measured matmul peak per dtype ("fp32", "bf16"), FLOP/s
    cpu_peaks: dict[str, float] = field(default_factory=dict)


# A CPU whose bf16 matmuls measure at least this many times its fp32 ones (AMX, AVX512-BF16) is
# named in the compute-bound finding with the figures: below it, bf16's casts and its slower
# kernels elsewhere in the step (bench/README, "Compiled, in fp32 and in bf16") eat the gain.
BF16_FASTER = 2.0


@dataclass
class Skipped:
    """An experiment not run (or cut short), and why: for the report, next to the figures."""
    experiment: str
    reason: str


@dataclass
class Finding:
    cause: str  # contention, input-bound, checkpoint-bound, overhead-bound, communication-bound, compute-bound
    saving_seconds: float  # per optimizer step, if the remedy is applied
    saving_share: float  # of the current step time
    evidence: list[str]
    remedy: str
    predicted_step_seconds: float = 0.0
    changes: dict[str, Any] = field(default_factory=dict)
    saving_cost: float | None = None  # per run: saving_share of the run's cost, when it is known


@dataclass(frozen=True)
class Difference:
    """How much larger one side is than the other (medians or means), and the interval that
    resampling the measurements gives it: it counts only when the interval's low end is above 0."""
    seconds: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        return self.low > 0 < self.seconds

    def text(self) -> str:
        return f"{self.seconds * 1000:+.2f} ms ({CONFIDENCE:.0%} interval {self.low * 1000:+.2f} to {self.high * 1000:+.2f} ms)"


CONFIDENCE = 0.98
RESAMPLES = 1000


def difference(a: list[float], b: list[float], center: str = "median", paired: bool = False) -> Difference:
    """center(a) - center(b), with a bootstrap interval (resampled with replacement, seeded, so a
    report is reproducible from its figures; no assumption on the shape of the noise). Medians
    are robust to a stray slow step; means are for costs that live in the tail (a checkpoint
    every k steps, a thread descheduled now and then). `paired`: a[i] and b[i] were taken side by
    side in one round (interleaved), so the per-round differences are resampled, and load that
    drifts from round to round cancels out. Fewer than 3 values a side: no evidence."""
    if len(a) < 3 or len(b) < 3:
        return Difference(0.0, -math.inf, math.inf)
    f = statistics.median if center == "median" else statistics.fmean
    rng = random.Random(0)
    if paired and len(a) == len(b):
        d = [x - y for x, y in zip(a, b)]
        spread = sorted(f(rng.choices(d, k=len(d))) for _ in range(RESAMPLES))
        estimate = f(d)
    else:
        spread = sorted(f(rng.choices(a, k=len(a))) - f(rng.choices(b, k=len(b))) for _ in range(RESAMPLES))
        estimate = f(a) - f(b)
    tail = int(RESAMPLES * (1 - CONFIDENCE) / 2)
    return Difference(estimate, spread[tail], spread[-1 - tail])


def reference_step(f: Figures) -> float:
    """The step the causes rank against: the real loop's, plus the synchronisation DDP exposes
    per step when --ddp measured one that shows."""
    step = f.baseline.step_seconds
    if f.ddp is not None:
        d = difference(f.ddp.synced, f.ddp.unsynced, paired=True)
        if d.significant:
            step += d.seconds
    return step


def diagnose(f: Figures) -> list[Finding]:
    """Rank the causes the figures give evidence for (see the module docstring)."""
    step = f.step_seconds or reference_step(f)
    out: list[Finding] = []

    def add(cause: str, saving: float, evidence: list[str], remedy: str, changes: dict | None = None,
            predicted: float | None = None) -> None:
        saving = max(0.0, min(saving, step))
        after = step - saving if predicted is None else max(0.0, predicted)
        out.append(Finding(cause, saving, saving / step, evidence, remedy, after, changes or {}))

    for cause in (_contention, _input, _checkpoint, _overhead, _communication):
        found = cause(f, step)
        if found is not None:
            add(*found)
    ph = f.baseline.phases
    compute = sum(ph.get(k, 0.0) for k in COMPUTE)
    ev = [(f"forward {ph.get('forward', 0) * 1000:.1f} ms, backward {ph.get('backward', 0) * 1000:.1f} ms, "
          f"optimizer {ph.get('optimizer', 0) * 1000:.1f} ms of a {step * 1000:.1f} ms step")]
    if f.baseline.mfu is not None:
        ev.append(f"MFU {f.baseline.mfu:.1%} of {f.baseline.peak_source}")
    if f.top_ops:
        ev.append("top operators: " + ", ".join(f"{o.name} {o.share:.0%}" for o in f.top_ops[:5]))
    precision = "the step is spent computing: bf16 on hardware with fast bf16 matmuls"
    fp32, bf16 = f.cpu_peaks.get("fp32"), f.cpu_peaks.get("bf16")
    if fp32 and bf16 and bf16 >= BF16_FASTER * fp32:
        ev.append(f"this CPU's bf16 matmuls measured {bf16 / fp32:.1f}x its fp32 ones ({bf16 / 1e12:.3g} against "
                  f"{fp32 / 1e12:.3g} TFLOP/s, 1024x1024)")
        precision = ("the step is spent computing, and this CPU multiplies bf16 much faster than fp32: [precision] "
                     "mode = \"bf16\" (bf16 autocast: compare its losses over a short run)")
    remedy = precision + ", a larger micro batch where memory allows, or a smaller model / LoRA"
    out.append(Finding("compute-bound", 0.0, min(1.0, max(0.0, compute / step)), ev, remedy, step))
    causes = [x for x in out if x.cause != "compute-bound"]
    significant = sorted((x for x in causes if x.saving_share >= THRESHOLD), key=lambda x: -x.saving_seconds)
    minor = sorted((x for x in causes if x.saving_share < THRESHOLD), key=lambda x: -x.saving_seconds)
    return significant + [out[-1]] + minor


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _contention(f: Figures, step: float) -> tuple | None:
    c = f.contention
    if c is None:
        return None
    ev = [(f"load average {c.load_average:.2f} on {f.shape.cores} cores, {c.runnable} runnable; other "
          f"processes used {c.others_cores:.2f} cores during the baseline; steal {c.steal_share:.0%}"),
          (f"this process's threads waited for a CPU {c.wait_share:.0%} of the time they were runnable; "
          f"the training thread {_ms(c.wait_per_step)} per step")]
    remedy = ("other processes take the cores: run when the machine is free (its owner's rules say when), "
              "or give this run fewer threads")
    # What a free machine gives back: the time the training thread waited for a CPU. Counted
    # only when other processes were using cores (else the wait is this process's own threads').
    waited = c.wait_per_step if c.others_cores >= 0.25 else 0.0
    if c.fewer_threads is not None:
        # Means: a descheduled thread stalls a step now and then, and those stalls are the cost.
        d = difference(c.at_threads, c.at_fewer, "mean", paired=True)
        ev.append(f"train_step with {f.shape.threads} threads {_ms(statistics.fmean(c.at_threads))}, with "
                  f"{c.fewer_threads} {_ms(statistics.fmean(c.at_fewer))} (means, interleaved): {d.text()}")
        if d.significant and d.seconds > 0:
            # Contention slows every phase alike: the measured ratio applies to the whole step.
            saving = step * (1 - statistics.fmean(c.at_fewer) / statistics.fmean(c.at_threads))
            return ("contention", max(saving, waited), ev,
                    (f"[train] threads = {c.fewer_threads} (measured faster on this busy machine); or run "
                     f"when it is free"), {"train.threads": c.fewer_threads})
    return ("contention", waited, ev, remedy)


def _input(f: Figures, step: float) -> tuple | None:
    i = f.input
    if i is None:
        return None
    d = difference(i.real, i.in_memory, paired=True)
    s = f.shape
    consume = s.grad_accum / max(statistics.median(i.in_memory), 1e-9)
    ev = [(f"train_step with the input pipeline {_ms(statistics.median(i.real))}, with an in-memory micro-batch "
          f"{_ms(statistics.median(i.in_memory))} (interleaved): {d.text()}; it waits {_ms(i.data_wait)} for data"),
          f"one loader delivers {i.per_worker_batches_per_second:,.1f} micro-batches/s; the model consumes "
          f"{consume:,.1f}/s" + (f"; the pipeline alone ({max(1, s.workers)} loaders): "
                                 f"{i.loader_batches_per_second:,.1f}/s" if i.loader_batches_per_second else "")]
    remedy = (f"more loader workers ([data] workers = {i.suggested_workers}), pinned memory and prefetch; "
              f"pre-tokenize the data")
    changes = {"data.workers": i.suggested_workers} if i.suggested_workers != s.workers else {}
    if not d.significant:
        return ("input-bound", 0.0, ev, remedy, changes)
    # With W loaders the input delivers W times one loader's rate; the step then waits only for
    # what the input still lags behind the model. The remedy removes no more than the wait.
    input_time = s.grad_accum / (max(1, i.suggested_workers) * i.per_worker_batches_per_second)
    after = max(statistics.median(i.in_memory), input_time)
    saving = min(d.seconds, i.data_wait, max(0.0, statistics.median(i.real) - after))
    return ("input-bound", saving, ev, remedy, changes)


def checkpoint_cost(c: CheckpointFigures) -> tuple[float, Difference]:
    """Seconds per step the recipe's checkpoints cost, and the measured difference behind it."""
    if c.variant == "every":  # the recipe checkpoints less often than a stretch: every `every` steps measured
        d = difference(c.changed, c.baseline, "mean")
        per_checkpoint = d.seconds * c.every
        return (per_checkpoint / c.every_steps if math.isfinite(c.every_steps) else 0.0), d
    d = difference(c.baseline, c.changed, "mean")  # "off": as written against no checkpoints
    return d.seconds, d


def _checkpoint(f: Figures, step: float) -> tuple | None:
    c = f.checkpoint
    if c is None:
        return None
    per_step, d = checkpoint_cost(c)
    sync = not f.shape.checkpoint_async
    what = "no checkpoints" if c.variant == "off" else f"a checkpoint every {c.every} steps"
    first = "as written" if c.variant == "off" else "without checkpoints"
    ev = [(f"loop iterations {first} {_ms(statistics.mean(c.baseline))}, with {what} "
          f"{_ms(statistics.mean(c.changed))} (means, interleaved): {d.text()}"),
          (f"a checkpoint ({'synchronous' if sync else 'asynchronous'}) blocks training {_ms(c.blocked)} "
          f"(metrics fsync, snapshot, {'write, fsync, retention, ' if sync else ''}ledger rows); every "
          f"{c.every_steps:.3g} steps it costs {per_step * 1000:.2f} ms per step, all included")]
    cost = max(per_step, 0.0) * c.every_steps  # one checkpoint: all it costs the loop
    iv = recommend(max(cost, 1e-4), c.mtbf_seconds)
    daly_steps = iv.seconds / max(step, 1e-9)
    ev.append(f"Young/Daly for a {_ms(cost)} checkpoint and {c.mtbf_seconds / 3600:.3g} h between "
              f"interruptions: every {iv.seconds:.0f} s ({daly_steps:,.0f} steps)")
    if daly_steps > c.every_steps:
        # every_steps = 0 too: else it still forces its saves and the saving cannot happen.
        remedy = (f"a longer checkpoint interval: [checkpoint] every_seconds = \"auto\" (Young/Daly, every "
                  f"{iv.seconds:.0f} s) and every_steps = 0" + (", asynchronous (async = true)" if sync else ""))
        changes: dict[str, Any] = {"checkpoint.every_seconds": "auto", "checkpoint.every_steps": 0}
        changes.update({"checkpoint.async": True} if sync else {})
        saving = per_step * (1 - c.every_steps / daly_steps) if d.significant else 0.0
        return ("checkpoint-bound", saving, ev, remedy, changes)
    if sync:  # as often as Young/Daly says already: training could block for the snapshot only
        remedy = (f"asynchronous checkpoints ([checkpoint] async = true): training blocks for the snapshot "
                  f"({_ms(c.snapshot_seconds)}) while a background thread writes")
        saving = max(0.0, per_step - c.snapshot_seconds / c.every_steps) if d.significant else 0.0
        return ("checkpoint-bound", saving, ev, remedy, {"checkpoint.async": True})
    return ("checkpoint-bound", 0.0, ev, "none: asynchronous, and no more often than Young/Daly's interval")


def _overhead(f: Figures, step: float) -> tuple | None:
    sw = f.sweep
    if sw is None or not sw.points:
        return None
    s, ph = f.shape, f.baseline.phases
    mb, accum = s.micro_batch, s.grad_accum
    per_sample = {p.micro_batch: statistics.median(p.compute) / p.micro_batch for p in sw.points}
    if mb not in per_sample:
        ref = next(p.reference for p in sw.points)
        per_sample[mb] = statistics.median(ref) / mb
    ev = ["micro-batch sweep (forward + backward): "
          + ", ".join(f"{k}: {v * 1000:.3f} ms/sample" for k, v in sorted(per_sample.items()))]
    candidates = [p for p in sw.points if p.micro_batch > mb and p.micro_batch in sw.fits]
    if not candidates:
        return ("overhead-bound", 0.0, ev + [f"no micro batch larger than {mb} fits or was measured"],
                "none: a larger micro batch does not fit", {})
    best = min(candidates, key=lambda p: per_sample[p.micro_batch])
    k = best.micro_batch
    d = difference([x / mb for x in best.reference], [x / k for x in best.compute], paired=True)
    ev.append(f"per sample at {mb} against {k} (interleaved): {d.text()}; micro batch {k} fits "
              f"(plan: {sw.fits[k] / 2**30:.2f} GiB peak)")
    changes = _batch_changes(mb, k, accum)
    remedy = _batch_remedy(mb, k, accum)
    # The step after the change, per the current step's tokens: forward and backward per sample
    # as measured at k (unchanged when the sweep shows no measurable difference); the rest of an
    # optimizer step (update, checkpoint, bookkeeping, measured in the loop) comes once per
    # optimizer step, so a step of `scale` times the tokens pays it once for all. The saving is
    # this cause's own part: the checkpoint's share is the checkpoint cause's, the input's the
    # input cause's. Loading costs what the input alone measured at each size (a fixed part per
    # micro-batch, mostly); unmeasured, it is taken to grow with the samples (no change).
    new_accum = changes.get("train.grad_accum", accum)
    scale = k * new_accum / (mb * accum)
    fixed = ph.get("optimizer", 0) + ph.get("sync", 0) + ph.get("other", 0)
    fb = sum(ph.get(x, 0) for x in ("h2d", "forward", "backward"))
    ratio = statistics.median(best.compute) / k / (statistics.median(best.reference) / mb) if d.significant else 1.0
    load = sw.loader_seconds
    data = ph.get("data", 0) * (load[k] / load[mb] * mb / k if k in load and mb in load and load[mb] > 0 else 1)
    if scale > 1:
        ev.append(f"the update and the loop's bookkeeping take {_ms(fixed)} per optimizer step (the loop's "
                  f"phases): a step of {scale:g}x the tokens pays them once")
    saving = fb * (1 - ratio) + fixed * (1 - 1 / scale)
    predicted = data + fb * ratio + (fixed + ph.get("checkpoint", 0)) / scale
    return ("overhead-bound", saving, ev, remedy, changes, predicted)


def _communication(f: Figures, step: float) -> tuple | None:
    g = f.ddp
    if g is None:
        return None
    accum = f.shape.grad_accum
    d = difference(g.synced, g.unsynced, paired=True)
    allreduce = statistics.median(g.allreduce)
    hidden = max(0.0, min(1.0, 1 - max(d.seconds, 0.0) / allreduce)) if allreduce > 0 else 0.0
    ev = [(f"DDP over {g.backend} x{g.world}: {_ms(statistics.median(g.synced))} per step with gradient "
          f"synchronisation, {_ms(statistics.median(g.unsynced))} without (interleaved): {d.text()}"),
          f"all-reduce of the gradients alone: {_ms(allreduce)}; {hidden:.0%} of it hidden behind the backward pass"]
    k = 4 * accum  # synchronise 4x less often than now
    remedy = (f"gradient accumulation {k} (one synchronisation per {k} micro-batches; revisit the learning "
              f"rate: more tokens per optimizer step), larger DDP buckets, or fewer processes over a faster link")
    # The change also makes fewer optimizer steps for the same tokens: the prediction counts that
    # (the loop's update and bookkeeping, measured), the saving (this cause's own) does not.
    ph = f.baseline.phases
    fixed = (ph.get("optimizer", 0) + ph.get("checkpoint", 0) + ph.get("other", 0)) * (1 - accum / k)
    saving = d.seconds * (1 - accum / k) if d.significant else 0.0
    return ("communication-bound", saving, ev, remedy, {"train.grad_accum": k}, step - saving - fixed)


def _batch_changes(mb: int, best: int, accum: int) -> dict[str, int]:
    if mb * accum % best == 0 and mb * accum >= best:
        return {"train.micro_batch": best, "train.grad_accum": mb * accum // best}
    return {"train.micro_batch": best}


def _batch_remedy(mb: int, best: int, accum: int) -> str:
    c = _batch_changes(mb, best, accum)
    if "train.grad_accum" in c:
        how = (f"micro batch {best} with gradient accumulation {c['train.grad_accum']} (same tokens per "
               f"optimizer step)")
    else:
        how = (f"micro batch {best}: {best * accum // mb}x the tokens per optimizer step (revisit the "
               f"learning rate)")
    return how + "; if memory stops it, activation checkpointing or the chunked loss unlock it"
