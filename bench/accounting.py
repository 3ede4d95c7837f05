"""What accounting costs: whole-run tokens/s of `train()` with the ledger on (events, attempts,
checkpoint rows, the final report) and off (`--no-ledger`), alternating in one process, median
over rounds. Checkpoints every 10 steps, so the per-checkpoint ledger writes are in the figure.
Goal: under 1%.

usage: python bench/accounting.py [--rounds 7] [--steps 40]
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

from ember.events import Events  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from ember.recipe import build_recipe  # noqa: E402
from ember.train.job import prepare  # noqa: E402
from ember.train.loop import train  # noqa: E402

CONFIG = {
    "model": {"path": "builtin:tiny"},
    "data": {"files": [str(ROOT / "examples/data/genesis.jsonl")], "seq_len": 256},
    "train": {"micro_batch": 8, "seed": 0},
    "checkpoint": {"every_steps": 10, "keep_last": 2},
}


def tokens_per_second(steps: int, ledger: bool, home: Path) -> float:
    raw = json.loads(json.dumps(CONFIG))
    raw["train"]["max_steps"] = steps
    job = prepare(build_recipe(raw, "bench"), Path(tempfile.mkdtemp(dir=home)), False,
                  Events(), ledger_path=None if ledger else False)
    t0 = time.perf_counter()
    train(job)  # the loop, its checkpoints, the final save and (when on) the ledger writes
    return steps * 8 * 256 / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    home = Path(tempfile.mkdtemp(prefix="ember-acct-bench-"))
    os.environ["EMBER_HOME"] = str(home)
    on, off = [], []
    for r in range(args.rounds):
        on.append(tokens_per_second(args.steps, True, home))
        off.append(tokens_per_second(args.steps, False, home))
        print(f"round {r + 1}: ledger on {on[-1]:,.0f} tokens/s, off {off[-1]:,.0f} tokens/s", flush=True)
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"\nwhole-run tokens/s, median of {args.rounds}: on {m_on:,.0f}, off {m_off:,.0f}; "
          f"on/off = {m_on / m_off:.4f} (goal >= 0.99)")


if __name__ == "__main__":
    main()
