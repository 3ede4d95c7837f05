"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks, one
unit per decoder layer plus the root (embeddings, final norm and head), as torchtitan does. Per
micro-batch an all-gather of the weights in forward and again in backward (FSDP2 reshards after
forward), one reduce-scatter of the gradients per optimizer step. Its checkpoint: each rank
writes its shards."""

from __future__ import annotations

from typing import Any

from ember.parallel.collectives import collective_seconds, hops_share
from ember.parallel.mesh import Mesh
from ember.parallel.strategy import Cost, Footprint, Ranks, Step, decoder_layers


class FSDP:
    name = "fsdp"
    summary = "(FSDP2, fully_shard) shards parameters, gradients and optimizer state"
    lora_conflict = ""
    whole_model = False

    def mesh(self, world: int, tp_size: int, pp_size: int) -> Mesh:
        """Every rank a shard of the one model."""
        return Mesh(world, shard=world)

    def memory(self, fp: Footprint, n: int) -> float:
        """Its shard of the state, and two layers gathered at once."""
        return fp.peak - fp.state * (1 - 1 / n) + 2 * fp.layer

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost:
        """Compute split n ways; the gathers of this rank's micro-batches and one reduce-scatter."""
        n, compute = ranks.n, ranks.compute(step.seconds)
        per_rank = max(1, step.accum // n)
        ag = collective_seconds(ranks.net.all_gather, "all_gather", fp.weights, n)
        rs = collective_seconds(ranks.net.reduce_scatter, "reduce_scatter", fp.grads, n)
        moved = 2 * per_rank * hops_share("all_gather", n)[1] * fp.weights + hops_share("reduce_scatter", n)[1] * fp.grads
        return Cost(compute, 2 * per_rank * ag + rs, ranks.hidden(compute), self.memory(fp, n), moved)

    def apply(self, model: Any, mesh: Mesh, device: Any) -> Any:
        """The model sharded in place over every rank."""
        return shard(model, decoder_layers(model, self.name), None)


def shard(model: Any, layers: list[Any], device_mesh: Any) -> Any:
    """fully_shard each decoder layer, then the root, over `device_mesh` (None: every rank)."""
    from torch.distributed.fsdp import fully_shard
    for layer in layers:
        fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    return model
