"""Compare two runs: recipe, manifest and data differences, per-step losses (pure), and the
one check of whether two folders of final weights are bit-identical."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ember.errors import EmberError
from ember.metrics.heldout import HeldOutComparison
from ember.metrics.heldout import compare as compare_held_out
from ember.metrics.heldout import generations, history
from ember.recipe import diff_recipes
from ember.recipe import get_dotted as _get

MANIFEST_KEYS = ("ember", "python", "torch", "platform", "hostname", "devices", "seed", "threads",
                 "determinism", "env")


@dataclass
class Comparison:
    verdict: str                       # identical | close | diverged | incomparable
    tolerance: float
    steps_compared: int
    first_differing_step: int | None
    max_abs_difference: float
    recipe_changes: dict[str, list[Any]] = field(default_factory=dict)
    manifest_changes: dict[str, list[Any]] = field(default_factory=dict)
    packages_changed: list[str] = field(default_factory=list)
    data_fingerprint_equal: bool = True
    weights_equal: bool | None = None
    held_out: HeldOutComparison | None = None  # the newest evaluation of each, when both have one
    generations: list[dict[str, Any]] = field(default_factory=list)  # per prompt both completed: prompt, a, b (newest)


def compare_runs(a: dict[str, Any], b: dict[str, Any], losses_a: dict[int, float],
                 losses_b: dict[int, float], tolerance: float,
                 weights_equal: bool | None = None) -> Comparison:
    """`a`, `b` are run records (run.json); losses map step -> loss."""
    recipe_keys = diff_recipes(a["recipe"], b["recipe"])
    recipe_changes = {k: [_get(a["recipe"], k), _get(b["recipe"], k)] for k in recipe_keys}
    ma, mb = a.get("manifest", {}), b.get("manifest", {})
    manifest_changes = {k: [ma.get(k), mb.get(k)] for k in MANIFEST_KEYS if ma.get(k) != mb.get(k)}
    pa, pb = set(ma.get("packages", [])), set(mb.get("packages", []))
    common = sorted(set(losses_a) & set(losses_b))
    first, worst = None, 0.0
    for step in common:
        d = distance(losses_a[step], losses_b[step])
        if d != 0 and first is None:
            first = step
        worst = max(worst, d)
    if not common:
        verdict = "incomparable"
    elif first is None and (weights_equal is not False) and len(losses_a) == len(losses_b):
        verdict = "identical"
    elif worst <= tolerance:
        verdict = "close"
    else:
        verdict = "diverged"
    return Comparison(verdict, tolerance, len(common), first, worst, recipe_changes, manifest_changes,
                      sorted(pa ^ pb), a.get("data_fingerprint") == b.get("data_fingerprint"),
                      weights_equal)


def distance(x: float, y: float) -> float:
    """|x - y| of two steps' losses; two NaNs (a step with no learned token in both runs, or a
    non-finite step in both) are the same; one NaN is as far as can be."""
    if math.isnan(x) or math.isnan(y):
        return 0.0 if math.isnan(x) and math.isnan(y) else math.inf
    return abs(x - y)


# `ember compare` and `ember repro` exit with the verdict's code, so scripts can branch on it
# (1 stays "error", 2 "bad usage").
VERDICT_EXIT = {"identical": 0, "close": 3, "diverged": 4, "incomparable": 5}


def weight_differences(a: Path, b: Path, limit: int = 3) -> list[str] | None:
    """How the safetensors files in folders `a` and `b` differ, tensor by tensor, bit for bit (dtype,
    shape and bytes; at most `limit` names per file); [] when bit-identical; None when either
    folder holds no weights. Read from the files' own headers, without torch: the service and the
    dashboard compare runs too, and never load torch."""
    fa, fb = sorted(a.glob("*.safetensors")), sorted(b.glob("*.safetensors"))
    if not fa or not fb:
        return None
    if [p.name for p in fa] != [p.name for p in fb]:
        return [f"different files: {[p.name for p in fa]} vs {[p.name for p in fb]}"]
    out = []
    for x, y in zip(fa, fb):
        with open(x, "rb") as f, open(y, "rb") as g:
            ta, tb = _tensors(f), _tensors(g)
            if ta.keys() != tb.keys():
                out.append(f"{x.name}: different tensor names")
                continue
            differ = [k for k in sorted(ta) if ta[k][:2] != tb[k][:2] or not _same_bytes(f, ta[k][2], g, tb[k][2])]
        out += [f"{x.name}: {k} differs" for k in differ][:limit]
    return out


def _tensors(f: BinaryIO) -> dict[str, tuple[str, list[int], tuple[int, int]]]:
    """A safetensors file's tensors: name -> (dtype, shape, absolute byte range), from its header
    (8 bytes little-endian length, then JSON with each tensor's data_offsets after the header)."""
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]))
            for k, v in header.items()}


def _same_bytes(f: BinaryIO, ra: tuple[int, int], g: BinaryIO, rb: tuple[int, int], chunk: int = 1 << 24) -> bool:
    if ra[1] - ra[0] != rb[1] - rb[0]:
        return False
    f.seek(ra[0])
    g.seek(rb[0])
    left = ra[1] - ra[0]
    while left > 0:
        n = min(chunk, left)
        if f.read(n) != g.read(n):
            return False
        left -= n
    return True


def check_tolerance(tolerance: float) -> None:
    """Refuse a --tolerance no loss difference can be within (negative, nan): every verdict
    would be 'diverged', whatever the runs did."""
    if not tolerance >= 0:  # nan too: it compares false with everything
        raise EmberError(f"--tolerance {tolerance:g}: must be a number >= 0 (the largest absolute loss "
                         f"difference still called close; default 1e-3)")


def compare_folders(a: Path, b: Path, tolerance: float) -> Comparison:
    """Compare two run folders: their records, per-step losses and final weights."""
    from ember.runfolder import read_metrics, read_record

    check_tolerance(tolerance)

    def losses(path: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_metrics(path / "metrics.jsonl", [])}
    diffs = weight_differences(a / "final", b / "final")
    c = compare_runs(read_record(a), read_record(b), losses(a), losses(b), tolerance,
                     None if diffs is None else not diffs)
    ea, eb = history(a), history(b)
    if ea and eb:
        c.held_out = compare_held_out(ea[-1], eb[-1])
    ga, gb = generations(a), {g["prompt"]: g for g in generations(b)}
    c.generations = [{"prompt": g["prompt"], "step_a": g["step"], "a": g["completion"],
                      "step_b": gb[g["prompt"]]["step"], "b": gb[g["prompt"]]["completion"]}
                     for g in ga if g["prompt"] in gb]
    return c
