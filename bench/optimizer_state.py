"""8-bit AdamW state ([optimizer] state_dtype = 'int8', bitsandbytes) against fp32 AdamW, in the
same run: the bytes of the optimizer's state tensors (and `ember plan`'s figure for them), the
measured peak of a whole step (and the error of `ember plan`'s peak for the 8-bit step), and the
median time of the update and of the whole step. Each
variant runs in a process of its own (a clean peak), full fine-tuning, fp32, on the CPU.

usage: python bench/optimizer_state.py [--steps 5] [--threads 2]
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

CASES = [  # model (bench/plan_accuracy.py), micro batch, seq_len
    ("gqa8-10M", 2, 128),
    ("llama-25M", 2, 128),
    ("smol-42M", 2, 128),
]


def one(name: str, b: int, s: int, state_dtype: str, steps: int, threads: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from bench.plan_accuracy import config
    from ember.doctor.measure import step_peak
    from ember.plan.memory import ModelShape, TrainShape, estimate
    from ember.recipe import OptimizerConfig
    from ember.train.loss import causal_lm_loss
    from ember.train.parts import build_optimizer, state_bytes
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    cfg = config(name)
    model = LlamaForCausalLM(cfg).train()
    opt = build_optimizer(model, OptimizerConfig(lr=1e-4, state_dtype=state_dtype))
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    update: list[float] = []

    def step() -> None:
        causal_lm_loss(model, ids).backward()
        t0 = time.perf_counter()
        opt.step()
        update.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    step()  # the optimizer state exists from here on
    peak = step_peak(step, torch.device("cpu"))
    update.clear()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    shape = TrainShape(b, s, optimizer="adamw8bit" if state_dtype == "int8" else "adamw")
    planned = estimate(ModelShape.from_config(cfg), shape)
    return {"params": sum(p.numel() for p in model.parameters()), "state": state_bytes(opt),
            "planned": planned.optimizer, "peak": peak, "planned_peak": planned.peak, "update": statistics.median(update), "step": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*json.loads(args.one), args.steps, args.threads)))
        return
    print(f"{'model':10} {'params':>7} {'state fp32':>10} {'int8':>8} {'ratio':>6} {'planned':>8} "
          f"{'peak fp32':>10} {'int8':>8} {'planned':>8} {'update fp32':>11} {'int8':>7} {'step fp32':>9} {'int8':>7}")
    for name, b, s in CASES:
        res = {}
        for dtype in ("fp32", "int8"):
            out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--threads",
                                  str(args.threads), "--one", json.dumps([name, b, s, dtype])],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            res[dtype] = json.loads(out.stdout.splitlines()[-1])
        f, q = res["fp32"], res["int8"]
        mib = 2 ** 20
        print(f"{name:10} {f['params'] / 1e6:6.1f}M {f['state'] / mib:9.1f}M {q['state'] / mib:7.1f}M "
              f"{q['state'] / f['state']:6.3f} {'exact' if q['planned'] == q['state'] else q['planned'] - q['state']:>8} "
              f"{f['peak'] / mib:9.1f}M {q['peak'] / mib:7.1f}M {q['planned_peak'] / q['peak'] - 1:+8.1%} {f['update'] * 1e3:9.0f}ms {q['update'] * 1e3:5.0f}ms "
              f"{f['step']:8.3f}s {q['step']:6.3f}s")


if __name__ == "__main__":
    main()
