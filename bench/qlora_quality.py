"""QLoRA against LoRA on the demo job (issue 30: "loss after N steps within the spread of LoRA's
across seeds"): examples/smollm2-lora.toml (SmolLM2-135M-Instruct, LoRA rank 8 on the attention
projections, the King James Bible, micro batch 4 x 128) run with `ember run` for each seed, as
written (LoRA over the fp32 base) and with `--set method.quantize=nf4` (QLoRA: the base's
linears in 4-bit NF4), the two methods alternating, each run a process of its own with its own
$EMBER_HOME model cache shared. Prints each run's loss curve (every --every steps, and the mean of
the last --tail steps, which is what is compared: one step's loss moves with its batch), and
whether QLoRA's mean sits within LoRA's range across the seeds.

usage: python bench/qlora_quality.py [--seeds 0 1 2] [--steps 60] [--every 10] [--tail 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "smollm2-lora.toml"
METHODS = {"lora": [], "qlora": ["--set", "method.quantize=nf4"]}


def run(out: Path, seed: int, steps: int, extra: list[str]) -> tuple[list[tuple[int, float]], float]:
    """One `ember run` of the demo recipe: its (step, loss) and its wall-clock seconds."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ember", "run", str(RECIPE), "--out", str(out), "--no-ledger",
                           "--set", f"train.seed={seed}", "--set", f"train.max_steps={steps}",
                           "--set", "checkpoint.every_steps=0", *extra], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{out.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r], time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--tail", type=int, default=10)
    args = ap.parse_args()
    if not (ROOT / "examples" / "data" / "kjv.jsonl").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "prepare_kjv.py"),
                        str(ROOT / "examples" / "data" / "kjv.jsonl")], check=True)
    curves: dict[tuple[str, int], list[tuple[int, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ember-bench-qlora-") as tmp:
        for seed in args.seeds:
            for method, extra in METHODS.items():
                curves[method, seed], seconds = run(Path(tmp) / f"{method}-{seed}", seed, args.steps, extra)
                print(f"{method} seed {seed}: {seconds:.0f} s", file=sys.stderr, flush=True)
    marks = list(range(args.every, args.steps + 1, args.every))
    print(f"| run | {' | '.join(f'step {s}' for s in marks)} | mean of the last {args.tail} |")
    print("| --- |" + " ---: |" * (len(marks) + 1))
    tails: dict[str, list[float]] = {m: [] for m in METHODS}
    for (method, seed), curve in curves.items():
        loss = dict(curve)
        tail = statistics.fmean(v for s, v in curve if s > args.steps - args.tail)
        tails[method].append(tail)
        print(f"| {method}, seed {seed} | " + " | ".join(f"{loss[s]:.3f}" for s in marks) + f" | {tail:.4f} |")
    lo, hi = min(tails["lora"]), max(tails["lora"])
    q = statistics.fmean(tails["qlora"])
    print(f"\nLoRA across seeds {lo:.4f}..{hi:.4f} (mean {statistics.fmean(tails['lora']):.4f}); QLoRA "
          f"{min(tails['qlora']):.4f}..{max(tails['qlora']):.4f} (mean {q:.4f}): QLoRA's mean "
          f"{'within' if lo <= q <= hi else 'outside'} LoRA's range")


if __name__ == "__main__":
    main()
