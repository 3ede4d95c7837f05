"""How good the doctor's estimated savings are: for each injected bottleneck of the doctor's
tests, run `ember doctor`, apply the top remedy it names, measure again, and compare the step
time it predicted with the step time measured after the remedy (both for the same number of
tokens: a remedy that grows the optimizer step is scaled back to the old step's tokens).

usage: python bench/doctor_accuracy.py [--budget 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.helpers import write_recipe  # noqa: E402


def doctor(recipe: Path, budget: float, extra: list[str], env: dict, sets: dict) -> dict:
    args = [sys.executable, "-m", "ember", "doctor", str(recipe), "--budget", str(budget), "--json", *extra]
    for k, v in sets.items():
        args += ["--set", f"{k}={json.dumps(v)}"]
    out = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, check=True)
    return json.loads(out.stdout)


def tokens(f: dict) -> int:
    return f["micro_batch"] * f["grad_accum"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-doctor-bench-"))
    os.environ["EMBER_HOME"] = str(work / "home")
    from transformers import LlamaConfig, LlamaForCausalLM

    from ember.train.model import ByteTokenizer
    wide = work / "wide"
    LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                 num_attention_heads=8, max_position_embeddings=64)).save_pretrained(wide)
    ByteTokenizer().save(wide)
    scenarios = [
        ("slow input pipeline", write_recipe(work / "a"), [], {"EMBER_FAULT_DATA_DELAY": "0.02"}),
        ("sync checkpoint every step", write_recipe(work / "b", checkpoint={"every_steps": 1, "async": False}), [], {}),
        ("micro batch 1", write_recipe(work / "c", train={"micro_batch": 1}), [], {}),
        ("slow gradient sync (DDP x2)", write_recipe(work / "d", model={"path": str(wide)}, train={"micro_batch": 4},
                                                     data={"seq_len": 16}), ["--ddp", "2"], {}),
    ]
    print(f"{'scenario':30} {'top cause':20} {'remedy':38} {'before':>9} {'predicted':>9} {'measured':>9} {'error':>7}")
    for name, recipe, extra, env in scenarios:
        before = doctor(recipe, args.budget, extra, env, {})
        top = before["findings"][0]
        after = doctor(recipe, args.budget, extra, env, top["changes"])
        scale = tokens(before["figures"]) / tokens(after["figures"])
        measured = after["figures"]["step_seconds"] * scale
        predicted = top["predicted_step_seconds"]
        remedy = ", ".join(f"{k}={v}" for k, v in top["changes"].items())
        print(f"{name:30} {top['cause']:20} {remedy:38} {before['figures']['step_seconds'] * 1000:8.1f}m "
              f"{predicted * 1000:8.1f}m {measured * 1000:8.1f}m {predicted / measured - 1:+7.1%}", flush=True)
    print("\n(times per optimizer step of the original recipe's size, in ms)")


if __name__ == "__main__":
    main()
