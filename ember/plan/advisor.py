"""The parallelism advisor's arithmetic: for a recipe, the interconnect `ember doctor --comm`
measured, and a one-device step time, the memory per device and the step time of each strategy
at 1, 2, 4 and 8 devices, and one recommendation with its reasons.

Collectives (the bus-bandwidth model of nccl-tests): a ring collective over n ranks takes
`hops` latency-bound steps and moves `share` x the tensor's bytes over each rank's link:

    all-reduce       hops 2(n-1)   share 2(n-1)/n
    all-gather       hops (n-1)    share (n-1)/n    (bytes: the whole gathered tensor)
    reduce-scatter   hops (n-1)    share (n-1)/n    (bytes: the whole tensor before scattering)

so seconds = hops x latency + share x bytes / bandwidth, with latency and bandwidth fitted to
the measured sizes. Each strategy's bytes per optimizer step (A micro-batches, n ranks):

    ddp        one all-reduce of the gradients (accumulation syncs only the last micro-batch)
    fsdp       per micro-batch an all-gather of the weights in forward and again in backward
               (FSDP2 reshards after forward), one reduce-scatter of the gradients
    tp         per micro-batch and layer, two all-reduces of the activations forward and two
               backward; every rank computes every micro-batch, its share of each layer
    pp         advice only: the bubble (p-1)/(m+p-1) and one send of the activations per
               stage boundary and micro-batch, each way
    fsdp+tp    tp inside pairs of ranks, fsdp across the pairs (n >= 4)

Compute splits n ways (TP splits the layers' matmuls; the embeddings and head stay whole on
every rank). Communication hides behind the backward pass only where the device computes while
the network moves (NCCL on a GPU: its own stream); on a CPU under gloo the same cores do both,
so none of it is hidden. The advisor says "stay on one device and accumulate gradients" when no
wider layout reaches MIN_EFFICIENCY scaling efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.plan.memory import Breakdown, ModelShape, TrainShape

STRATEGIES = ("ddp", "fsdp", "tp", "fsdp+tp", "pp")
DEVICE_COUNTS = (1, 2, 4, 8)
MIN_EFFICIENCY = 0.6   # below this, the extra devices mostly wait on the network
BACKWARD_SHARE = 2 / 3  # of a step's compute (backward costs about twice forward)


@dataclass(frozen=True)
class Link:
    """One collective's fitted cost on the measured interconnect."""
    latency: float     # seconds per ring hop
    bandwidth: float   # bytes/s over each rank's link (bus bandwidth)


@dataclass(frozen=True)
class Interconnect:
    ranks: int
    nodes: int
    backend: str
    all_reduce: Link
    all_gather: Link
    reduce_scatter: Link
    measured: str = ""   # when and where (for the reasons)


def hops_share(kind: str, n: int) -> tuple[int, float]:
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    return n - 1, (n - 1) / n


def collective_seconds(link: Link, kind: str, nbytes: float, n: int) -> float:
    """Seconds for one ring collective of `nbytes` over n ranks (0 for one rank)."""
    if n <= 1:
        return 0.0
    hops, share = hops_share(kind, n)
    return hops * link.latency + share * nbytes / link.bandwidth


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
    advice_only: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class Advice:
    options: list[Option]
    recommended: Option | None
    reasons: list[str]
    interconnect: Interconnect


def tp_share(m: ModelShape) -> float:
    """Share of a token's matmul FLOPs inside the decoder layers (what TP splits)."""
    layers = m.layers * sum(i * o for i, o in m.linear_shapes().values())
    return layers / (layers + m.vocab * m.hidden)


