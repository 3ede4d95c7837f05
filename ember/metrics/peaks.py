"""Peak dense FLOP/s of known accelerators by compute dtype, and a measured CPU peak.

Figures are vendors' dense (no sparsity) tensor-core numbers for the SXM/OAM part where there
are several; fp32 means plain FP32 (TF32 is opt-in in PyTorch). An unknown device gets no
peak and a reason, never a guess: a guessed peak is how a tool reports 563% MFU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ember.paths import home

TERA = 1e12

# Matched against the device name, lower-cased, first match wins (so "h100" after "h200" and
# "gh200"; "a100" is checked before shorter names).
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("gh200", {"bf16": 989 * TERA, "fp16": 989 * TERA, "fp32": 67 * TERA}),
    ("h200", {"bf16": 989 * TERA, "fp16": 989 * TERA, "fp32": 67 * TERA}),
    ("h100 pcie", {"bf16": 756 * TERA, "fp16": 756 * TERA, "fp32": 51 * TERA}),
    ("h100", {"bf16": 989 * TERA, "fp16": 989 * TERA, "fp32": 67 * TERA}),
    ("a100", {"bf16": 312 * TERA, "fp16": 312 * TERA, "fp32": 19.5 * TERA}),
    ("l40s", {"bf16": 362 * TERA, "fp16": 362 * TERA, "fp32": 91.6 * TERA}),
    ("l4", {"bf16": 121 * TERA, "fp16": 121 * TERA, "fp32": 30.3 * TERA}),
    ("a10g", {"bf16": 70 * TERA, "fp16": 70 * TERA, "fp32": 31.2 * TERA}),
    ("rtx 4090", {"bf16": 165.2 * TERA, "fp16": 165.2 * TERA, "fp32": 82.6 * TERA}),
    ("rtx 3090", {"bf16": 71 * TERA, "fp16": 71 * TERA, "fp32": 35.6 * TERA}),
    ("mi300x", {"bf16": 1307 * TERA, "fp16": 1307 * TERA, "fp32": 163.4 * TERA}),
    ("mi250x", {"bf16": 383 * TERA, "fp16": 383 * TERA, "fp32": 47.9 * TERA}),
    ("ascend910b", {"bf16": 320 * TERA, "fp16": 320 * TERA}),
    ("910b", {"bf16": 320 * TERA, "fp16": 320 * TERA}),
]


@dataclass(frozen=True)
class Peak:
    flops: float | None   # FLOP/s, or None when unknown
    source: str           # "table: h100", "recipe override", "measured: ...", or why unknown
    per_op_s: float = 0.0  # fixed seconds each op activation checkpointing recomputes costs (with_op_cost)


def lookup_peak(name: str, dtype: str) -> Peak:
    """The table's peak for a device name and compute dtype ('fp32', 'bf16', 'fp16')."""
    lowered = name.lower().replace("-", " ")
    for key, by_dtype in PEAKS:
        if key in lowered or key.replace(" ", "") in lowered.replace(" ", ""):
            if dtype in by_dtype:
                return Peak(by_dtype[dtype], f"table: {key} {dtype}")
            return Peak(None, f"no {dtype} peak in the table for {key}")
    return Peak(None, f"unknown device '{name}': set [cost] peak_tflops to get MFU")


def select_peak(override_tflops: float, device_type: str, name: str, dtype: str, threads: int,
                again: bool = False) -> Peak:
    """The one rule for the peak MFU divides by: the recipe's [cost] peak_tflops if set, else on
    a CPU the measured matmul peak in the dtype the run multiplies in (`again`: measured anew),
    else the table's figure for the device and dtype. A CPU's bf16 matmuls can be several times
    its fp32 ones (AMX: bench/README, "Compiled, in fp32 and in bf16"), so a bf16 run's MFU
    against the fp32 peak would overstate it as much."""
    if override_tflops:
        return Peak(override_tflops * TERA, "recipe [cost] peak_tflops")
    if device_type == "cpu":
        return measured_cpu_peak(threads or os.cpu_count() or 1, again, dtype=dtype)
    return lookup_peak(name, dtype)


