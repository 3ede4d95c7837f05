"""Where a durable checkpoint commit spends its time, phase by phase, for a full fine-tuning
state (SmolLM2-135M's shape: weights + both AdamW moments, 1.61 GB) and a LoRA state (rank 8
adapters on q/v of the same shape, with their AdamW moments, a few MB).

`ember/1` is the first format's commit taken apart into its steps, each timed alone:
serialization into memory (safetensors, torch.save's pickling), the write syscalls of those
bytes, fsync (write-back to the disk), SHA-256 of every file read back, manifest + rename +
folder fsyncs, and retirement (rename + delete) of the previous checkpoint. `ember/2` is the
current commit, whose phases overlap by design (checksum while writing, write-back started
while writing); it is timed whole, with retirement shown apart because it runs off the
commit's path. The whole commit of each is also timed through CheckpointStore.save. Medians of
rounds; `os.sync()` (untimed) before each measurement.

usage: python bench/checkpoint_phases.py [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from checkpoint import full_state, lora_state  # noqa: E402
from safetensors.torch import save as st_save  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ember.ckpt import contents  # noqa: E402
from ember.ckpt.store import CheckpointStore  # noqa: E402
from ember.durable import fsync_dir, fsync_file, sha256_file  # noqa: E402


def write_v1(folder: Path, snap: contents.Snapshot) -> None:
    """The files as ember/1 wrote them: safetensors' save_file, torch.save (pickle)."""
    save_file(snap.weights, folder / "model.safetensors")
    torch.save(snap.optimizer, folder / "optimizer.pt")
    torch.save(snap.extra, folder / "train_state.pt")


def v1_phases(work: Path, snap: contents.Snapshot) -> dict[str, float]:
    """The first format's commit, one step at a time (what store.save did for ember/1)."""
    t: dict[str, float] = {}
    folder = work / "v1"
    old = work / "v1-old"
    if folder.exists():
        os.rename(folder, old)  # the previous checkpoint, to retire at the end
    os.sync()
    t0 = time.perf_counter()
    blobs = {"model.safetensors": st_save(snap.weights)}
    for name, obj in (("optimizer.pt", snap.optimizer), ("train_state.pt", snap.extra)):
        buf = io.BytesIO()
        torch.save(obj, buf)
        blobs[name] = buf.getbuffer()
    t["(serialization alone, into memory)"] = time.perf_counter() - t0
    del blobs, buf
    os.sync()
    t0 = time.perf_counter()
    folder.mkdir()
    write_v1(folder, snap)
    t["serialize + write syscalls"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in folder.iterdir():
        fsync_file(p)
    t["fsync (write-back)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in folder.iterdir():
        sha256_file(p)
    t["checksum"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    (folder / "MANIFEST.json").write_text("{}")
    fsync_file(folder / "MANIFEST.json")
    fsync_dir(folder)
    fsync_dir(work)
    t["manifest, rename, folder fsyncs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if old.exists():
        shutil.rmtree(old)
        fsync_dir(work)
    t["retire old"] = time.perf_counter() - t0
    return t


def measure(label: str, snap: contents.Snapshot, work: Path, rounds: int) -> None:
    store = CheckpointStore(work / "ck", keep_last=1)
    step = [0]

    def commit() -> tuple[float, float]:
        step[0] += 1
        os.sync()
        t0 = time.perf_counter()
        store.save(step[0], lambda d: contents.write_snapshot(d, snap), {})
        t1 = time.perf_counter()
        store.settle()  # retirement runs behind the commit: time it apart
        return t1 - t0, time.perf_counter() - t1

    commit()  # warm-up
    phases: dict[str, list[float]] = {}
    whole, retired = [], []
    for _ in range(rounds):
        for k, v in v1_phases(work, snap).items():
            phases.setdefault(k, []).append(v)
        t, r = commit()
        whole.append(t)
        retired.append(r)
    nbytes = sum(p.stat().st_size for p in store.committed()[-1][1].iterdir())
    print(f"\n{label}: {nbytes / 1e6:.1f} MB, median of {rounds}")
    total = 0.0
    for k, v in phases.items():
        m = statistics.median(v)
        total += m if not k.startswith("(") else 0.0
        print(f"  ember/1 {k:34s} {m:7.3f} s")
    print(f"  ember/1 sum of phases {'':20s} {total:7.3f} s")
    print(f"  ember/2 commit (store.save, retirement off its path) {statistics.median(whole):7.3f} s")
    print(f"  ember/2 retirement, behind the commit {'':12s} {statistics.median(retired):7.3f} s")
    shutil.rmtree(work / "ck")
    shutil.rmtree(work / "v1", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-phases-", dir=args.dir))
    try:
        for label, make in (("full fine-tuning state", full_state), ("LoRA state", lora_state)):
            model, opt, sched, scaler, state = make()
            snap = contents.snapshot(model, opt, sched, scaler, state, copy=False)
            measure(label, snap, work / label.split()[0], args.rounds)
            del model, opt, snap
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
