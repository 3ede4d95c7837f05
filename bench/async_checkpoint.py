"""How long an asynchronous checkpoint blocks training, against a synchronous durable save of
the same state, and how much a background persist slows the steps that run beside it: the
trade-off of the persist thread's niceness ([checkpoint] persist_nice) against how long it
takes to make the checkpoint durable, with the buffered writer (before O_DIRECT) as baseline.

State: SmolLM2-135M's shape, full fine-tuning (weights + AdamW moments, ~1.6 GB). Training
beside the persist: the widened builtin model of loop_overhead.py, on every core.

Step times on a shared virtual machine drift by 10-20% from minute to minute, more than the
effect measured, so the steps beside a persist are compared with steps taken in the same
minute: for each writer, persists alternate with quiet periods as long as the persist took
(`--seconds` per writer), every step is classified as beside a persist or quiet by its start
and end, and the medians of both are compared. Also printed: the extra step time a persist
costs in all (its steps' excess over the quiet median, summed), and the persist alone.
Goals (the performance issue): blocked <= 5% of the synchronous save; steps beside a persist
within 3%, with the persist within 2x its standalone time.

usage: python bench/async_checkpoint.py [--seconds 60] [--rounds 2] [--nice 10,13,16,19]
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


class Bench:
    def __init__(self, work: Path):
        torch.manual_seed(0)
        self.model = smollm2_shaped()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        ids = torch.zeros(1, 8, dtype=torch.long)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        self.state = RunState(step=0)
        self.state.capture_rng(torch.device("cpu"))
        self.store = CheckpointStore(work / "ck", keep_last=1)
        self.buffers: dict = {}  # kept across snapshots, as the training loop keeps them
        self.step = trainer()

    def snapshot(self, buffered: bool) -> contents.Snapshot:
        self.state.step += 1
        snap = contents.snapshot(self.model, self.opt, self.sched, self.scaler, self.state, copy=True,
                                 buffers=self.buffers)
        if buffered:
            snap.images = {}  # the same host copies, written through the page cache as before O_DIRECT
        return snap

    def blocking(self) -> tuple[float, float]:
        """(seconds a synchronous durable save blocks, seconds an asynchronous one blocks)."""
        os.sync()
        self.state.step += 1
        t0 = time.perf_counter()
        snap = contents.snapshot(self.model, self.opt, self.sched, self.scaler, self.state, copy=False)
        CheckpointWriter(self.store, background=False).submit(self.state.step, snap, {}, blocked=0.0)
        sync = time.perf_counter() - t0
        os.sync()
        t0 = time.perf_counter()
        writer = CheckpointWriter(self.store, background=True)
        writer.submit(self.state.step + 1, self.snapshot(False), {}, blocked=0.0)
        blocked = time.perf_counter() - t0
        writer.wait()
        return sync, blocked

    def alone(self, buffered: bool) -> float:
        os.sync()
        writer = CheckpointWriter(self.store, background=True)
        snap = self.snapshot(buffered)
        t0 = time.perf_counter()
        writer.submit(self.state.step, snap, {}, blocked=0.0)
        writer.wait()
        return time.perf_counter() - t0

    def beside(self, buffered: bool, nice: int, seconds: float) -> dict:
        """Persists alternating with quiet periods of the same length, for `seconds`."""
        on, off, persists = [], [], []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            os.sync()
            writer = CheckpointWriter(self.store, background=True, nice=nice)
            writer.submit(self.state.step, self.snapshot(buffered), {}, blocked=0.0)
            t0 = time.perf_counter()
            while writer.in_flight:
                on.append(self.step())
            writer.wait()
            persists.append(time.perf_counter() - t0)
            quiet_until = time.perf_counter() + persists[-1]
            self.step()  # the step that straddles the persist's end is neither
            while time.perf_counter() < quiet_until:
                off.append(self.step())
        return {"on": on, "off": off, "persists": persists}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60, help="per writer and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nice", default="10,13,16,19", help="persist_nice values to measure with O_DIRECT")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-async-bench-", dir=os.environ.get("EMBER_BENCH_DIR")))
    b = Bench(work)
    for _ in range(3):
        b.step()  # warm-up
    b.snapshot(False)  # the first snapshot page-faults its buffers in
    writers = [("buffered (before), nice 10", True, 10)] + [(f"O_DIRECT, nice {n}", False, int(n))
                                                            for n in args.nice.split(",")]
    blocking = [b.blocking() for _ in range(3)]
    sync, blocked = statistics.median(x for x, _ in blocking), statistics.median(y for _, y in blocking)
    print(f"training blocked per checkpoint, median of 3: synchronous durable save {sync:.3f} s; "
          f"asynchronous (snapshot) {blocked:.3f} s = {blocked / sync:.1%} of synchronous (goal <= 5%)", flush=True)
    got: dict[str, dict] = {name: {"on": [], "off": [], "persists": [], "alone": []} for name, _, _ in writers}
    for r in range(args.rounds):
        order = writers if r % 2 == 0 else writers[::-1]
        for name, buffered, nice in order:
            g = got[name]
            g["alone"].append(b.alone(buffered))
            for key, values in b.beside(buffered, nice, args.seconds).items():
                g[key] += values
            print(f"round {r + 1} {name}: {len(g['persists'])} persists so far, last {g['persists'][-1]:.1f} s",
                  flush=True)
    print("\n| writer | step quiet | step beside a persist | slowdown | persist beside training | persist alone "
          "| beside / alone | extra step time per persist |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, _, _ in writers:
        g = got[name]
        q, s = statistics.median(g["off"]), statistics.median(g["on"])
        pb, pa = statistics.median(g["persists"]), statistics.median(g["alone"])
        extra = sum(x - q for x in g["on"]) / len(g["persists"])
        print(f"| {name} | {q * 1e3:.0f} ms | {s * 1e3:.0f} ms | {s / q - 1:+.1%} | {pb:.1f} s | {pa:.2f} s "
              f"| x{pb / pa:.1f} | {extra:.2f} s |")
    print(f"\nsteps: {sum(len(g['on']) for g in got.values())} beside persists, "
          f"{sum(len(g['off']) for g in got.values())} quiet")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
