"""What ranks need of this machine's memory: one rank's bytes at the step's peak under a strategy
of the registry (ember/parallel, each strategy's own `memory`), from the plan's one-process
estimate, and where those bytes land. Ranks on accelerators hold a device each (`ember run
--nproc N` gives local rank i device i); CPU ranks are processes of one machine, so together they
hold N x one rank's bytes of its host RAM. The advisor (ember.plan.advisor), the FSDP remedy
(ember.plan.remedies) and the check before a distributed launch (ember.launch) read these."""

from __future__ import annotations

from dataclasses import dataclass

from ember.hardware import Device
from ember.parallel.registry import STRATEGIES
from ember.parallel.strategy import Footprint, Part, StageParts
from ember.plan.memory import (F32, Breakdown, ModelShape, TrainShape, base_bytes, estimate, fixed_activations,
                               layer_activations, moment_bytes, trainable_params, trainable_sizes,
                               update_temporaries)


def tp_share(m: ModelShape) -> float:
    """Share of a token's matmul FLOPs inside the decoder layers (what TP splits)."""
    layers = m.layers * sum(i * o for i, o in m.linear_shapes().values())
    return layers / (layers + m.vocab * m.hidden)


def footprint(m: ModelShape, b: Breakdown, t: TrainShape, pipeline: tuple[int, str, int] = (2, "1f1b", 2)) -> Footprint:
    """One process's estimate (`b`) of `t` as the strategies' arithmetic reads it; `pipeline`:
    the recipe's grad_accum, [distributed] schedule and pp_size (what a pipeline's stages hold)."""
    # fp32 master weights (autocast computes in bf16/fp16 from them) and the trained ones' gradients
    return Footprint(b.peak, b.weights + b.gradients + b.optimizer, b.activations, m.params() * F32,
                     b.trainable * F32, m.layer_params() * F32, tp_share(m), stage_parts(m, t, pipeline),
                     (m.heads, m.kv_heads, m.intermediate))


def stage_parts(m: ModelShape, t: TrainShape, pipeline: tuple[int, str, int]) -> StageParts:
    """The pieces a pipeline stage holds, each priced as the one-process estimate prices it
    (ember.plan.memory): a decoder layer, the embeddings, the final norm with the head and the loss.
    A stage computes the plain loss (the model's own, not [train] loss_chunk's)."""
    T, h, V = t.tokens, m.hidden, m.vocab
    ends = (2 * V * h + h) * F32  # the embeddings, the final norm and the head stay fp32 (never quantized)
    layer_w = (base_bytes(m, t) - ends) / m.layers + (trainable_params(m, t) / m.layers * F32 if t.lora else 0)
    sizes = trainable_sizes(m, t)
    trained = [sizes[:1], sizes[1:-2], sizes[-2:]] if not t.lora else [[], sizes, []]
    grads = [sum(x) * F32 for x in trained]
    optim = [sum(moment_bytes(n, t.optimizer) for n in x) for x in trained]
    (layer_once, layer_each), (head_once, head_each) = cast_copies(m, t)
    layer = Part(layer_w + (grads[1] + optim[1]) / m.layers, grads[1] / m.layers,
                 layer_activations(m, t) * T + layer_each, layer_once)
    # the first layer of a LoRA model saves less (its input needs no gradient); the ids, for the embedding
    first_acts = (layer_activations(m, t, first=True) - layer_activations(m, t) + 8) * T
    first = Part(V * h * F32 + grads[0] + optim[0], grads[0], first_acts)
    # the head's output (the logits: kept by the schedule as the stage's output; half precision
    # under autocast) and the loss's fp32 log-softmax, per micro-batch; while the loss
    # differentiates: its two T x V gradients
    logits = 2 if t.autocast else F32
    last = Part((V * h + h) * F32 + grads[2] + optim[2], grads[2],
                fixed_activations(m, t) * T + T * V * (logits + F32) + head_each, head_once, 2 * T * V * F32)
    rope = 2 * t.seq_len * m.head_dim * F32
    return StageParts(m.layers, layer, first, last, T * h * F32, rope + 8 * T, update_temporaries(m, t),
                      pipeline, m.tied)


def cast_copies(m: ModelShape, t: TrainShape) -> tuple[tuple[float, float], tuple[float, float]]:
    """Half-precision weight copies autocast leaves saved for backward, (once a step, per micro-batch
    in flight), for a decoder layer and for the head. Autocast caches the cast of a trained weight
    for its whole region (the schedule's step: one copy); a frozen weight (LoRA's base) is cast
    anew by each micro-batch's forward, which keeps its copy until that micro-batch's backward.
    A 4-bit linear casts inside its own matmul; under activation checkpointing a layer's copies
    are remade with it."""
    if not t.autocast:
        return (0.0, 0.0), (0.0, 0.0)
    linears = 0 if t.quantize == "nf4" or t.activation_checkpointing else \
        2 * sum(i * o for i, o in m.linear_shapes().values())
    head = 2 * m.vocab * m.hidden
    if not t.lora:
        return (linears, 0.0), (head, 0.0)
    adapters = 0 if t.activation_checkpointing else 2 * trainable_params(m, t) / m.layers
    return (adapters, linears), (0.0, head)


@dataclass(frozen=True)
class RankMemory:
    """A strategy over `world` ranks, `local` of them on this machine's devices."""
    strategy: str
    world: int
    local: int
    per_rank: int   # bytes one rank holds at the step's peak (the strategy's arithmetic)
    need: int       # bytes one device here must hold: a rank's, or every local rank's in shared host RAM
    free: int       # bytes free on the fullest device the local ranks use
    shared: bool    # the local ranks are processes sharing host RAM (no accelerator)
    missing: int    # accelerators the local ranks lack here (0: one each)


def rank_memory(m: ModelShape, t: TrainShape, strategy: str, world: int, local: int,
                devices: list[Device], pipeline: tuple[int, str, int] = (2, "1f1b", 2)) -> RankMemory:
    """What `local` ranks of a `world`-rank run under `strategy` need of `devices` (the run's,
    ember.hardware.for_run: all of one kind); `pipeline` as `footprint` takes it. Under a pipeline
    a rank's figure is the fullest stage's, whichever rank holds it."""
    b = estimate(m, t)
    per = int(STRATEGIES[strategy].memory(footprint(m, b, t, pipeline), world)) if world > 1 else b.peak
    shared = not devices[0].accelerator
    used = devices[:1] if shared else sorted(devices, key=lambda d: d.index)[:local]
    return RankMemory(strategy, world, local, per, per * local if shared else per, min(d.free for d in used),
                      shared, 0 if shared else max(0, local - len(devices)))