# Memory bandwidth of the same devices, vendors' figures (bytes/s), for what a step spends moving
# bytes rather than multiplying: QLoRA's 4-bit dequantization (ember.plan.dequant.dequant_bytes).
BANDWIDTHS: list[tuple[str, float]] = [
    ("gh200", 4.0e12), ("h200", 4.8e12), ("h100 pcie", 2.0e12), ("h100", 3.35e12), ("a100", 2.039e12),
    ("l40s", 0.864e12), ("l4", 0.3e12), ("a10g", 0.6e12), ("rtx 4090", 1.008e12), ("rtx 3090", 0.936e12),
    ("mi300x", 5.3e12), ("mi250x", 3.2e12),
]


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float | None   # None when unknown
    source: str                 # "table: h100", "recipe override", or why unknown
    per_call_s: float = 0.0     # fixed seconds each 4-bit call costs beside its bytes (measured on a CPU)


def memory_bandwidth(override_gbps: float, device_type: str, name: str, threads: int = 0,
                     bytes_of: Callable[[int], int] | None = None) -> Bandwidth:
    """The recipe's [cost] memory_gbps if set, else the table's figure for the device; on a CPU,
    where bitsandbytes' dequantization runs well below the memory's bandwidth, the rate it moves
    `bytes_of(n)` bytes per n-weight dequantization at, measured (see measured_dequant_rate)."""
    if override_gbps:
        return Bandwidth(override_gbps * 1e9, "recipe [cost] memory_gbps")
    if device_type == "cpu":
        if importlib.util.find_spec("bitsandbytes") is None:
            return Bandwidth(None, "no bitsandbytes to measure this CPU's dequantization: set [cost] memory_gbps")
        if bytes_of is None:
            return Bandwidth(None, "a CPU's dequantization rate is not its memory bandwidth: set [cost] memory_gbps")
        return measured_dequant_rate(threads or os.cpu_count() or 1, bytes_of)
    lowered = name.lower().replace("-", " ")
    for key, rate in BANDWIDTHS:
        if key in lowered or key.replace(" ", "") in lowered.replace(" ", ""):
            return Bandwidth(rate, f"table: {key}")
    return Bandwidth(None, f"unknown device '{name}': set [cost] memory_gbps")


MAX_AGE_DAYS = 30      # a measured CPU peak older than this is measured again
LOADED = 0.25          # other processes' share of the cores above which a measurement was under load
QUIETER_BY = 0.2       # ... and measured again once the machine is this much quieter


@dataclass(frozen=True)
class CpuPeak:
    """One measurement of the CPU peak: FLOP/s, when (epoch seconds), other processes' share of
    all cores while it ran (0..1; None where /proc/stat could not be read)."""
    flops: float
    at: float
    others: float | None
    per_call: float = 0.0   # a rate fitted per call (measured_dequant_rate): its fixed seconds per call
    size: int = 0           # a matmul timed smaller than asked (time_matmul), its size; 0: as asked

    def describe(self) -> str:
        """When and under what load, for the peak's source."""
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.at))
        load = "load unknown" if self.others is None else f"other processes using {self.others:.0%} of the cores"
        return f"measured {when}, {load}"


def stale(record: object, now: float, others_now: float | None) -> str | None:
    """Why a cached CPU peak record must be measured again (None: it stands): no date or load
    (an old cache), older than MAX_AGE_DAYS, or measured under load while the machine is now quieter."""
    if not isinstance(record, CpuPeak):
        return "the cached peak carries no date or load"
    days = (now - record.at) / 86400
    if days > MAX_AGE_DAYS:
        return f"the cached peak is {days:.0f} days old"
    if (record.others is not None and others_now is not None and record.others > LOADED
            and others_now < record.others - QUIETER_BY):
        return (f"the cached peak was measured with other processes using {record.others:.0%} of the cores, "
                f"now {others_now:.0%}")
    return None


