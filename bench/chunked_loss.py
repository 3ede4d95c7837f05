"""The memory-efficient (chunked) loss against the plain one, in the same run: measured peak of a
step and median step time, on models whose batch x seq x vocab logits dominate the peak.

usage: python bench/chunked_loss.py [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CASES = [  # model (bench/plan_accuracy.py), micro batch, seq_len, method, chunk
    ("smol-42M", 4, 256, "lora", 256),
    ("smol-42M", 4, 256, "full", 256),
    ("llama-25M", 8, 256, "full", 512),
]


def one(case: list, steps: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from bench.plan_accuracy import config
    from ember.plan.measure import step_peak
    from ember.recipe import MethodConfig
    from ember.train.loss import causal_lm_loss
    from ember.train.model import apply_lora, trainable_parameters
    name, b, s, method, chunk = case
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = LlamaForCausalLM(config(name))
    if method == "lora":
        model = apply_lora(model, MethodConfig(kind="lora"))
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (b, s))

    def step() -> None:
        causal_lm_loss(model, ids, chunk).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    peak = step_peak(step, torch.device("cpu"))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak": peak, "step": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one), args.steps)))
        return
    print(f"{'model':10} {'b':>2} {'seq':>4} {'method':6} {'chunk':>5} {'plain peak':>11} {'chunked':>9} "
          f"{'saved':>7} {'plain step':>11} {'chunked':>8} {'time':>6}")
    for name, b, s, method, chunk in CASES:
        res = []
        for c in (0, chunk):
            out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one",
                                  json.dumps([name, b, s, method, c])], capture_output=True, text=True,
                                 check=True, cwd=ROOT)
            res.append(json.loads(out.stdout.splitlines()[-1]))
        plain, chunked = res
        print(f"{name:10} {b:>2} {s:>4} {method:6} {chunk:>5} {plain['peak'] / 2**20:10.1f}M "
              f"{chunked['peak'] / 2**20:8.1f}M {1 - chunked['peak'] / plain['peak']:7.1%} "
              f"{plain['step']:10.3f}s {chunked['step']:7.3f}s {chunked['step'] / plain['step'] - 1:+6.1%}",
              flush=True)


if __name__ == "__main__":
    main()
