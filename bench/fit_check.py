"""`ember plan --fit` checked on 10 (model, budget) cases (issue 30's goal): the pick fits when its
step runs for real, and no configuration that fits is predicted faster by more than 10%, checked
by running the top 3.

Each case is a recipe (micro batch 4 x accumulation 2 x seq 64, fp32, one thread) over a tiny
model: builtin:tiny and a wider Llama (the memory formulas), GPT-NeoX, GPT-2 and Phi-3 (no
formulas: each configuration's step traced on fake tensors). The budget is a fraction of the
recipe's own peak with margin, so the search must trade: above 1 full fine-tuning fits; below, only
int8 state, LoRA, QLoRA, activation checkpointing or a smaller micro batch. `--fit` runs through
the library (ember.plan.fit.fit_recipe, with the CLI's tracer); then each of its top 3 is built
and run (ember.doctor.measure.calibrate: a warm-up step, the second step's peak, the median of
3 timed micro-batch steps, each with its optimizer update, x the accumulation; the three in turn,
twice, the faster of each kept: the first run of a case is slow for all of them).

usage: nice -n 19 python bench/fit_check.py [--cases 3,5]   (default: all 10)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [  # model, budget as a fraction of the recipe's peak with margin
    ("builtin:tiny", 1.3), ("builtin:tiny", 0.6), ("builtin:tiny", 0.22),
    ("llama-wide", 1.1), ("llama-wide", 0.25),
    ("gpt_neox", 1.2), ("gpt_neox", 0.25),
    ("gpt2", 0.7), ("gpt2", 0.22),
    ("phi3", 0.5),
]
ROUNDS = 2  # the top 3 run in turn, twice: the fastest of each is kept (the machine is shared)


def model_path(root: Path, name: str) -> str:
    """A model folder of the family (weights included: the top 3 run), written once."""
    if name == "builtin:tiny":
        return name
    import torch
    import transformers as tf

    from ember.train.model import ByteTokenizer
    from tests.plan.test_traced import FAMILIES, model_folder
    if name in FAMILIES:
        return str(model_folder(root, name))
    folder = root / name
    if not folder.is_dir():
        torch.manual_seed(0)
        config = tf.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=4, vocab_size=2000, max_position_embeddings=512)
        tf.LlamaForCausalLM(config).save_pretrained(folder)
        ByteTokenizer().save(folder)
    return str(folder)


def measure(recipe: Path, overrides: list[str]) -> tuple[int, float]:
    """The configuration's real peak (less the tensors this process held before) and its
    optimizer step's time (a micro-batch step x the accumulation)."""
    import torch

    from ember.doctor.measure import calibrate, live_tensor_bytes
    from ember.recipe import load_recipe
    r = load_recipe(recipe, overrides)
    gc.collect()
    held = live_tensor_bytes(torch.device("cpu"))
    c = calibrate(r, steps=3)
    return c.peak_bytes - held, c.step_seconds * r.train.grad_accum


def short(c) -> str:
    """A configuration in a few characters: method and rank, state, checkpointing, micro batch x accum."""
    return (f"{c.method}{c.rank or ''}{' int8' if c.state_dtype == 'int8' else ''}"
            f"{' ac' if c.activation_checkpointing else ''} {c.micro_batch}x{c.grad_accum}")


def case(root: Path, i: int, name: str, fraction: float) -> str:
    from ember.doctor.traced import traced_step
    from ember.plan.fit import FitRequest, NothingFits, fit_recipe
    from tests.helpers import write_recipe
    recipe = write_recipe(root / f"case{i}", model={"path": model_path(root, name)}, data={"seq_len": 64},
                          train={"micro_batch": 4, "grad_accum": 2, "threads": 1})
    t0 = time.perf_counter()  # the first search traces (an empty cache), the second reads the traces
    whole = fit_recipe(FitRequest(recipe, [], "1TiB"), None, traced_step).as_written
    searched = time.perf_counter() - t0
    budget = int(whole.with_margin * fraction)
    try:
        fit = fit_recipe(FitRequest(recipe, [], f"{budget}B"), None, traced_step)
    except NothingFits as e:
        return f"| {i} | {name} | {budget / 2**20:.2f} MiB | nothing fits: {e} |"
    top = fit.best[:3]
    rounds = [[measure(recipe, c.overrides()) for c in top] for _ in range(ROUNDS)]  # alternating: the first
    runs = [(c, min(r[k][0] for r in rounds), min(r[k][1] for r in rounds)) for k, c in enumerate(top)]  # warms up
    pick, peak, _ = runs[0]
    fitting = [s for _, p, s in runs if p <= budget]
    fastest = min(fitting) if fitting else float("nan")
    times = ", ".join(f"{short(c)} {s * 1e3:.0f}{'' if p <= budget else '*'} ({c.step_seconds * 1e3:.3g})"
                      for c, p, s in runs)
    describe = short(pick)
    return (f"| {i} | {name} | {budget / 2**20:.2f} MiB ({fraction:g}x) | {describe} | {pick.peak / 2**20:.2f} / "
            f"{peak / 2**20:.2f} MiB ({pick.peak / peak - 1:+.1%}) | {'yes' if peak <= budget else 'NO'} | {times} | "
            f"{'yes' if runs[0][2] <= 1.1 * fastest else 'NO'} ({runs[0][2] / fastest - 1:+.0%}) | {searched:.1f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help="comma-separated case numbers (1-10) to run; default all")
    wanted = {int(x) for x in ap.parse_args().cases.split(",") if x}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EMBER_HOME"] = str(Path(tmp) / "home")  # an empty trace cache: the search's time is cold
        t0 = time.perf_counter()
        print("| # | model | budget | pick | peak predicted / measured | fits? | top 3 measured (predicted) step, ms | "
              "pick within 10% of the fastest that fits | --fit time (cold) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | ---: |")
        for i, (name, fraction) in enumerate(CASES, 1):
            if not wanted or i in wanted:
                print(case(Path(tmp), i, name, fraction), flush=True)
        print(f"\ntotal {time.perf_counter() - t0:.0f} s; * = measured peak over the budget")


if __name__ == "__main__":
    main()