def choose_cpu_peak(record: object, now: float, others_now: float | None, measure: Callable[[], CpuPeak],
                    again: bool = False) -> tuple[CpuPeak, str | None]:
    """The CPU peak to keep, and why it was measured (None: the cached record stands). A stale
    record by age is replaced; a loaded one, or one measured `again`, gives way only to a higher
    figure (load from elsewhere only slows a measurement down)."""
    why = "at the end of the attempt" if again else stale(record, now, others_now)
    if why is None and isinstance(record, CpuPeak):
        return record, None
    fresh = measure()
    aged = isinstance(record, CpuPeak) and (now - record.at) / 86400 > MAX_AGE_DAYS
    if isinstance(record, CpuPeak) and not aged and record.flops > fresh.flops:
        return record, why
    return fresh, why


def others_share(window: float = 0.1) -> float | None:
    """Other processes' share of all cores over `window` seconds (this process sleeps through it)."""
    first = _cpu_jiffies()
    if first is None:
        return None
    mine = time.process_time()
    time.sleep(window)
    return _others_since(first, mine)


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores from /proc/stat; None where it cannot be read."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _others_since(first: tuple[int, int], mine: float) -> float | None:
    """Other processes' share of all cores since `first` jiffies, less this process's CPU time since `mine`."""
    last = _cpu_jiffies()
    if last is None or last[1] <= first[1]:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = (last[0] - first[0]) / tick - (time.process_time() - mine)
    return min(1.0, max(0.0, busy / ((last[1] - first[1]) / tick)))


@contextmanager
def _timing(threads: int) -> Iterator[Callable[[], float | None]]:
    """torch at `threads` threads while the block times something, the previous count put back
    after (an error too); yields what gives other processes' share of the cores since it began."""
    import torch
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    first, mine = _cpu_jiffies(), time.process_time()
    try:
        yield lambda: _others_since(first, mine) if first is not None else None
    finally:
        torch.set_num_threads(previous)


MATMUL_DTYPES = ("fp32", "bf16", "fp16")


def time_matmul(threads: int, size: int = 1024, rounds: int = 5, dtype: str = "fp32") -> CpuPeak:
    """Matmul FLOP/s in `dtype` (MATMUL_DTYPES) on this CPU with `threads` threads, the best of
    `rounds` windows of 0.1 s, with other processes' share of the cores while it ran. The size is
    `size`, or smaller where one call would take over LONGEST_CALL (matmul_size): on a CPU without
    fp16 units a 1024x1024 fp16 matmul takes 2 s (1 GFLOP/s; 2.8 at 512), and the timing took 13 s."""
    import torch

    from ember.device import DTYPES
    with _timing(threads) as others:
        gen = torch.Generator().manual_seed(0)  # never the global RNG: a run's stream stays its own
        probe = min(size, PROBE_SIZE)
        a, b = (torch.randn(probe, probe, generator=gen).to(DTYPES[dtype]) for _ in range(2))
        a @ b  # a first call pays for setting up the kernel
        timed = matmul_size(min(_call_seconds(lambda: a @ b) for _ in range(2)), LONGEST_CALL, probe, size)
        a, b = (torch.randn(timed, timed, generator=gen).to(DTYPES[dtype]) for _ in range(2))
        best = 2 * timed ** 3 / _best_seconds(lambda: a @ b, WINDOW, rounds)
        return CpuPeak(best, time.time(), others(), size=timed if timed != size else 0)


PROBE_SIZE = 256    # the matmul two calls of which are timed first, to size the measured one
WINDOW = 0.1        # seconds of each timing window
LONGEST_CALL = 0.5  # a call predicted longer is timed at a smaller size: far above fp32's and bf16's
                    # 1024 (10-20 ms here), so a busy machine does not shrink them; fp16 here: 670 ms


