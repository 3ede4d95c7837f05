"""How good the doctor's predictions are: for each injected bottleneck of the doctor's tests,
run `ember doctor`, take its top remedy (the first cause other than contention from the rest of
the machine), then measure the recipe and the remedied recipe with the doctor's own baseline
(the real loop, ember.doctor.experiments.real_loop.measure_baselines), their stretches in turn, and
compare the predicted step with the measured one. Both per the original step's tokens: a
remedy that grows the optimizer step is scaled back to the old step's tokens.

The step measured before and after come from one process, interleaved; the doctor's "before"
comes from its own process, minutes earlier on a shared machine. So the error is given two
ways: the predicted step against the measured one, and the predicted saving (as a share of
the step) against the measured saving share, which cancels drift in the machine's load.

usage: python bench/doctor_accuracy.py [--budget 30] [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.helpers import write_recipe


def doctor(recipe: Path, budget: float, extra: list[str], env: dict) -> dict:
    """`ember doctor --json` as a process; its wall-clock under "wall" (the whole process)."""
    args = [sys.executable, "-m", "ember", "doctor", str(recipe), "--budget", str(budget), "--json", *extra]
    t0 = time.monotonic()
    out = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, check=True)
    return {**json.loads(out.stdout), "wall": time.monotonic() - t0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=30)
    parser.add_argument("--seconds", type=float, default=6, help="measuring each before/after pair")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-doctor-bench-"))
    os.environ["EMBER_HOME"] = str(work / "home")
    from transformers import LlamaConfig, LlamaForCausalLM

    from ember.doctor.experiments.real_loop import measure_baselines
    from ember.events import Events
    from ember.recipe import load_recipe
    from ember.data.tokenizer import ByteTokenizer
    wide = work / "wide"
    LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                                 num_attention_heads=8, max_position_embeddings=64)).save_pretrained(wide)
    ByteTokenizer().save(wide)
    scenarios = [
        ("slow input (50 ms a micro-batch)", write_recipe(work / "a"), [], {"EMBER_FAULT_DATA_DELAY": "0.05"}),
        ("sync checkpoint every step", write_recipe(work / "b", checkpoint={"every_steps": 1, "async": False}), [], {}),
        ("micro batch 1 (no checkpoints)", write_recipe(work / "c", train={"micro_batch": 1},
                                                        checkpoint={"every_steps": 0}), [], {}),
        ("slow gradient sync (DDP x2)", write_recipe(work / "d", model={"path": str(wide)}, train={"micro_batch": 1},
                                                     data={"seq_len": 8}, checkpoint={"every_steps": 0}),
         ["--ddp", "2"], {}),
    ]
    print(f"{'scenario':34} {'budget/wall':>11} {'top cause':20} {'remedy':72} {'doctor':>8} {'before':>8} "
          f"{'predicted':>9} {'measured':>9} {'error':>7} {'saving p/m':>11}")
    for name, recipe, extra, env in scenarios:
        budget = args.budget + (20 if extra else 0)
        report = doctor(recipe, budget, extra, env)
        # the injected cause's finding (for DDP, overhead-bound may rank level with it on a CPU)
        wanted = "communication-bound" if extra else None
        top = next(x for x in report["findings"] if x["cause"] != "contention" and x["cause"] in (wanted or x["cause"]))
        os.environ.update(env)
        r = load_recipe(recipe)
        after_recipe = r.with_changes(top["changes"], "the remedy")
        scale = (r.train.micro_batch * r.train.grad_accum) / (after_recipe.train.micro_batch * after_recipe.train.grad_accum)
        if extra:  # DDP: the step under DDP is the doctor's (the loop's, plus the synchronisation it exposes)
            sets = [a for k, v in top["changes"].items() for a in ("--set", f"{k}={json.dumps(v)}")]
            again = doctor(recipe, budget, extra + sets, env)
            before_step, measured = report["figures"]["step_seconds"], again["figures"]["step_seconds"] * scale
        else:
            before, after = measure_baselines([r, after_recipe], args.seconds, Events())
            before_step, measured = before.step_seconds, after.step_seconds * scale
        for k in env:
            del os.environ[k]
        step = report["figures"]["step_seconds"]
        predicted = top["predicted_step_seconds"]
        remedy = ", ".join(f"{k}={v}" for k, v in top["changes"].items())
        share_p, share_m = 1 - predicted / step, 1 - measured / before_step
        print(f"{name:34} {budget:4.0f}/{report['wall']:4.1f}s {top['cause']:20} {remedy:72} {step * 1000:7.1f}m "
              f"{before_step * 1000:7.1f}m "
              f"{predicted * 1000:8.1f}m {measured * 1000:8.1f}m {predicted / measured - 1:+7.1%} "
              f"{share_p:5.0%}/{share_m:4.0%}", flush=True)
    print("\n(times per optimizer step of the original recipe's size, in ms; doctor: the step the doctor "
          "measured, before: the same recipe measured with the remedied one, interleaved;\n"
          "for DDP, a second doctor run with the remedy, its step under DDP)")


if __name__ == "__main__":
    main()
