"""The parallelism advisor's arithmetic: for a recipe, the interconnect `ember doctor --comm`
measured, and a one-device step time, the memory per device and the step time of each strategy
at 1, 2, 4 and 8 devices, and one recommendation with its reasons.

A collective's cost is the ring model of ember/parallel/collectives.py (hops x latency + share x
bytes / bandwidth), with latency and bandwidth fitted here (`fit`) to the sizes measured. Each
strategy ember runs (ember.parallel.registry) prices its step and its memory per device itself,
its module's docstring says how (pipeline parallelism, ember/parallel/pp.py: the bubble
(p-1)/(m+p-1) and one send of the activations per stage boundary and micro-batch, each way).

Compute splits n ways (TP splits the layers' matmuls; the embeddings and head stay whole on
every rank). Communication hides behind the backward pass only where the device computes while
the network moves (NCCL on a GPU: its own stream); on a CPU under gloo the same cores do both,
so none of it is hidden. The advisor says "stay on one device and accumulate gradients" when no
wider layout reaches MIN_EFFICIENCY scaling efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.parallel.collectives import Interconnect, Link, collective_seconds, hops_share
from ember.parallel.registry import STRATEGIES
from ember.parallel.strategy import Ranks, Step
from ember.plan.layout import footprint
from ember.plan.memory import Breakdown, ModelShape, TrainShape

DEVICE_COUNTS = (1, 2, 4, 8)
MIN_EFFICIENCY = 0.6   # below this, the extra devices mostly wait on the network


def fit(kind: str, n: int, sizes: list[int], seconds: list[float]) -> Link:
    """Latency and bandwidth by least squares of seconds = hops*latency + share*bytes/bandwidth
    over the measured message sizes (both kept positive)."""
    hops, share = hops_share(kind, n)
    xs = [share * b for b in sizes]
    mx, my = sum(xs) / len(xs), sum(seconds) / len(seconds)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / var if var else 0.0
    slope = max(slope, 1e-15)
    intercept = max(my - slope * mx, 0.0)
    return Link(intercept / max(hops, 1), 1.0 / slope)


@dataclass
class Option:
    strategy: str
    devices: int
    step_seconds: float      # predicted, the whole optimizer step
    compute_seconds: float
    comm_seconds: float      # all of it
    exposed_seconds: float   # the part not hidden behind compute
    memory_bytes: int        # per device, at the step's peak
    fits: bool
    efficiency: float        # one device's step time / (devices x this step time)
    bytes_per_step: float    # moved over each rank's link
    notes: list[str] = field(default_factory=list)


@dataclass
class Advice:
    options: list[Option]
    recommended: Option | None
    reasons: list[str]
    interconnect: Interconnect


def options_at(n: int, m: ModelShape, t: TrainShape, b: Breakdown, accum: int, one_step: float,
               ic: Interconnect, free: int, overlap: bool, slots: int | None = None,
               pipeline: tuple[str, int] = ("1f1b", 2)) -> list[Option]:
    """Every strategy at n devices (see the module docstring).
    `slots`: how many ranks can compute at once (CPU ranks on one machine share its cores); None
    for accelerators. `pipeline`: the recipe's [distributed] schedule and pp_size."""
    fp = footprint(m, b, t, (accum, *pipeline))  # what each strategy's arithmetic reads (ember.plan.layout)
    act_bytes = t.micro_batch * t.seq_len * m.hidden * (2 if t.autocast else 4)
    busy = n / min(n, slots or n)  # >1 when more ranks than can compute at once share the cores
    out = []

    def add(strategy: str, comp: float, comm: float, hidden: float, memory: float, moved: float,
            notes: list[str] | None = None) -> None:
        exposed = max(0.0, comm - hidden)
        step = comp + exposed
        out.append(Option(strategy, n, step, comp, comm, exposed, int(memory), memory <= free,
                          one_step / (n * step) if step > 0 else 0.0, moved, notes or []))

    if n == 1:
        add("one device", one_step, 0.0, 0.0, b.peak, 0.0)
        return out
    step = Step(one_step, accum, t.micro_batch, m.layers, act_bytes)
    ranks = Ranks(n, busy, overlap, ic)
    for strategy in STRATEGIES.values():
        if t.lora and strategy.lora_conflict:  # the run would refuse it (ember.train.sharding)
            continue
        if (c := strategy.cost(fp, step, ranks)) is not None:
            add(strategy.name, c.compute, c.comm, c.hidden, c.memory, c.moved, notes=list(c.notes))
    return out