def matmul_size(probe_seconds: float, longest: float, probe: int, largest: int) -> int:
    """The largest of `largest` and `probe` doubled below it whose one call is predicted within
    `longest` seconds (a matmul's time grows as its size cubed from the probe's `probe_seconds`);
    `probe` at least."""
    sizes = [largest, *(probe << k for k in range(8) if probe << k < largest)]
    return max((n for n in sizes if probe_seconds * (n / probe) ** 3 <= longest), default=probe)


def measured_cpu_peak(threads: int, again: bool = False, size: int = 1024, rounds: int = 5,
                      dtype: str = "fp32") -> Peak:
    """Matmul FLOP/s in `dtype` measured on this CPU with `threads` threads (see time_matmul),
    cached per machine and dtype with its date and load and measured again when stale (see
    choose_cpu_peak). `again`: measure anew, keeping the higher of the two."""
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"no CPU matmul peak for dtype {dtype!r}: one of {', '.join(MATMUL_DTYPES)}")
    key = cpu_peak_key(threads) + ("" if dtype == "fp32" else f":{dtype}")  # fp32's key as before
    peak, how = cached_cpu_rate(key, lambda: time_matmul(threads, size, rounds, dtype), again)
    timed = peak.size or size
    return Peak(peak.flops, f"{how}: {dtype} {timed}x{timed} matmul, {threads} threads")


def cached_cpu_rate(key: str, measure: Callable[[], CpuPeak], again: bool = False) -> tuple[CpuPeak, str]:
    """A rate of this CPU (higher is better) from the cache of measured CPU rates under `key`, or
    `measure`d when stale (see choose_cpu_peak), and when and under what load it was measured."""
    cache = home().cpu_peak_cache
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    record = _from_json(known.get(key))
    loaded = record is not None and record.others is not None and record.others > LOADED
    others_now = others_share() if loaded and not again else None  # only a loaded record needs it
    peak, why = choose_cpu_peak(record, time.time(), others_now, measure, again)
    if why is not None:
        known[key] = {"flops": peak.flops, "at": peak.at, "others": peak.others} | \
            ({"per_call": peak.per_call} if peak.per_call else {}) | ({"size": peak.size} if peak.size else {})
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known))
    return peak, peak.describe() + (f" (measured again: {why})" if why is not None and record is not None else "")


def _from_json(value: object) -> CpuPeak | None:
    """A cached record (a bare number from before records carried their date and load: None)."""
    if not isinstance(value, dict):
        return None
    try:
        others = value.get("others")
        return CpuPeak(float(value["flops"]), float(value["at"]), None if others is None else float(others),
                       float(value.get("per_call", 0.0)), int(value.get("size", 0)))
    except (KeyError, TypeError, ValueError):
        return None


def cpu_peak_key(threads: int) -> str:
    """This machine's entry in the cache of measured CPU peaks."""
    # torch's version without importing torch (the same string as torch.__version__): planning
    # from a cached peak stays torch-free
    return f"{os.uname().nodename}:{os.cpu_count()}:{threads}:{importlib.metadata.version('torch')}"


DEQUANT_SIZES = (64, 256, 1024)  # square weights the 4-bit linear is timed at, for its fixed and per-byte cost


def measured_dequant_rate(threads: int, bytes_of: Callable[[int], int]) -> Bandwidth:
    """What a 4-bit (NF4) linear call of bitsandbytes costs on this CPU with `threads` threads
    beyond a plain linear's, as fixed seconds per call plus `bytes_of(n)` bytes (per n-weight
    dequantization) over a rate (see time_dequant), cached with the CPU peak by the same rules
    (the record's 'flops' holds bytes/s, 'per_call' the seconds)."""
    try:
        rate, how = cached_cpu_rate(f"nf4 linear, {cpu_peak_key(threads)}", lambda: time_dequant(threads, bytes_of))
    except NothingMeasured as e:
        return Bandwidth(None, f"{e}: set [cost] memory_gbps")
    sizes = ", ".join(f"{n}x{n}" for n in DEQUANT_SIZES)
    return Bandwidth(rate.flops, f"{how}: bitsandbytes' NF4 linear over a plain one at {sizes}, {threads} threads, "
                                 f"{rate.per_call * 1e6:,.1f} µs a call + its bytes at {rate.flops / 1e9:.3g} GB/s",
                     rate.per_call)


