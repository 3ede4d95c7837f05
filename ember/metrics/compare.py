"""Compare two runs: recipe, manifest and data differences, and per-step losses. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
        d = abs(losses_a[step] - losses_b[step])
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

