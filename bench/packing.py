"""Packing strategies on the same chat data: tokens/s and losses at equal steps.

Chat records made from the shipped Genesis text (a verse asked for, the next verse answered;
lengths spread from a few to a few hundred tokens), trained with each `[data] packing`: `mixed`
(the stream cut every seq_len tokens, documents attending to each other), `documents` (whole
records, positions restarting, block-diagonal attention), `padded` (one record per row, padded to
the longest of its length-sorted bucket). Same model, seed, steps and micro-batch; rounds
alternate so drift in machine speed hits all alike. Reported: learned tokens per second (median
over steps after warm-up, then over rounds), the last training loss, and the held-out loss of
the final weights, measured the same way for all three (documents packing of the held-out
records: no contamination) so the losses compare. Also: evaluation's share of wall-clock at the
default interval ([eval] every_steps = 50).

usage: python bench/packing.py [--rounds 2] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ember.ckpt.state import DataCursor  # noqa: E402
from ember.events import Events  # noqa: E402
from ember.recipe import build_recipe  # noqa: E402
from ember.data.loader import PackedBatches, eval_tokens  # noqa: E402
from ember.train.evaluate import evaluating, split_loss  # noqa: E402
from ember.train.job import prepare  # noqa: E402
from ember.train.loop import train  # noqa: E402

MODES = ("mixed", "documents", "padded")


def chat_records(path: Path) -> None:
    verses = []
    for line in (ROOT / "examples/data/genesis.jsonl").read_text().splitlines():
        verses += [v.strip() for v in re.split(r"(?<=[.:;?])\s+", json.loads(line)["text"]) if v.strip()]
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(len(verses) - 3):
            k = rng.choice((1, 1, 2, 3))  # answers of one to three verses: a spread of lengths
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What follows: {verses[i]}"},
                {"role": "assistant", "content": " ".join(verses[i + 1:i + 1 + k])}]}) + "\n")


def run(mode: str, data: Path, steps: int, home: Path, every: int = 0) -> tuple[dict, Path, object]:
    raw = {"model": {"path": "builtin:tiny"},
           "data": {"files": [str(data)], "seq_len": 512, "packing": mode},
           "train": {"max_steps": steps, "micro_batch": 8, "seed": 0, "threads": 0},
           "checkpoint": {"every_steps": 0, "keep_last": 1},
           "eval": {"holdout": 0.05, "every_steps": every, "at_end": every > 0}}
    out = Path(tempfile.mkdtemp(dir=home))
    job = prepare(build_recipe(raw, "bench"), out, False, Events())
    t0 = time.perf_counter()
    train(job)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    kept = rows[5:]
    per_step = [r["tokens"] / r["step_seconds"] for r in kept]
    eval_seconds = sum(json.loads(p.read_text())["seconds"] for p in (out / "eval").glob("*.json")) \
        if (out / "eval").is_dir() else 0.0
    return ({"tokens_per_second": statistics.median(per_step), "loss": statistics.fmean(r["loss"] for r in rows[-10:]),
             "learned_per_step": statistics.fmean(r["tokens"] for r in rows), "wall": wall,
             "eval_seconds": eval_seconds}, out, job)


def held_out_loss(job) -> float:
    """The final model on the held-out records, packed as documents (the same for every mode)."""
    b = PackedBatches(eval_tokens(job.tokens_path), job.recipe.data.seq_len, 8, 0, DataCursor(), "documents", "truncate")
    rows = list(range(b.num_sequences))
    with evaluating(job.model):
        row_loss, row_tokens = split_loss(job.model, b, [rows[i:i + 8] for i in range(0, len(rows), 8)],
                                          job.device, "fp32")
    return sum(row_loss) / sum(row_tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="ember-bench-"))
    os.environ["EMBER_HOME"] = str(home)
    data = home / "chat.jsonl"
    chat_records(data)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for rnd in range(args.rounds):
        for mode in MODES:
            fig, _, job = run(mode, data, args.steps, home)
            fig["held_out"] = held_out_loss(job)
            results[mode].append(fig)
            print(f"round {rnd + 1} {mode:9s} {fig['tokens_per_second']:9,.0f} learned tok/s  loss {fig['loss']:.4f}  "
                  f"held-out {fig['held_out']:.4f}", flush=True)
    base = statistics.median(f["tokens_per_second"] for f in results["mixed"])
    print(f"\n{args.steps} steps, micro-batch 8 x seq_len 512, builtin:tiny, {torch.get_num_threads()} threads:")
    print(f"{'packing':10s} {'learned tok/s':>14s} {'vs mixed':>9s} {'learned/step':>13s} {'train loss':>11s} {'held-out':>9s}")
    for mode in MODES:
        f = results[mode]
        tps = statistics.median(x["tokens_per_second"] for x in f)
        print(f"{mode:10s} {tps:14,.0f} {tps / base:9.3f} {statistics.fmean(x['learned_per_step'] for x in f):13,.0f} "
              f"{statistics.fmean(x['loss'] for x in f):11.4f} {statistics.fmean(x['held_out'] for x in f):9.4f}")
    fig, _, _ = run("documents", data, args.steps, home, every=50)
    print(f"\nevaluation at the default interval (every 50 steps and at the end, 5% held out): "
          f"{fig['eval_seconds']:.2f} s of {fig['wall']:.2f} s = {fig['eval_seconds'] / fig['wall']:.1%} of wall-clock")


if __name__ == "__main__":
    main()
