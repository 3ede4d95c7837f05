"""Seconds to commit a durable checkpoint of a 135M-parameter full fine-tuning state (SmolLM2's
shape, random init: weights + AdamW moments, ~1.6 GB), against a plain torch.save of the same
state (no fsync: not durable), torch.save + fsync, and the disk's raw write bandwidth
(dd conv=fdatasync) for the same number of bytes. Alternating, median over rounds.

usage: python bench/checkpoint.py [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from ember.ckpt import contents  # noqa: E402
from ember.ckpt.state import RunState  # noqa: E402
from ember.ckpt.store import CheckpointStore  # noqa: E402


def smollm2_shaped() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def timed(fn) -> float:
    os.sync()  # start each measurement with no earlier write-back pending (untimed)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-ckpt-bench-", dir=args.dir))
    torch.manual_seed(0)
    model = smollm2_shaped()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    opt.step()  # materialise both AdamW moments
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = RunState(step=1)
    state.capture_rng(torch.device("cpu"))
    store = CheckpointStore(work / "ck", keep_last=1)

    def ember_commit() -> None:
        state.step += 1
        snap = contents.snapshot(model, opt, sched, scaler, state, copy=False)  # the synchronous path
        store.save(state.step, lambda d: contents.write_snapshot(d, snap), {})

    def plain_save(fsync: bool) -> None:
        path = work / "plain.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    ember_commit()  # warm-up, and size
    nbytes = sum(p.stat().st_size for p in store.committed()[-1][1].iterdir())

    def dd() -> None:
        mib = max(1, nbytes >> 20)
        subprocess.run(["dd", "if=/dev/zero", f"of={work / 'dd.bin'}", "bs=1M", f"count={mib}",
                        "conv=fdatasync"], check=True, capture_output=True)

    rows = {"ember commit (durable, checksummed)": [], "torch.save (page cache only)": [],
            "torch.save + fsync": [], "dd conv=fdatasync (raw disk)": []}
    fns = [ember_commit, lambda: plain_save(False), lambda: plain_save(True), dd]
    for r in range(args.rounds):
        for (name, times), fn in zip(rows.items(), fns):
            times.append(timed(fn))
        print(f"round {r + 1}: " + ", ".join(f"{t[-1]:.2f}s" for t in rows.values()), flush=True)
    print(f"\ncheckpoint of {nbytes / 1e9:.2f} GB (weights + AdamW state), median of {args.rounds}:")
    base = statistics.median(rows["torch.save + fsync"])
    raw = statistics.median(rows["dd conv=fdatasync (raw disk)"])
    for name, times in rows.items():
        m = statistics.median(times)
        print(f"  {name:38s} {m:7.2f} s  {nbytes / m / 1e9:6.2f} GB/s  "
              f"x{m / base:5.2f} of torch.save+fsync  x{m / raw:5.2f} of raw disk")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