NOISE = 0.1  # a timing within this share of another's is no difference (4-bit linears here: 1.7-4x the plain one)


class NothingMeasured(Exception):
    """A timing whose difference was lost in noise: no rate can be fitted to it."""


def time_dequant(threads: int, bytes_of: Callable[[int], int], rows: int = 4, window: float = 0.05) -> CpuPeak:
    """bitsandbytes' NF4 linear (double quantization, blocks of 64: forward through its fused 4-bit
    matmul, backward dequantizing) against a plain fp32 linear, both forward and backward on
    `rows` rows, at each of DEQUANT_SIZES: the extra seconds per call, fitted by least squares as
    a fixed cost per call plus `bytes_of(n)` bytes over a rate. The two are timed taking turns
    (_fastest_each, about 3 x `window` seconds each); the record holds other processes' share of
    the cores meanwhile."""
    import torch
    bnb = _quiet_bitsandbytes()
    with _timing(threads) as others:
        gen = torch.Generator().manual_seed(0)  # never the global RNG: a run's stream stays its own
        points = []
        for n in DEQUANT_SIZES:
            w, x = torch.randn(n, n, generator=gen), torch.randn(rows, n, generator=gen).requires_grad_()
            codes, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
            four, plain = _fastest_each([lambda: bnb.matmul_4bit(x, codes.t(), quant_state=state).sum().backward(),
                                         lambda: torch.nn.functional.linear(x, w).sum().backward()], window)
            extra = four - plain if four > plain * (1 + NOISE) else 0.0  # within NOISE: no difference seen
            points.append((float(bytes_of(n * n)), extra / 2))  # a forward and a backward call
        if not any(seconds > 0 for _, seconds in points):
            share = others()
            raise NothingMeasured(f"bitsandbytes' NF4 linear timed no slower than a plain one (within {NOISE:.0%}) "
                                  f"on this CPU" + (f" (other processes using {share:.0%} of the cores)"
                                                    if share is not None else ""))
        per_call, per_byte = _line(points)
        return CpuPeak(1 / per_byte, time.time(), others(), per_call)


def _quiet_bitsandbytes():
    import logging
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)  # its import warns about optional CPU kernels it does not need here
    try:
        import bitsandbytes
        return bitsandbytes
    finally:
        log.setLevel(level)