def options_at(n: int, m: ModelShape, t: TrainShape, b: Breakdown, accum: int, one_step: float,
               ic: Interconnect, free: int, overlap: bool, slots: int | None = None) -> list[Option]:
    """Every strategy at n devices (see the module docstring). `slots`: how many ranks can
    compute at once (CPU ranks on one machine share its cores); None for accelerators."""
    weights = m.params() * 4  # fp32 master weights (autocast computes in bf16/fp16 from them)
    grads = b.trainable * 4
    state = b.weights + b.gradients + b.optimizer
    act_bytes = t.micro_batch * t.seq_len * m.hidden * (2 if t.autocast else 4)
    busy = n / min(n, slots or n)  # >1 when more ranks than can compute at once share the cores
    compute = one_step / n * busy
    hide = BACKWARD_SHARE * compute if overlap else 0.0
    out = []

    def add(strategy: str, comp: float, comm: float, hidden: float, memory: float, moved: float,
            advice_only: bool = False, notes: list[str] | None = None) -> None:
        exposed = max(0.0, comm - hidden)
        step = comp + exposed
        out.append(Option(strategy, n, step, comp, comm, exposed, int(memory), memory <= free,
                          one_step / (n * step) if step > 0 else 0.0, moved, advice_only, notes or []))

    if n == 1:
        add("one device", one_step, 0.0, 0.0, b.peak, 0.0)
        return out
    per_rank = max(1, accum // n)
    ar = collective_seconds(ic.all_reduce, "all_reduce", grads, n)
    add("ddp", compute, ar, hide, b.peak, hops_share("all_reduce", n)[1] * grads,
        notes=[] if t.micro_batch * accum % n == 0 else
        [f"micro_batch x grad_accum = {t.micro_batch * accum} rows do not share out over {n} ranks"])
    ag = collective_seconds(ic.all_gather, "all_gather", weights, n)
    rs = collective_seconds(ic.reduce_scatter, "reduce_scatter", grads, n)
    layer = m.layer_params() * 4
    fsdp_mem = b.peak - state * (1 - 1 / n) + 2 * layer  # its shard, and two layers gathered at once
    add("fsdp", compute, 2 * per_rank * ag + rs, hide, fsdp_mem,
        2 * per_rank * hops_share("all_gather", n)[1] * weights + hops_share("reduce_scatter", n)[1] * grads)
    f = tp_share(m)
    tp_comp = one_step * (f / n * busy + (1 - f))
    tp_ar = 4 * m.layers * accum * collective_seconds(ic.all_reduce, "all_reduce", act_bytes, n)
    tp_mem = b.peak - state * f * (1 - 1 / n) - b.activations * 0.5 * (1 - 1 / n)
    add("tp", tp_comp, tp_ar, 0.0, tp_mem, 4 * m.layers * accum * hops_share("all_reduce", n)[1] * act_bytes,
        notes=["the layers' activations cross the link four times per micro-batch: keep it within one node"])
    if n >= 4:
        dp, tp = n // 2, 2
        comp = one_step * (f / tp + (1 - f)) / dp * busy
        mb = max(1, accum // dp)
        comm = (4 * m.layers * mb * collective_seconds(ic.all_reduce, "all_reduce", act_bytes, tp)
                + 2 * mb * collective_seconds(ic.all_gather, "all_gather", weights / tp, dp)
                + collective_seconds(ic.reduce_scatter, "reduce_scatter", grads / tp, dp))
        moved = (4 * m.layers * mb * act_bytes + 2 * mb * hops_share("all_gather", dp)[1] * weights / tp
                 + hops_share("reduce_scatter", dp)[1] * grads / tp)
        add("fsdp+tp", comp, comm, 0.0, b.peak - state * (1 - 1 / n) - b.activations * 0.25, moved,
            notes=["tensor parallel in pairs of ranks (keep a pair within a node), FSDP across the pairs"])
    p, micro = n, accum
    bubble = (p - 1) / (micro + p - 1)
    sends = 2 * (p - 1) * micro * (ic.all_reduce.latency + act_bytes / ic.all_reduce.bandwidth)
    add("pp", one_step / p * busy / (1 - bubble), sends, 0.0, state / p + b.activations * p + b.temporaries,
        2 * micro * act_bytes, advice_only=True,
        notes=[f"advice only (ember does not run pipeline parallelism yet); bubble {bubble:.0%} with {micro} "
               f"micro-batches over {p} stages"])
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
           threads: int = 0, cores: int = 0) -> Advice:
    """Every option at each device count, and the one to take (`threads` per CPU rank and the
    machine's `cores`, where known, name core sharing as the cause when ranks outnumber them)."""
    overlap = ic.backend == "nccl"
    options = [o for n in counts for o in options_at(n, m, t, b, accum, one_step, ic, free, overlap, slots)]
    runnable = [o for o in options if o.fits and not o.advice_only]
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
