"""Step-time spread: percentiles and stalls. Pure functions."""

from __future__ import annotations

from dataclasses import dataclass


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    p50: float
    p90: float
    p99: float
    max: float
    count: int


def spread(seconds: list[float]) -> Spread:
    return Spread(percentile(seconds, 50), percentile(seconds, 90), percentile(seconds, 99),
                  max(seconds), len(seconds))


@dataclass(frozen=True)
class Stall:
    step: int
    seconds: float
    ratio: float               # to the median
    coincided: list[str]       # what happened with it


def stalls(steps: list[dict], median: float, checkpoint_steps: set[int], first_steps: set[int],
           factor: float = 2.0) -> list[Stall]:
    """Steps slower than `factor` x median, with what coincided: the first step of an attempt
    (warm-up), a checkpoint just before it, or a data wait making up much of the excess."""
    found = []
    for s in steps:
        if s["step_seconds"] <= factor * median:
            continue
        causes = []
        if s["step"] in first_steps:
            causes.append("first step of an attempt (warm-up)")
        if s["step"] - 1 in checkpoint_steps:
            causes.append("follows a checkpoint")
        excess = s["step_seconds"] - median
        if s.get("data_wait_seconds", 0.0) >= 0.5 * excess:
            causes.append(f"data wait {s['data_wait_seconds']:.3f}s")
        found.append(Stall(s["step"], s["step_seconds"], s["step_seconds"] / median,
                           causes or ["nothing recorded"]))
    return found


@dataclass(frozen=True)
class Histogram:
    edges: list[float]        # len(counts) + 1 bin edges, ascending
    counts: list[int]


def histogram(values: list[float], bins: int = 40) -> Histogram:
    """Counts of `values` in `bins` equal-width bins from their minimum to their maximum (the last
    bin closed), as numpy.histogram does; one value, or all equal, make one bin around it."""
    if not values:
        raise ValueError("histogram of no values")
    if bins < 1:
        raise ValueError(f"bins {bins}: must be >= 1")
    lo, hi = min(values), max(values)
    if hi == lo:
        lo, hi, bins = lo - 0.5 * (abs(lo) or 1.0), hi + 0.5 * (abs(hi) or 1.0), 1
    width = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / width), bins - 1)] += 1
    return Histogram([lo + i * width for i in range(bins)] + [hi], counts)
