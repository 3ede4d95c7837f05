"""ember's training loop against a minimal hand-written PyTorch loop: same model, data, batch,
optimizer, clipping and schedule, alternating in one process, median over rounds. Also what
`train.deterministic` costs. Goal: ember within 3% of the bare loop.

usage: python bench/loop_overhead.py [--rounds 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from ember.events import Events  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from ember.ckpt.state import seed_all  # noqa: E402
from ember.recipe import build_recipe  # noqa: E402
from ember.data.loader import make_loader  # noqa: E402
from ember.train.job import prepare  # noqa: E402
from ember.train.loop import train  # noqa: E402

CONFIG = {  # a small Llama (hidden 256, 4 layers) trained from random init: ~70 ms a step here
    "model": {"path": "builtin:tiny"},
    "data": {"files": [str(ROOT / "examples/data/genesis.jsonl")], "seq_len": 256},
    "train": {"micro_batch": 8, "seed": 0, "threads": 0},
    "checkpoint": {"every_steps": 0, "keep_last": 1},
}


def ember_step_times(steps: int, deterministic: bool, home: Path) -> list[float]:
    raw = json.loads(json.dumps(CONFIG))
    raw["train"].update(max_steps=steps, deterministic=deterministic)
    recipe = build_recipe(raw, "bench")
    out = Path(tempfile.mkdtemp(dir=home))
    job = prepare(recipe, out, False, Events())
    train(job)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_seconds"] for r in records[3:]]  # skip warm-up steps


def bare_step_times(steps: int, home: Path) -> list[float]:
    """What a careful engineer writes by hand: no checkpoints, no metrics file, no progress."""
    raw = json.loads(json.dumps(CONFIG))
    raw["train"].update(max_steps=steps)
    recipe = build_recipe(raw, "bench")
    job = prepare(recipe, Path(tempfile.mkdtemp(dir=home)), False, Events(), ledger_path=False)
    model, opt, sched = job.model, job.optimizer, job.scheduler
    data = iter(make_loader(job.batches(), steps, workers=0, pin=False))
    times = []
    model.train()
    for _ in range(steps):
        t0 = time.perf_counter()
        _, batch = next(data)
        loss = model(input_ids=batch.ids, labels=batch.ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times[3:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    import ember.train.model as model_mod
    base = model_mod.tiny_config

    def bigger():
        cfg = base()
        cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 256, 704, 4
        cfg.num_attention_heads, cfg.num_key_value_heads = 8, 4
        return cfg
    model_mod.tiny_config = bigger
    hf_logging.disable_progress_bar()
    home = Path(tempfile.mkdtemp(prefix="ember-bench-"))
    os.environ["EMBER_HOME"] = str(home)
    results: dict[str, list[float]] = {"bare": [], "ember": [], "ember_nondeterministic": []}
    for r in range(args.rounds):  # alternate, so drift in machine speed hits all alike
        seed_all(0)
        results["bare"].append(statistics.median(bare_step_times(args.steps, home)))
        results["ember"].append(statistics.median(ember_step_times(args.steps, True, home)))
        results["ember_nondeterministic"].append(
            statistics.median(ember_step_times(args.steps, False, home)))
        torch.use_deterministic_algorithms(False)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1000:.2f} ms" for k, v in results.items()),
              flush=True)
    tokens = CONFIG["train"]["micro_batch"] * CONFIG["data"]["seq_len"]
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmedian step time over {args.rounds} rounds ({tokens} tokens/step, "
          f"{torch.get_num_threads()} threads):")
    for k, v in med.items():
        print(f"  {k:24s} {v * 1000:8.2f} ms  {tokens / v:10,.0f} tokens/s")
    print(f"ember / bare tokens/s: {med['bare'] / med['ember']:.4f}  (goal >= 0.97)")
    print(f"deterministic / non-deterministic tokens/s: "
          f"{med['ember_nondeterministic'] / med['ember']:.4f}")


if __name__ == "__main__":
    main()
