"""A run's per-step curves for drawing: read from metrics.jsonl (and followed as it grows), and
downsampled so that a run of any length draws fast with its spikes still visible.

    downsample(xs, ys, buckets)   pure: split the x range into `buckets` runs of points and keep
                                  the lowest and the highest point of each, in x order, so a one-step
                                  spike survives any reduction (the min/max, or M4-style, reduction)
    curves(run, fields, ...)      the run's surviving steps, field by field, downsampled (the file is
                                  kept as columns for the next request, extended as it grows)
    follow(run, offset)           the lines appended since byte `offset`: what a live view adds
"""

from __future__ import annotations

import bisect
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.errors import BadInput
from ember.jsonl import loads

CURVE_FIELDS = ("loss", "lr", "grad_norm", "step_seconds", "eval_loss")
DEFAULT_BUCKETS = 1000


def downsample(xs: list[float], ys: list[float | None], buckets: int) -> tuple[list[float], list[float]]:
    """At most 2 x `buckets` points of (xs, ys): per bucket of consecutive points, its minimum and
    its maximum (once if they are the same point), in x order. Points whose y is None or not
    finite are left out. Fewer points than 2 x `buckets` come back unchanged (less the gaps)."""
    if buckets < 1:
        raise ValueError(f"buckets {buckets}: must be >= 1")
    keep = [i for i, y in enumerate(ys) if y is not None and math.isfinite(y)]
    if len(keep) < len(ys):
        xs, ys = [xs[i] for i in keep], [ys[i] for i in keep]
    n = len(ys)
    if n <= 2 * buckets:
        return list(xs), list(ys)
    out_x: list[float] = []
    out_y: list[float] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        segment = ys[lo:hi]  # min, max and index run in C: 100,000 points in milliseconds
        i, j = lo + segment.index(min(segment)), lo + segment.index(max(segment))
        for k in ((i, j) if i < j else (j, i) if j < i else (i,)):
            out_x.append(xs[k])
            out_y.append(ys[k])
    return out_x, out_y


@dataclass
class Curve:
    """One field's points to draw: x (steps) and y, at most 2 x buckets of them."""
    field: str
    steps: list[int]
    values: list[float]


@dataclass
class Curves:
    run_id: str | None
    points: int                      # surviving steps in the range, before downsampling
    first_step: int | None
    last_step: int | None
    buckets: int
    offset: int                      # bytes of metrics.jsonl read: where `follow` goes on from
    curves: list[Curve] = field(default_factory=list)
    lost_steps: list[int] = field(default_factory=list)  # steps computed again after a resume


def read_records(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The complete JSON lines of `path` from byte `offset`, and the offset after the last one
    (a line being written, without its newline yet, is left for the next read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            records.append(loads(line))
        except ValueError:
            continue  # a torn line (a crash mid-write): `ember report` notes it; a chart skips it
    return records, offset + end


@dataclass
class Columns:
    """A metrics.jsonl as columns of the curve fields, and how far it was read."""
    key: tuple[int, int]                  # (inode, bytes read): a longer file with the same inode is extended
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=lambda: {k: [] for k in CURVE_FIELDS})

    def extend(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            if "step" not in r:
                continue
            if self.steps and r["step"] <= self.steps[-1]:
                continue  # only a rewound file repeats steps, and a rewound file is read anew
            self.steps.append(r["step"])
            for k in CURVE_FIELDS:
                self.values[k].append(finite(r.get(k)))


_columns: dict[str, Columns] = {}      # the newest few files read, for the zooms and reloads that follow
_columns_lock = threading.Lock()
COLUMNS_KEPT = 4


def columns(path: Path) -> Columns:
    """The curve fields of metrics.jsonl at `path`: read once, then only what was appended."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Columns((0, 0))
    with _columns_lock:
        cached = _columns.get(str(path))
    if cached is not None and cached.key == (st.st_ino, st.st_size):
        return cached
    if cached is not None and cached.key[0] == st.st_ino and cached.key[1] < st.st_size:
        grown = Columns((st.st_ino, 0), list(cached.steps), {k: list(v) for k, v in cached.values.items()})
        records, end = read_records(path, cached.key[1])
    else:
        grown = Columns((st.st_ino, 0))
        records, end = read_records(path)
    grown.extend(records)
    grown.key = (st.st_ino, end)
    with _columns_lock:
        _columns.pop(str(path), None)
        _columns[str(path)] = grown
        while len(_columns) > COLUMNS_KEPT:
            _columns.pop(next(iter(_columns)))
    return grown


def curves(run: Path, run_id: str | None, fields: tuple[str, ...] = CURVE_FIELDS, start: float | None = None,
           end: float | None = None, buckets: int = DEFAULT_BUCKETS) -> Curves:
    """The run's steps in [start, end] (all by default), each field downsampled to `buckets`."""
    unknown = set(fields) - set(CURVE_FIELDS)
    if unknown:
        raise BadInput(f"unknown curve(s) {sorted(unknown)}; known: {', '.join(CURVE_FIELDS)}")
    if not 1 <= buckets <= 100_000:
        raise BadInput(f"buckets {buckets}: between 1 and 100000")
    cols = columns(run / "metrics.jsonl")
    lost, _ = read_records(run / "metrics.lost.jsonl")
    lo = 0 if start is None else bisect.bisect_left(cols.steps, start)
    hi = len(cols.steps) if end is None else bisect.bisect_right(cols.steps, end)
    steps = cols.steps[lo:hi]
    out = Curves(run_id, len(steps), steps[0] if steps else None, steps[-1] if steps else None, buckets,
                 cols.key[1], lost_steps=sorted({r["step"] for r in lost if "step" in r}))
    for name in fields:
        xs, ys = downsample(steps, cols.values[name][lo:hi], buckets)
        out.curves.append(Curve(name, xs, ys))
    return out


def follow(run: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Steps appended to metrics.jsonl since byte `offset`, as {step, loss, lr, ...} of the curve
    fields; a file that shrank (rewound after a rollback) is read again from its start."""
    try:
        size = os.stat(run / "metrics.jsonl").st_size
    except FileNotFoundError:
        return [], 0
    if size < offset:
        offset = 0
    records, offset = read_records(run / "metrics.jsonl", offset)
    return [{"step": r["step"], **{k: finite(r.get(k)) for k in CURVE_FIELDS}} for r in records if "step" in r], offset


def finite(value: Any) -> float | None:
    """A figure of a step, or None: not a number, or not finite (a step the stability guard skipped
    for a NaN loss; JSON has no NaN, and the live chart shows a gap there as the curves do)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)
