"""`ember doctor --comm`: measure the interconnect between the processes (and nodes) a run would
use, the way the run would use it: ranks started by torchrun's launcher (ember.ranks), the run's
backend (gloo on CPU, NCCL on CUDA), all-reduce, all-gather and reduce-scatter at message sizes
from 4 KiB to 16 MiB. Each size is timed a few times after a warm-up, every rank between two
barriers, and the slowest rank's time is the collective's. Latency and bandwidth are fitted per
collective (ember.plan.advisor.fit) and stored in the ledger, where `ember plan` finds them.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from ember.errors import EXIT_OK, EmberError
from ember.events import Events
from ember.ledger.comm_rows import InterconnectRow
from ember.plan.advisor import Interconnect, Link, fit
from ember.ranks import Topology, launch

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]   # bytes
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
SECONDS_PER_SIZE = 0.6   # timing budget per collective and size (after a warm-up)
MAX_REPEATS = 20


def measure(topology: Topology, device: str, events: Events, scratch: Path) -> InterconnectRow | None:
    """Start the ranks, each timing the collectives; the row rank 0 wrote (None off node 0)."""
    if topology.world < 2:
        raise EmberError("--comm needs at least two ranks: --nproc 2, or --nnodes 2 with --rdzv")
    out = scratch / "comm.json"
    events.stage(f"doctor: timing collectives between {topology.world} ranks")
    code = launch(topology, ["-m", "ember", "doctor", "--comm-rank", str(out), "--device", device],
                  "doctor-comm", events)  # the same on every node: the rendezvous keys its store by it
    if code != EXIT_OK:
        raise EmberError(f"the measuring ranks failed (exit {code}); see their messages above")
    if topology.node_rank != 0:
        return None
    return InterconnectRow(**json.loads(out.read_text()))


def to_interconnect(row: InterconnectRow) -> Interconnect:
    links = {k: Link(v["latency"], v["bandwidth"]) for k, v in row.links.items()}
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row.time))
    return Interconnect(row.ranks, row.nodes, row.backend, links["all_reduce"], links["all_gather"],
                        links["reduce_scatter"], f"{row.backend}, {row.ranks} ranks on {row.nodes} node(s), "
                        f"measured {when}")


def rank_main(out: Path, device_kind: str) -> int:
    """One measuring rank (started by the launcher with torchrun's variables)."""
    import torch
    import torch.distributed as dist

    from ember.device import pick_device
    from ember.world import join
    dev = pick_device(device_kind)
    if dev.type != "cpu":  # one accelerator per rank on its node, as a run places them
        dev = torch.device(dev.type, int(os.environ.get("LOCAL_RANK", "0")))
    world = join(dev, timeout_seconds=120)
    n = world.size
    samples: dict[str, dict[str, float]] = {k: {} for k in KINDS}
    for kind in KINDS:
        for size in SIZES:
            elems = size // 4
            x = torch.ones(elems, device=dev)
            small = torch.empty(elems // n, device=dev)

            def one() -> None:
                if kind == "all_reduce":
                    dist.all_reduce(x)
                elif kind == "all_gather":  # the gathered tensor is `size` bytes, each rank gives size/n
                    dist.all_gather_single(x, small)
                else:
                    dist.reduce_scatter_single(small, x)
            times = []
            for i in range(MAX_REPEATS + 2):
                dist.barrier()
                t0 = time.perf_counter()
                one()
                if dev.type != "cpu":
                    torch.accelerator.synchronize()
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the collective ends with the slowest rank
                if i >= 2:
                    times.append(took.item())
                go = torch.tensor([1 if sum(times) < SECONDS_PER_SIZE else 0])
                dist.broadcast(go, 0)  # every rank stops after the same repeat
                if not go.item():
                    break
            samples[kind][str(size)] = statistics.median(times)
    hosts = world.gather(socket.gethostname())
    if world.main:
        links = {}
        for kind in KINDS:
            link = fit(kind, n, [int(s) for s in samples[kind]], list(samples[kind].values()))
            links[kind] = {"latency": link.latency, "bandwidth": link.bandwidth}
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        row = {"time": time.time(), "hosts": sorted(set(hosts)), "ranks": n, "nodes": nodes,
               "backend": world.backend, "links": links, "samples": samples}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(row))
        os.replace(tmp, out)
    world.close()
    sys.stdout.flush()
    return EXIT_OK
