"""How long an asynchronous checkpoint blocks training, against a synchronous durable save of
the same state, and how much a background persist slows the steps that run beside it.

State: SmolLM2-135M's shape, full fine-tuning (weights + AdamW moments, ~1.6 GB). Training
beside the persist: the widened builtin model of loop_overhead.py. Medians over rounds.
Goals (the long-runs issue): blocked <= 5% of the synchronous save (>= 20x); slowdown < 3%.

Thread or process: the same persist (commit protocol, SHA-256, fsync) also runs in a persist
process started once, at the same nice 10, which receives each snapshot through shared memory
(the snapshot buffers are allocated shared, so a checkpoint sends only handles). Both variants
are timed in the same rounds: snapshot cost, step slowdown beside the persist, persist time.

usage: python bench/async_checkpoint.py [--rounds 3]
"""

from __future__ import annotations

import argparse
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
from checkpoint import smollm2_shaped  # noqa: E402

from ember.ckpt import contents  # noqa: E402
from ember.ckpt.state import RunState  # noqa: E402
from ember.ckpt.store import CheckpointStore  # noqa: E402
from ember.ckpt.writer import CheckpointWriter  # noqa: E402


def trainer():
    """A small model and one training step function, for step times beside a persist."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=257, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 257, (8, 256))

    def step() -> float:
        t0 = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0
    return step


def persist_worker(root: str, jobs, done) -> None:
    """The process variant: persist each snapshot that arrives, as the writer thread would."""
    os.nice(10)
    torch.set_num_threads(1)
    store = CheckpointStore(Path(root), keep_last=1)
    while (job := jobs.get()) is not None:
        step, snap = job
        store.save(step, lambda folder: contents.write_snapshot(folder, snap), {})
        done.put(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-async-bench-"))
    torch.manual_seed(0)
    model = smollm2_shaped()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = RunState(step=0)
    state.capture_rng(torch.device("cpu"))
    store = CheckpointStore(work / "ck", keep_last=1)
    step = trainer()
    buffers: dict = {}  # kept across snapshots, as the training loop keeps them
    for _ in range(3):
        step()  # warm-up

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    jobs, done = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=persist_worker, args=(str(work / "ck-process"), jobs, done), daemon=True)
    worker.start()
    shared: dict = {}  # the process variant's snapshot buffers, in shared memory
    proc_blocked, proc_beside, proc_persist = [], [], []
    sync_blocked, async_blocked, quiet_steps, beside_steps, persist_seconds = [], [], [], [], []
    for r in range(args.rounds):
        os.sync()
        state.step += 1
        t0 = time.perf_counter()  # synchronous: the training thread waits for durability
        writer = CheckpointWriter(store, background=False)
        snap = contents.snapshot(model, opt, sched, scaler, state, copy=False)
        writer.submit(state.step, snap, {}, blocked=0.0)
        sync_blocked.append(time.perf_counter() - t0)

        os.sync()
        quiet_steps += [step() for _ in range(8)]  # steps with nothing in the background
        state.step += 1
        writer = CheckpointWriter(store, background=True)
        t0 = time.perf_counter()  # asynchronous: the training thread waits for the snapshot only
        snap = contents.snapshot(model, opt, sched, scaler, state, copy=True, buffers=buffers)
        writer.submit(state.step, snap, {}, blocked=0.0)
        async_blocked.append(time.perf_counter() - t0)
        t_persist = time.perf_counter()
        while writer.in_flight:
            beside_steps.append(step())
        persist_seconds.append(time.perf_counter() - t_persist)
        writer.wait()
        del snap

        os.sync()
        state.step += 1
        t0 = time.perf_counter()  # process: snapshot into shared buffers, send the handles
        snap = contents.snapshot(model, opt, sched, scaler, state, copy=True, buffers=shared)
        for t in shared.values():
            t.share_memory_()  # a no-op after the first round: the buffers are reused
        jobs.put((state.step, snap))
        proc_blocked.append(time.perf_counter() - t0)
        t_persist = time.perf_counter()
        while done.empty():
            proc_beside.append(step())
        proc_persist.append(time.perf_counter() - t_persist)
        done.get()
        del snap
        print(f"round {r + 1}: sync save {sync_blocked[-1]:.2f}s blocked; thread {async_blocked[-1]:.3f}s "
              f"blocked, persist {persist_seconds[-1]:.2f}s; process {proc_blocked[-1]:.3f}s blocked, "
              f"persist {proc_persist[-1]:.2f}s", flush=True)
    jobs.put(None)
    worker.join(timeout=60)
    s, a = statistics.median(sync_blocked), statistics.median(async_blocked)
    q, b = statistics.median(quiet_steps), statistics.median(beside_steps)
    print(f"\ntraining blocked per checkpoint, median of {args.rounds}:")
    print(f"  synchronous durable save  {s:.3f} s")
    print(f"  asynchronous (snapshot)   {a:.3f} s  = {a / s:.1%} of synchronous ({s / a:.1f}x less; goal <= 5%)")
    print(f"step time: {q * 1000:.1f} ms quiet, {b * 1000:.1f} ms beside a persist "
          f"(slowdown {b / q - 1:+.1%}; goal < 3%), {len(beside_steps)} steps beside persists")
    pb, ps = statistics.median(proc_blocked), statistics.median(proc_beside)
    print(f"thread vs process persist: blocked {a:.3f} s vs {pb:.3f} s; step beside the persist "
          f"{b * 1000:.1f} ms ({b / q - 1:+.1%}) vs {ps * 1000:.1f} ms ({ps / q - 1:+.1%}); persist "
          f"{statistics.median(persist_seconds):.2f} s vs {statistics.median(proc_persist):.2f} s")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
