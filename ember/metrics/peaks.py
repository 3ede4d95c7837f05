"""Peak dense FLOP/s of known accelerators by compute dtype, and a measured CPU peak.

Figures are vendors' dense (no sparsity) tensor-core numbers for the SXM/OAM part where there
are several; fp32 means plain FP32 (TF32 is opt-in in PyTorch). An unknown device gets no
peak and a reason, never a guess: a guessed peak is how a tool reports 563% MFU.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from ember.paths import ember_home

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


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    module = torch.get_device_module(device.type)
    try:
        return module.get_device_name(device.index or 0)
    except (AttributeError, RuntimeError):
        return device.type


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
    """The one rule for the peak MFU divides by: the recipe's [cost] peak_tflops if set, else a
    measured fp32 matmul peak on a CPU (`again`: measured anew), else the table's figure for the
    device and dtype."""
    if override_tflops:
        return Peak(override_tflops * TERA, "recipe [cost] peak_tflops")
    if device_type == "cpu":
        return measured_cpu_peak(threads or os.cpu_count() or 1, again)
    return lookup_peak(name, dtype)


def measured_cpu_peak(threads: int, again: bool = False, size: int = 1024, rounds: int = 5) -> Peak:
    """fp32 matmul FLOP/s measured on this CPU with `threads` threads: the best of `rounds`
    windows of 0.1 s (load from elsewhere only slows a window down), cached per machine. `again`:
    measure anew, keeping the higher of the two (a peak measured on a busy machine comes out low)."""
    cache = ember_home() / "cache" / "cpu_peak.json"
    key = cpu_peak_key(threads)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known or again:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(0)  # never the global RNG: a run's stream stays its own
        a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
        a @ b  # warm-up
        best = 0.0
        for _ in range(rounds):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.1:
                a @ b
                n += 1
            best = max(best, 2 * size ** 3 * n / (time.perf_counter() - t0))
        torch.set_num_threads(previous)
        known[key] = max(best, known.get(key, 0.0))
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known))
    how = "measured again" if again else "measured"
    return Peak(known[key], f"{how}: fp32 {size}x{size} matmul, {threads} threads")


def cpu_peak_key(threads: int) -> str:
    """This machine's entry in the cache of measured CPU peaks."""
    return f"{os.uname().nodename}:{os.cpu_count()}:{threads}:{torch.__version__}"
