"""The plan of a family without formulas (its step traced on fake tensors, ember.doctor.traced)
against the same step measured for real (ember.doctor.measure), family by family, and the time
a 7B plan takes.

The configurations are tests/plan/test_traced.py's: ten causal-LM families transformers builds,
hidden 128, 2 layers, vocab 1,000, micro-batch 4 x 128, full fine-tuning in fp32; then GPT-2
under each setting that shapes the step. Then `ember plan` of a Falcon-7B-shaped model (config
only: 6.9 B parameters; LoRA on query_key_value, bf16, activation checkpointing, 1 x 2048) as a
fresh process, first with an empty $EMBER_HOME (traced) and again (from the cache).

usage: python bench/plan_families.py [--no-7b]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FALCON_7B = {"hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71, "vocab_size": 65024,
             "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True, "bias": False}


def accuracy(root: Path) -> None:
    from tests.helpers import write_recipe
    from tests.plan.test_traced import FAMILIES, VARIANTS, model_folder, traced_and_measured
    print("| family / setting | traced | measured | traced / measured - 1 |")
    print("| --- | ---: | ---: | ---: |")
    cases = [(f, f"{f}, full, fp32", []) for f in sorted(FAMILIES)]
    cases += [("gpt2", f"gpt2, {v}", o) for v, o in VARIANTS.items()]
    for i, (family, name, overrides) in enumerate(cases):
        recipe = write_recipe(root / f"r{i}", model={"path": str(model_folder(root, family))},
                              data={"seq_len": 128}, train={"micro_batch": 4})
        traced, measured = traced_and_measured(recipe, *overrides)
        print(f"| {name} | {traced:,} B | {measured:,} B | {100 * (traced / measured - 1):+.2f}% |", flush=True)


def seven_b(root: Path) -> None:
    from transformers import FalconConfig
    folder = root / "falcon-7b"
    FalconConfig(**FALCON_7B).save_pretrained(folder)
    recipe = root / "f7.toml"
    recipe.write_text(f'[model]\npath = "{folder}"\n[method]\nkind = "lora"\ntarget_modules = ["query_key_value"]\n'
                      f'[data]\nfiles = ["{ROOT / "examples/data/kjv.jsonl"}"]\nseq_len = 2048\n'
                      f'[train]\nmicro_batch = 1\nmax_steps = 10\nactivation_checkpointing = true\n'
                      f'[precision]\nmode = "bf16"\n[cost]\npeak_tflops = 100\n')
    env = {**os.environ, "EMBER_HOME": str(root / "home")}
    for what in ("traced", "from the cache"):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "ember", "plan", str(recipe)], env=env, capture_output=True,
                              text=True)
        took = time.monotonic() - t0
        peak = next((x for x in done.stdout.splitlines() if x.startswith("│ peak")), done.stderr[-300:])
        print(f"7B plan ({what}): {took:.2f} s, exit {done.returncode}: {peak.strip()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-7b", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        accuracy(Path(tmp))
        if not args.no_7b:
            seven_b(Path(tmp))


if __name__ == "__main__":
    main()
