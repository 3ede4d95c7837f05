"""A run's held-out evaluations (OUT/eval/step-N.json, written by ember.train.evaluate), and
whether two runs' held-out losses differ by more than the noise of the eval set. Pure arithmetic
over the kept per-row figures.

The method: both runs evaluated the same rows (same split, packing and seq_len) -> a paired
bootstrap over rows of the token-weighted loss difference (rows resampled with replacement,
2,000 times, seeded, 95% interval); otherwise the two losses are resampled independently.
A difference whose interval contains 0 is "within the noise of the eval set".
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.jsonl import read_jsonl

EVAL_DIR = "eval"
GENERATIONS = "generations.jsonl"  # in EVAL_DIR: one line per prompt per evaluation
RESAMPLES = 2000
CONFIDENCE = 0.95


def generations(run: Path, last_step: int | None = None) -> list[dict[str, Any]]:
    """The newest evaluation's greedy completions (of [eval] prompts) kept by a run, at or
    before `last_step` when given: step, prompt, rendered (what the model was given),
    completion, tokens."""
    kept = [g for g in read_jsonl(run / EVAL_DIR / GENERATIONS) if last_step is None or g["step"] <= last_step]
    newest = max((g["step"] for g in kept), default=None)
    return [g for g in kept if g["step"] == newest]


def history(run: Path) -> list[dict[str, Any]]:
    """Every evaluation a run folder kept that measured a loss, oldest first (one over no
    learned token has no loss: it is kept on disk with its count, and left out here)."""
    folder = run / EVAL_DIR
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.glob("step-*.json")):
        try:
            kept = json.loads(p.read_text())
        except (OSError, ValueError):  # written durably and whole; unreadable means damaged: skip it
            continue
        if "loss" in kept:
            out.append(kept)
    return out


@dataclass
class HeldOutComparison:
    step_a: int
    step_b: int
    loss_a: float
    loss_b: float
    difference: float          # loss_b - loss_a
    low: float                 # the interval of the difference
    high: float
    rows: int
    paired: bool
    method: str

    @property
    def within_noise(self) -> bool:
        return self.low <= 0.0 <= self.high

    def text(self) -> str:
        verdict = ("within the noise of the eval set" if self.within_noise else
                   f"run B is {'lower' if self.difference < 0 else 'higher'} beyond the noise of the eval set")
        return (f"held-out loss {self.loss_a:.4f} (step {self.step_a}) vs {self.loss_b:.4f} (step {self.step_b}): "
                f"{self.difference:+.4f}, 95% interval [{self.low:+.4f}, {self.high:+.4f}] over {self.rows} rows "
                f"({self.method}): {verdict}")


def _weighted(losses: list[float], tokens: list[int], picks: list[int]) -> float:
    return sum(losses[i] for i in picks) / max(1, sum(tokens[i] for i in picks))


def compare(a: dict[str, Any], b: dict[str, Any]) -> HeldOutComparison:
    """B's held-out loss against A's (two kept evaluations), with the noise of the eval set."""
    la, ta, lb, tb = a["row_loss"], a["row_tokens"], b["row_loss"], b["row_tokens"]
    rng = random.Random(0)
    paired = len(la) == len(lb) and ta == tb and len(la) > 0
    if paired:
        n = len(la)
        diff = [x - y for x, y in zip(lb, la)]
        spread = sorted(_weighted(diff, ta, rng.choices(range(n), k=n)) for _ in range(RESAMPLES))
        method = "paired bootstrap over the same rows"
    else:
        spread = sorted(_weighted(lb, tb, rng.choices(range(len(lb)), k=len(lb)))
                        - _weighted(la, ta, rng.choices(range(len(la)), k=len(la))) for _ in range(RESAMPLES))
        method = "independent bootstrap (the runs evaluated different rows)"
    tail = int(RESAMPLES * (1 - CONFIDENCE) / 2)
    loss_a, loss_b = a["loss"], b["loss"]
    return HeldOutComparison(a["step"], b["step"], loss_a, loss_b, loss_b - loss_a, spread[tail],
                             spread[-1 - tail], max(len(la), len(lb)), paired, method)
