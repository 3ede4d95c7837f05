"""What a parallelism strategy is: the protocol each module of ember/parallel satisfies, and the
plain figures its arithmetic reads and returns. The planner (ember.plan.advisor) fills them from
its memory estimate and the measured interconnect; the run (ember.train.sharding) asks a strategy
for its mesh and to apply itself. Nothing here imports torch; `apply` does, when a run calls it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ember.errors import EmberError
from ember.parallel.collectives import Interconnect
from ember.parallel.mesh import Mesh

BACKWARD_SHARE = 2 / 3  # of a step's compute (backward costs about twice forward)


@dataclass(frozen=True)
class Footprint:
    """One device's bytes as the plan estimates them for one process (ember.plan.memory)."""
    peak: float          # at the step's peak
    state: float         # weights + gradients + optimizer state, at that peak
    activations: float   # saved activations, at that peak
    weights: float       # the fp32 master weights (what FSDP gathers)
    grads: float         # the trained parameters' fp32 gradients (what DDP all-reduces)
    layer: float         # one decoder layer's fp32 weights
    layer_share: float   # share of a token's matmul FLOPs inside the decoder layers (what TP splits)
    stages: StageParts | None = None  # what a pipeline stage may hold (None: no pipeline priced)
    tp_dims: tuple[int, ...] = ()  # the model's widths tensor parallelism splits (ember.parallel.tp.SPLIT)


@dataclass(frozen=True)
class Part:
    """Bytes of one piece of the model a pipeline stage holds: a decoder layer, the embeddings (the
    first stage's), or the final norm with the head and the loss (the last stage's)."""
    state: float       # its weights, gradients and optimizer state
    grads: float       # of which its gradients (absent until the step's first backward)
    acts: float        # what one micro-batch's forward through it leaves saved for backward
    copies: float = 0.0      # half-precision weight copies autocast keeps (once a step, not per micro-batch)
    transient: float = 0.0   # alive beside one micro-batch's activations while its backward starts (the loss's)


@dataclass(frozen=True)
class StageParts:
    """What a pipeline stage's memory is made of (ember/parallel/pp.py adds it up per stage), and
    the recipe's pipeline: micro-batches a step, schedule, stages per pipeline under 'pp+ddp'."""
    layers: int          # the model's decoder layers
    layer: Part
    first: Part          # the embeddings
    last: Part           # the final norm, the head, the loss
    boundary: float      # one micro-batch's hidden states between two stages
    per_forward: float   # bytes every stage's forward saves once per micro-batch (the rotary tables)
    update: float        # the optimizer update's temporaries
    pipeline: tuple[int, str, int] = (2, "1f1b", 2)  # [train] grad_accum, [distributed] schedule, pp_size
    tied: bool = False   # the head shares the embeddings' weight: no pipeline runs it (ember.parallel.pp.refusal)


@dataclass(frozen=True)
class Step:
    """One optimizer step as one device computes it."""
    seconds: float     # measured, or FLOPs over the device's peak
    accum: int         # micro-batches
    micro_batch: int   # rows of each
    layers: int        # decoder layers
    act_bytes: float   # one micro-batch's hidden states (what TP all-reduces at each layer)


@dataclass(frozen=True)
class Ranks:
    """The devices a layout spreads over, and the network between them."""
    n: int
    busy: float     # > 1 when more ranks than can compute at once share the cores
    overlap: bool   # the device computes while the network moves (NCCL on its own stream)
    net: Interconnect

    def compute(self, seconds: float) -> float:
        """One device's compute split n ways (slowed when the ranks share the cores)."""
        return seconds / self.n * self.busy

    def hidden(self, compute: float) -> float:
        """Seconds of communication the backward pass hides (none when the same cores do both)."""
        return BACKWARD_SHARE * compute if self.overlap else 0.0


@dataclass(frozen=True)
class Cost:
    """A strategy's optimizer step on `Ranks`, per device."""
    compute: float   # seconds
    comm: float      # seconds of communication, all of it
    hidden: float    # seconds of it the compute hides
    memory: float    # bytes at the step's peak
    moved: float     # bytes over each rank's link
    notes: tuple[str, ...] = ()


class Strategy(Protocol):
    """One way ranks split a run; the registry (ember/parallel/registry.py) lists them."""
    name: str            # the recipe's [distributed] strategy value
    summary: str         # what it does, for the recipe's documentation (after the quoted name)
    lora_conflict: str   # why it cannot train LoRA adapters ("" when it can)
    whole_model: bool    # every rank holds the whole model (generation, a merged LoRA export)

    def mesh(self, world: int, tp_size: int, pp_size: int) -> Mesh:
        """How `world` ranks divide under it ([distributed] tp_size and pp_size where it has groups
        of them); raises EmberError, without a location, when they cannot."""
        ...

    def memory(self, fp: Footprint, n: int) -> float:
        """Bytes per device at the step's peak over n devices."""
        ...

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost | None:
        """The step over `ranks` (None where the layout does not exist at that count)."""
        ...

    def apply(self, model: Any, mesh: Mesh, device: Any) -> Any:
        """The model the loop trains on this rank (a torch.nn.Module, wrapped or split in place)."""
        ...


def decoder_layers(model: Any, strategy: str) -> list[Any]:
    """The model's decoder layers, the units a strategy shards or splits; refused when it has none."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise EmberError(f"[distributed] strategy = '{strategy}': {type(model).__name__} has no decoder layers "
                         f"(modules named *DecoderLayer); use strategy 'ddp'")
    return layers
