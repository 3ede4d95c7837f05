"""Seconds to commit a durable checkpoint of a 135M-parameter full fine-tuning state (SmolLM2's
shape, random init: weights + AdamW moments, ~1.6 GB), against a plain torch.save of the same
state (no fsync: not durable), torch.save + fsync, and the disk's raw write bandwidth
(dd conv=fdatasync) for the same number of bytes. Alternating, median over rounds.

`--before REV` also times the commit as git revision REV made it (its ember/ckpt/store.py and
files written by safetensors' save_file and torch.save), in the same rounds: the figures for
"before" and "after" on the same machine state. The retired checkpoint's deletion runs behind
the commit (CheckpointStore.settle() waits for it, untimed, before the next measurement); its
time is printed apart.

usage: python bench/checkpoint.py [--rounds 3] [--dir DIR] [--before REV]
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


def full_state():
    """A full fine-tuning state of SmolLM2-135M's shape: weights and both AdamW moments."""
    torch.manual_seed(0)
    model = smollm2_shaped()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    opt.step()  # materialise both AdamW moments
    return (model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
            torch.amp.GradScaler("cpu", enabled=False), _run_state())


def lora_state():
    """A LoRA state of the same shape: rank-8 adapters on q_proj and v_proj of 30 layers (what
    the model file holds for LoRA: the trainable tensors only) and their AdamW moments."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    for i in range(30):
        for proj, out in (("q_proj", 576), ("v_proj", 192)):
            model.register_parameter(f"l{i}_{proj}_A", torch.nn.Parameter(torch.randn(8, 576)))
            model.register_parameter(f"l{i}_{proj}_B", torch.nn.Parameter(torch.randn(out, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    return (model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
            torch.amp.GradScaler("cpu", enabled=False), _run_state())


def _run_state() -> RunState:
    state = RunState(step=1)
    state.capture_rng(torch.device("cpu"))
    return state


def timed(fn) -> float:
    os.sync()  # start each measurement with no earlier write-back pending (untimed)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def store_at(rev: str):
    """CheckpointStore as git revision `rev` of this repository had it."""
    import importlib.util
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:ember/ckpt/store.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="ember-store-")) / f"store_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.CheckpointStore


def write_v1(folder: Path, snap: contents.Snapshot) -> None:
    """The files as ember-checkpoint/1 wrote them: safetensors' save_file, torch.save (pickle)."""
    from safetensors.torch import save_file
    save_file(snap.weights, folder / "model.safetensors")
    torch.save(snap.optimizer, folder / "optimizer.pt")
    torch.save(snap.extra, folder / "train_state.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--before", default=None, help="also time the commit of this git revision")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-ckpt-bench-", dir=args.dir))
    model, opt, sched, scaler, state = full_state()
    store = CheckpointStore(work / "ck", keep_last=1)

    def ember_commit() -> None:
        state.step += 1
        snap = contents.snapshot(model, opt, sched, scaler, state, copy=False)  # the synchronous path
        store.save(state.step, lambda d: contents.write_snapshot(d, snap), {})

    old_store = store_at(args.before)(work / "ck-before", keep_last=1) if args.before else None

    def before_commit() -> None:
        state.step += 1
        snap = contents.snapshot(model, opt, sched, scaler, state, copy=False)
        old_store.save(state.step, lambda d: write_v1(d, snap), {})

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
    if old_store is not None:
        before_commit()  # warm-up
        rows[f"ember commit at {args.before} (before)"] = []
        fns.append(before_commit)
    retire = []
    for r in range(args.rounds):
        for (name, times), fn in zip(rows.items(), fns):
            times.append(timed(fn))
            t0 = time.perf_counter()
            store.settle()  # the deletion behind ember's commit: done before the next measurement
            if fn is ember_commit:
                retire.append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{t[-1]:.2f}s" for t in rows.values()), flush=True)
    print(f"\ncheckpoint of {nbytes / 1e9:.2f} GB (weights + AdamW state), median of {args.rounds}:")
    base = statistics.median(rows["torch.save + fsync"])
    raw = statistics.median(rows["dd conv=fdatasync (raw disk)"])
    for name, times in rows.items():
        m = statistics.median(times)
        print(f"  {name:38s} {m:7.2f} s  {nbytes / m / 1e9:6.2f} GB/s  "
              f"x{m / base:5.2f} of torch.save+fsync  x{m / raw:5.2f} of raw disk")
    print(f"  retired checkpoint's deletion, behind ember's commit (waited for after it): "
          f"{statistics.median(retire):.3f} s")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
