"""The plan of a family without formulas (its step traced on fake tensors, ember.doctor.traced)
against the same step measured for real (ember.doctor.measure), family by family, and the time
a 7B plan takes.

The configurations are tests/plan/test_traced.py's: ten causal-LM families transformers builds,
hidden 128, 2 layers, vocab 1,000, micro-batch 4 x 128, full fine-tuning in fp32; then GPT-2
under each setting that shapes the step. Then `ember plan` of a Falcon-7B-shaped model (config
only: 6.9 B parameters; LoRA on query_key_value, bf16, activation checkpointing, 1 x 2048) as a
fresh process, first with an empty $EMBER_HOME (traced) and again (from the cache).

--before COMMIT adds ember's tree at that commit as a second arm (bench/startup.py's source_at):
its traced peaks beside this tree's against the same measurement, and its 7B plan's time.

--settings FAMILY ... runs every setting on those families instead of GPT-2 alone.

--qlora adds LoRA over a 4-bit NF4 base (tests/plan/test_traced.py's QLORA settings) on every
family whose layers are nn.Linear (GPT-2's are Conv1D: bitsandbytes quantizes none of them).

usage: python bench/plan_families.py [--no-7b | --only-7b] [--before COMMIT] [--settings FAMILY ...] [--qlora]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from startup import source_at  # noqa: E402  (another commit's tree as an arm)

FALCON_7B = {"hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71, "vocab_size": 65024,
             "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True, "bias": False}


def accuracy(root: Path, before: Path | None, settings: list[str], qlora: bool = False) -> None:
    from tests.helpers import write_recipe
    from tests.plan.test_traced import FAMILIES, QLORA, VARIANTS, model_folder, traced_and_measured
    cases = [(f, f"{f}, full, fp32", []) for f in sorted(FAMILIES)]
    cases += [(f, f"{f}, {v}", o) for f in settings for v, o in VARIANTS.items()]
    cases += [(f, f"{f}, {v}", o) for f in sorted(FAMILIES) if qlora and f != "gpt2" for v, o in QLORA.items()]
    recipes = [(str(write_recipe(root / f"r{i}", model={"path": str(model_folder(root, family))},
                                 data={"seq_len": 128}, train={"micro_batch": 4})), overrides)
               for i, (family, _, overrides) in enumerate(cases)]
    old = traced_at(before, recipes) if before else []
    arms = "traced before | traced | measured | before / measured - 1 | " if before else "traced | measured | "
    print(f"| family / setting | {arms}traced / measured - 1 |")
    print("| --- |" + " ---: |" * (5 if before else 3))
    for i, ((_, name, _), (recipe, overrides)) in enumerate(zip(cases, recipes)):
        traced, measured = traced_and_measured(recipe, *overrides)
        first = f"{old[i]:,} B | " if before else ""
        then = f"{100 * (old[i] / measured - 1):+.2f}% | " if before else ""
        print(f"| {name} | {first}{traced:,} B | {measured:,} B | {then}{100 * (traced / measured - 1):+.2f}% |",
              flush=True)


def traced_at(tree: Path, recipes: list[tuple[str, list[str]]]) -> list[int]:
    """The traced peaks of `recipes` by ember's tree at `tree` (a fresh process)."""
    code = ("import json, sys\nfrom ember.doctor.fake_step import trace\nfrom ember.recipe import load_recipe\n"
            "for p, o in json.loads(sys.argv[1]): print(trace(load_recipe(p, o)).peak_bytes)")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(recipes)], cwd=tree, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tree)}, check=True)
    return [int(x) for x in done.stdout.split()]


def seven_b(root: Path, trees: dict[str, Path]) -> None:
    from transformers import FalconConfig
    folder = root / "falcon-7b"
    FalconConfig(**FALCON_7B).save_pretrained(folder)
    recipe = root / "f7.toml"
    recipe.write_text(f'[model]\npath = "{folder}"\n[method]\nkind = "lora"\ntarget_modules = ["query_key_value"]\n'
                      f'[data]\nfiles = ["{ROOT / "examples/data/kjv.jsonl"}"]\nseq_len = 2048\n'
                      f'[train]\nmicro_batch = 1\nmax_steps = 10\nactivation_checkpointing = true\n'
                      f'[precision]\nmode = "bf16"\n[cost]\npeak_tflops = 100\n')
    for arm, tree in trees.items():
        env = {**os.environ, "EMBER_HOME": str(root / f"home-{arm}"), "PYTHONPATH": str(tree)}
        for what in ("traced", "from the cache"):
            t0, cpu0 = time.monotonic(), _children_cpu()
            done = subprocess.run([sys.executable, "-m", "ember", "plan", str(recipe)], env=env, capture_output=True,
                                  text=True, cwd=tree)
            took, cpu = time.monotonic() - t0, _children_cpu() - cpu0  # CPU time: a shared machine's load aside
            peak = next((x for x in done.stdout.splitlines() if x.startswith("│ peak")), done.stderr[-300:])
            print(f"7B plan, {arm} ({what}): {took:.2f} s ({cpu:.2f} s of CPU), exit {done.returncode}: "
                  f"{peak.strip()}", flush=True)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-7b", action="store_true")
    ap.add_argument("--only-7b", action="store_true", help="time the 7B plan only (quick, for a quiet moment)")
    ap.add_argument("--before", metavar="COMMIT", help="also trace with ember's tree at this commit")
    ap.add_argument("--settings", nargs="+", default=["gpt2"], metavar="FAMILY", help="families to run each setting on")
    ap.add_argument("--qlora", action="store_true", help="also QLoRA's settings on every family with nn.Linear layers")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = source_at(args.before, Path(tmp) / "before-src") if args.before else None
        if not args.only_7b:
            accuracy(Path(tmp), before, args.settings, args.qlora)
        if not args.no_7b:
            seven_b(Path(tmp), {"now": ROOT, **({"before": before} if before else {})})


if __name__ == "__main__":
    main()