def _call_seconds(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _best_seconds(call: Callable[[], object], window: float, rounds: int = 3) -> float:
    """Seconds one `call` takes: the best of `rounds` windows of `window` seconds (after a warm-up)."""
    call()
    best = float("inf")
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window:
            call()
            n += 1
        best = min(best, (time.perf_counter() - t0) / n)
    return best


SAMPLE_SECONDS = 0.002  # a sample of _fastest_each: short beside a scheduler's time slice (a few ms)


def _fastest_each(calls: list[Callable[[], object]], window: float, rounds: int = 3) -> list[float]:
    """Seconds each of `calls` takes at its fastest, for a difference of two: after a warm-up the
    calls take turns, sample by sample (each about SAMPLE_SECONDS: one call, or as many as fill
    it), for about `rounds` x `window` seconds each, and each keeps its least seconds per call.
    Where other processes share the cores, a sample they preempt (or, at several threads, one
    thread of) runs long and a short one mostly does not; taking turns keeps one call from being
    timed only while the machine was busy. Timed one after the other, each the best of three
    long windows, the difference came out anything from 0 to 30 ms a call under load (QLoRA's
    4-bit calls priced free, and `ember plan --fit` picked QLoRA over a faster LoRA)."""
    reps = []
    for call in calls:
        call()  # warm-up
        t0 = time.perf_counter()
        call()
        reps.append(max(1, int(SAMPLE_SECONDS / max(time.perf_counter() - t0, 1e-9))))
    best = [float("inf")] * len(calls)
    spent, budget = 0.0, rounds * window * len(calls)
    while spent < budget:
        for i, (call, n) in enumerate(zip(calls, reps)):
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            took = time.perf_counter() - t0
            best[i], spent = min(best[i], took / n), spent + took
    return best


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of seconds = fixed + bytes x per_byte over (bytes, seconds) points, neither
    below what noise can make of them: fixed >= 0, per_byte > 0 (else the average of the largest
    point with seconds above 0; time_dequant refuses to fit points none of which is)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    per_byte = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    if per_byte <= 0:
        x, y = max(points, key=lambda p: (p[1] > 0, p[0]))  # the largest with some seconds
        return 0.0, max(y, 1e-12) / x
    return max(0.0, my - per_byte * mx), per_byte


def with_op_cost(peak: Peak, device_type: str, threads: int, given: bool = False) -> Peak:
    """`peak` with the fixed seconds each recomputed op costs: measured on a CPU (see
    time_recompute), cached with the CPU peak by the same rules; 0 on an accelerator (not measured:
    its ops are queued, their fixed cost overlaps the previous op's compute), and 0 where the
    recipe `given` its peak ([cost] peak_tflops: the user's figure prices the step, nothing is
    measured, and the plan stays torch-free)."""
    if device_type != "cpu" or not peak.flops or given:
        return peak
    threads = threads or os.cpu_count() or 1
    rate, how = cached_cpu_rate(f"recomputed op, {cpu_peak_key(threads)}", lambda: time_recompute(threads))
    return replace(peak, per_op_s=1 / rate.flops,
                   source=f"{peak.source}; recomputed ops {1e6 / rate.flops:.1f} µs each ({how})")


def time_recompute(threads: int, width: int = 64, rows: int = 4, blocks: int = 4, window: float = 0.05) -> CpuPeak:
    """Seconds each op activation checkpointing recomputes costs on this CPU with `threads`
    threads: `blocks` small gated blocks (width `width`, `rows` rows) forward and backward, each
    checkpointed (as ember's models are: non-reentrant) against the same without, the extra time
    over the extra ops counted (the record's 'flops' holds ops/s). The two are timed taking turns
    (_fastest_each)."""
    import torch
    from torch.utils.checkpoint import checkpoint
    gen = torch.Generator().manual_seed(0)  # never the global RNG: a run's stream stays its own
    ws = [torch.randn(width, width, generator=gen).requires_grad_() for _ in range(3 * blocks)]
    x = torch.randn(rows, width, generator=gen).requires_grad_()

    def block(h, i):
        a, b, c = ws[3 * i:3 * i + 3]
        return h + torch.nn.functional.silu(h @ a) * (h @ b) @ c

    def step(ac: bool):
        h = x
        for i in range(blocks):
            h = checkpoint(block, h, i, use_reentrant=False) if ac else block(h, i)
        h.sum().backward()
    with _timing(threads) as others:
        extra_ops = count_ops(lambda: step(True)) - count_ops(lambda: step(False))
        checkpointed, plain = _fastest_each([lambda: step(True), lambda: step(False)], window)
        extra = max(0.0, checkpointed - plain)
        return CpuPeak(extra_ops / max(extra, 1e-12), time.time(), others())


def count_ops(call: Callable[[], object], which: Callable[[str], bool] = lambda name: True) -> int:
    """Ops (aten and others) `call` dispatches whose name `which` accepts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += bool(which(str(func)))
            return func(*args, **(kwargs or {}))
    with Count() as counted:
        call()
    return counted.n
