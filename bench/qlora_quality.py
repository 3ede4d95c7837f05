"""QLoRA against LoRA on the demo job (issue 30: "loss after N steps within the spread of LoRA's
across seeds"): examples/smollm2-lora.toml (SmolLM2-135M-Instruct, LoRA rank 8 on the attention
projections, the King James Bible, micro batch 4 x 128) run with `ember run` for each seed, as
written (LoRA over the fp32 base the GGUF file dequantizes to), with `--set method.quantize=nf4`
(QLoRA: the base's linears re-quantized to 4-bit NF4) and with `--set method.quantize=gguf` (QLoRA
over the file's own Q4_1 blocks), the methods alternating, each run a process of its own with its own
$EMBER_HOME model cache shared. Prints each run's loss curve (every --every steps, and the mean of
the last --tail steps, which is what is compared: one step's loss moves with its batch), and
whether each QLoRA's mean sits within LoRA's range across the seeds, and each run's median step
time and peak RSS against LoRA's with the same seed.

usage: python bench/qlora_quality.py [--seeds 0 1 2] [--steps 60] [--every 10] [--tail 10]
                                    [--methods qlora-nf4 qlora-gguf]
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
sys.path.insert(0, str(ROOT))
from ember.proc import dies_with_us  # noqa: E402  (after the repository is on the path)
RECIPE = ROOT / "examples" / "smollm2-lora.toml"
METHODS = {"lora": [], "qlora-nf4": ["--set", "method.quantize=nf4"], "qlora-gguf": ["--set", "method.quantize=gguf"]}


def run(out: Path, seed: int, steps: int, extra: list[str]) -> tuple[list[tuple[int, float]], list[float], int, float]:
    """One `ember run` of the demo recipe: its (step, loss), its steps' seconds, its peak RSS
    (bytes: the process's own, from wait4) and its wall-clock seconds."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "ember", "run", str(RECIPE), "--out", str(out), "--no-ledger",
                                 "--set", f"train.seed={seed}", "--set", f"train.max_steps={steps}",
                                 "--set", "checkpoint.every_steps=0", *extra], stdout=subprocess.DEVNULL, stderr=err,
                                cwd=ROOT, preexec_fn=dies_with_us())  # a killed bench leaves no run behind
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{out.name}: exit {proc.returncode}\n{err.read().decode()[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return ([(r["step"], r["loss"]) for r in rows], [r["step_seconds"] for r in rows[1:]], usage.ru_maxrss * 1024,
            time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--tail", type=int, default=10)
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                    help="which to run (lora always: it is the baseline)")
    args = ap.parse_args()
    methods = {m: METHODS[m] for m in METHODS if m == "lora" or m in args.methods}
    if not (ROOT / "examples" / "data" / "kjv.jsonl").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "prepare_kjv.py"),
                        str(ROOT / "examples" / "data" / "kjv.jsonl")], check=True)
    curves: dict[tuple[str, int], list[tuple[int, float]]] = {}
    costs: dict[tuple[str, int], tuple[list[float], int]] = {}
    with tempfile.TemporaryDirectory(prefix="ember-bench-qlora-") as tmp:
        for seed in args.seeds:
            for method, extra in methods.items():
                curves[method, seed], step_s, rss, seconds = run(Path(tmp) / f"{method}-{seed}", seed, args.steps, extra)
                costs[method, seed] = (step_s, rss)
                print(f"{method} seed {seed}: {seconds:.0f} s", file=sys.stderr, flush=True)
    marks = list(range(args.every, args.steps + 1, args.every))
    print(f"| run | {' | '.join(f'step {s}' for s in marks)} | mean of the last {args.tail} |")
    print("| --- |" + " ---: |" * (len(marks) + 1))
    tails: dict[str, list[float]] = {m: [] for m in methods}
    for (method, seed), curve in curves.items():
        loss = dict(curve)
        tail = statistics.fmean(v for s, v in curve if s > args.steps - args.tail)
        tails[method].append(tail)
        print(f"| {method}, seed {seed} | " + " | ".join(f"{loss[s]:.3f}" for s in marks) + f" | {tail:.4f} |")
    lo, hi = min(tails["lora"]), max(tails["lora"])
    print(f"\nLoRA across seeds {lo:.4f}..{hi:.4f} (mean {statistics.fmean(tails['lora']):.4f})")
    for method in [m for m in methods if m != "lora"]:
        q = statistics.fmean(tails[method])
        print(f"{method}: {min(tails[method]):.4f}..{max(tails[method]):.4f} (mean {q:.4f}): its mean "
              f"{'within' if lo <= q <= hi else 'outside'} LoRA's range")
    print("\n| method | median step s / LoRA's (same seed) | peak RSS / LoRA's (same seed) |\n| --- | ---: | ---: |")
    for method in methods:
        steps = [statistics.median(costs[method, s][0]) / statistics.median(costs["lora", s][0]) for s in args.seeds]
        rss = [costs[method, s][1] / costs["lora", s][1] for s in args.seeds]
        print(f"| {method} | {', '.join(f'{x:.3f}' for x in steps)} | {', '.join(f'{x:.3f}' for x in rss)} |")

if __name__ == "__main__":
    main()