def core_sharing(ranks: int, threads: int, cores: int) -> str | None:
    """Why CPU ranks on one machine scale no better than they do, when their threads outnumber
    its cores (None when they do not): they take turns on the cores, whatever the network does."""
    if threads <= 0 or cores <= 0 or ranks * threads <= cores:
        return None
    return (f"{ranks} ranks x {threads} threads per rank = {ranks * threads} threads on {cores} cores: "
            f"the ranks share the cores, so each rank computes no faster than one device alone")


def advise(m: ModelShape, t: TrainShape, b: Breakdown, accum: int, one_step: float, ic: Interconnect,
           free: int, counts: tuple[int, ...] = DEVICE_COUNTS, slots: int | None = None,
           threads: int = 0, cores: int = 0, pipeline: tuple[str, int] = ("1f1b", 2)) -> Advice:
    """Every option at each device count, and the one to take (`threads` per CPU rank and the
    machine's `cores`, where known, name core sharing as the cause when ranks outnumber them;
    `pipeline`: the recipe's [distributed] schedule and pp_size, as its pipelines would run)."""
    overlap = ic.backend == "nccl"
    options = [o for n in counts
               for o in options_at(n, m, t, b, accum, one_step, ic, free, overlap, slots, pipeline)]
    runnable = [o for o in options if o.fits]
    single = next((o for o in options if o.devices == 1), None)
    wide = [o for o in runnable if o.devices > 1 and o.efficiency >= MIN_EFFICIENCY]
    reasons = []
    if wide:
        best = min(wide, key=lambda o: o.step_seconds)
        reasons.append(f"{best.strategy} on {best.devices} devices: {best.step_seconds:.3g} s a step against "
                       f"{one_step:.3g} s on one ({best.efficiency:.0%} scaling efficiency); "
                       f"{best.exposed_seconds:.3g} s of it is communication the compute does not hide")
    elif single is not None and single.fits:
        best = single
        near = min((o for o in runnable if o.devices == 2), key=lambda o: o.step_seconds, default=None)
        if near is not None:
            shared = core_sharing(near.devices, threads, cores * max(1, ic.nodes))
            head = (f"stay on one device and accumulate gradients: the best of 2 devices ({near.strategy}) "
                    f"would take {near.step_seconds:.3g} s a step against {one_step:.3g} s, "
                    f"{near.efficiency:.0%} efficient, because ")
            link = (f"{near.comm_seconds:.3g} s of it is moving {near.bytes_per_step / 1e6:.3g} MB per rank over "
                    f"a link measured at {ic.all_reduce.bandwidth / 1e6:.3g} MB/s")
            if shared:
                reasons.append(head + f"{shared} ({near.compute_seconds:.3g} s of compute a step against "
                               f"{one_step / near.devices:.3g} s with cores of their own); {link}")
            else:
                reasons.append(head + link)
    else:
        best = min(runnable, key=lambda o: o.step_seconds, default=None)
        if best is not None:
            reasons.append(f"the model does not fit one device; {best.strategy} on {best.devices} is the fastest "
                           f"layout that fits ({best.memory_bytes / 2**30:.2f} GiB per device)")
        else:
            reasons.append("no layout up to 8 devices fits: remote compute with larger devices, or LoRA")
    return Advice(options, best, reasons, ic)
