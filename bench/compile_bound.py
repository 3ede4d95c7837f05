"""Where the demo step's time goes, op by op, eager and compiled: what `train.compile` can gain.

Issue 31 asks for a compiled demo step at <= 0.8x HF Trainer eager. inductor fuses elementwise
work (norms, rotary, activations, the loss) into C++ kernels; the matmuls and the attention
kernel it calls as ATen finds them. So a compiled step cannot cost less than the eager step's
matmul and attention time, and that share of the eager step bounds compiled / eager from below.

The job is bench/hf_trainer.py's (examples/smollm2-lora.toml, LoRA dropout 0, 2 threads, fp32),
built with ember's own `prepare` and stepped with ember's `train_step` in this process: a few
warm-up steps, then `--steps` profiled steps with torch.profiler (self CPU time per op), eager
first, then a second job compiled (its compile in the warm-up steps, from $EMBER_HOME's cache
when warm). The ops are grouped: matmul (mm, addmm, bmm, matmul, linear), attention (the SDPA
kernels and their backward), and the rest; wall-clock per step beside them.

usage: python bench/compile_bound.py [--steps 3] [--warmup 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION = ("scaled_dot_product", "flash_attention")


def group(key: str) -> str:
    """The group an op's self time counts in."""
    if key in MATMUL:
        return "matmul"
    if any(a in key for a in ATTENTION):
        return "attention"
    return "rest"


def profile_steps(compile: bool, steps: int, warmup: int, out: Path) -> dict:
    """Median wall-clock seconds a step and the summed self CPU seconds a step per group."""
    from torch.profiler import ProfilerActivity, profile
    from ember.events import Events
    from ember.train.job import prepare
    from ember.train.loop import Data, train_step
    from hf_trainer import recipe
    job = prepare(recipe(warmup + 2 * steps, compile=compile), out, False, Events(), ledger_path=False)
    job.model.train()
    data = Data(job)
    for _ in range(warmup):
        train_step(job, data)
    walls = []
    for _ in range(steps):  # unprofiled: the profiler's own cost stays out of the wall-clock
        t0 = time.perf_counter()
        train_step(job, data)
        walls.append(time.perf_counter() - t0)
    groups = {"matmul": 0.0, "attention": 0.0, "rest": 0.0}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            train_step(job, data)
    for e in prof.key_averages():
        groups[group(e.key)] += e.self_cpu_time_total / 1e6 / steps
    data.close()
    return {"wall": statistics.median(walls), **groups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: profile_steps(name == "compiled", args.steps, args.warmup, Path(tmp) / name)
                for name in ("eager", "compiled")}
    eager = rows["eager"]
    print("| step | wall-clock | matmul (self CPU) | attention | rest | matmul + attention share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        total = r["matmul"] + r["attention"] + r["rest"]
        print(f"| {name} | {r['wall'] * 1e3:.0f} ms | {r['matmul'] * 1e3:.0f} ms | {r['attention'] * 1e3:.0f} ms "
              f"| {r['rest'] * 1e3:.0f} ms | {(r['matmul'] + r['attention']) / total:.3f} |")
    floor = (eager["matmul"] + eager["attention"]) / (eager["matmul"] + eager["attention"] + eager["rest"])
    print(f"\ncompiled / eager wall-clock: {rows['compiled']['wall'] / eager['wall']:.3f}")
    print(f"floor on compiled / eager if inductor leaves matmuls and attention as they are: {floor:.3f}")


if __name__ == "__main__":
    main()
