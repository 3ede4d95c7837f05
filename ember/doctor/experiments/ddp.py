"""DDP: N processes on this machine, gloo over loopback, the recipe's model under DDP, forked
from one server process that imported torch and the model's code once, instead of N processes
each importing them on a shared CPU. Each rank takes the loop's train_step with gradient
synchronisation, the same step on the bare model (never synchronised), and the all-reduce
alone, in rounds; rank 0 decides for all whether another round fits and is still needed."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember.doctor.diagnose import DdpFigures, difference
from ember.doctor.experiments.budget import MIN_SAMPLES, Budget, Stop
from ember.doctor.experiments.protocol import Lab, Result
from ember.doctor.measure import synthetic
from ember.scratch import scratch
from ember.train.loop import train_step

MAX_ROUNDS = 16


@dataclass
class Ddp:
    """The processes get what starting and a few rounds need (asked for by name, DDP goes before
    the others' shares), and are stopped at the command's deadline."""
    lab: Lab
    world: int
    cold_start: float   # seconds this process took to its first step: what a fresh rank takes
    model_module: str   # the model's code, imported once by the server the ranks fork from
    name = "ddp"
    changes = "gradient synchronisation across N processes on loopback, against none"

    def run(self, budget: Budget) -> Result:
        """figures["ddp"]: each round's seconds synchronised, bare, and the all-reduce alone."""
        out = Result(self.name)
        # Starting costs what this process took to its first step (measured under the same load);
        # then a warm-up and MIN_SAMPLES rounds of a synchronised step, a bare one and an all-reduce
        # (at most a step), the N processes sharing what this one had.
        need = self.cold_start + (1 + MIN_SAMPLES) * 3 * self.lab.step * self.world
        stop = Stop(time.monotonic() + min(budget.left() - 1.0, max(budget.share([self.name]), 1.5 * need)),
                    self.lab.tolerance)
        if not stop.fits(need):
            return out.skip(f"{self.world} processes need ~{need:.0f} s to start and measure here; "
                            f"{stop.left():.1f} s left of the budget")
        self.lab.events.stage(f"doctor: DDP over gloo, {self.world} processes on loopback")
        with scratch("doctor-ddp-") as folder:
            result = self._spawn(folder / "result.json", stop, budget.deadline)
        if result is None:
            return out.skip("the processes were still starting at the budget's deadline")
        if "skipped" in result:
            return out.skip(result["skipped"])
        out.figures["ddp"] = DdpFigures(**result)
        return out

    def _spawn(self, result: Path, stop: Stop, deadline: float) -> dict | None:
        """The ranks' result, or None when they were stopped at `deadline` (time.monotonic())."""
        import multiprocessing

        import torch.multiprocessing as mp
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch.distributed", "ember.train.parts", "ember.train.loop", __name__, self.model_module])
        until = time.time() + stop.left()  # the ranks' clock: monotonic times are per process
        ctx = mp.start_processes(_ddp_worker, args=(self.world, self.lab.recipe.to_dict(), until, stop.tolerance,
                                                    str(result)), nprocs=self.world, start_method="forkserver",
                                 join=False)
        # The processes plan their rounds to end by `until`, and report when start-up left too
        # little; they are stopped only at the command's own deadline.
        while not ctx.join(timeout=max(0.05, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:  # ours, started above: stopped by their own handles
                    p.kill()
                    p.join()
                return None
        return json.loads(result.read_text())


def _ddp_worker(rank: int, world: int, recipe: dict, until: float, tolerance: float, out: str) -> None:
    """One rank: rounds of train_step with the model under DDP (gradients synchronised on each
    step's last micro-batch), the same step on the bare model, and the all-reduce alone."""
    import torch.distributed as dist

    from ember.recipe import build_recipe
    r = build_recipe(recipe, "the doctor's DDP worker")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # A file store, not TCP: a TCP store lives in rank 0, and a rank still tearing down after
    # rank 0 exited waits for it forever (seen here one run in four).
    store = Path(out).with_name("store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        synced, bare, allreduce = _ranks_steps(r, rank)
        stop = Stop(time.monotonic() + until - time.time(), tolerance)
        rounds = _rounds(synced, bare, allreduce, stop)
        if rank == 0:
            n, last = len(rounds["synced"]), rounds.pop("last")
            result = ({"world": world, "backend": "gloo", **rounds} if n >= MIN_SAMPLES else
                      {"skipped": f"after start-up only {n} rounds of {last:.2f} s fitted before the deadline"})
            Path(out).write_text(json.dumps(result))
        dist.barrier()  # no rank is still inside a collective
    except BaseException:
        dist.destroy_process_group()
        raise
    # Tearing gloo down races with the peer doing the same and hung one run in four here; the
    # result is written and closed, so the process ends without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ranks_steps(r: Any, rank: int) -> tuple[Callable[[], float], ...]:
    """This rank's three timed calls, each after a barrier: the synchronised step, the bare one,
    and the all-reduce of a flat buffer the size of the trainable parameters."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ember.ckpt.state import seed_all
    from ember.train.model import load_model, trainable_parameters
    from ember.train.parts import build_parts
    seed_all(r.train.seed)
    ddp = DDP(load_model(r.model, r.method, r.train.activation_checkpointing).model)
    synced_parts = build_parts(r, torch.device("cpu"), ddp)
    bare_parts = dataclasses.replace(synced_parts, model=ddp.module)  # same weights and optimizer
    vocab = ddp.module.get_input_embeddings().weight.shape[0]
    data = synthetic(torch.randint(0, vocab, (r.train.micro_batch, r.data.seq_len),
                                   generator=torch.Generator().manual_seed(rank)))
    flat = torch.zeros(sum(p.numel() for p in trainable_parameters(ddp)))

    def timed(call: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            dist.barrier()
            t0 = time.perf_counter()
            call()
            return time.perf_counter() - t0
        return run
    return (timed(lambda: train_step(synced_parts, data)), timed(lambda: train_step(bare_parts, data)),
            timed(lambda: dist.all_reduce(flat)))


def _rounds(synced: Callable[[], float], bare: Callable[[], float], allreduce: Callable[[], float],
            stop: Stop) -> dict[str, Any]:
    """Rounds of the three until MAX_ROUNDS, `stop`'s time, or a settled synchronisation cost.
    Every rank must run the same collectives: rank 0 decides whether a round still fits."""
    import torch.distributed as dist
    synced()  # warm-up: the optimizer's state, DDP's buckets
    got: dict[str, Any] = {"synced": [], "unsynced": [], "allreduce": [], "last": 0.0}
    while len(got["synced"]) < MAX_ROUNDS:
        settled = stop.settled(difference(got["synced"], got["unsynced"], paired=True), len(got["synced"]))
        go = torch.tensor([int(stop.fits(1.2 * got["last"]) and not settled)])
        dist.broadcast(go, src=0)
        if not int(go):
            break
        t0 = time.perf_counter()
        got["synced"].append(synced())
        got["unsynced"].append(bare())
        got["allreduce"].append(allreduce())
        got["last"] = time.perf_counter() - t0
    return got
