"""FSDP with tensor parallelism, the 2-D mesh: tensor parallel inside groups of [distributed]
tp_size ranks (keep a group within one node), FSDP across the groups, which read different rows.
Both costs at their group sizes; `ember plan` prices pairs of ranks (n >= 4). Its checkpoint:
each rank writes its shards of its slices. LoRA: the adapters split inside a group with the
projections they wrap (ember.parallel.tp), then FSDP shards what trains, as it does alone."""

from __future__ import annotations

import logging
from typing import Any

from ember.errors import EmberError
from ember.parallel import fsdp, tp
from ember.parallel.collectives import collective_seconds, hops_share
from ember.parallel.mesh import Mesh
from ember.parallel.strategy import Cost, Footprint, Ranks, Step, decoder_layers

PLANNED_TP = 2  # the group size `ember plan` prices


class FSDPTP:
    name = "fsdp+tp"
    summary = "is the 2-D mesh: tp inside groups of tp_size ranks, fsdp across the groups"
    lora_conflict = ""  # the adapters split with their base (ember.parallel.tp), then shard as it does
    whole_model = False

    def mesh(self, world: int, tp_size: int, pp_size: int) -> Mesh:
        """Groups of tp_size ranks, at least two of them."""
        if world % tp_size or world == tp_size:
            raise EmberError(f"[distributed] strategy = '{self.name}' with tp_size = {tp_size} needs a multiple "
                             f"of {tp_size} ranks, at least {2 * tp_size}; got {world}")
        return Mesh(world, shard=world // tp_size, tp=tp_size)

    def memory(self, fp: Footprint, n: int) -> float:
        """The state sharded n ways, and a quarter of the activations less."""
        return fp.peak - fp.state * (1 - 1 / n) - fp.activations * 0.25

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost | None:
        """Pairs of ranks: tp's all-reduces inside each, fsdp's gathers and reduce-scatter across them."""
        n, f, net = ranks.n, fp.layer_share, ranks.net
        if n < 2 * PLANNED_TP or any(d % PLANNED_TP for d in fp.tp_dims):  # the pairs' split: tp.unsplit
            return None
        dp, tp_ = n // PLANNED_TP, PLANNED_TP
        comp = step.seconds * (f / tp_ + (1 - f)) / dp * ranks.busy
        mb = max(1, step.accum // dp)
        comm = (4 * step.layers * mb * collective_seconds(net.all_reduce, "all_reduce", step.act_bytes, tp_)
                + 2 * mb * collective_seconds(net.all_gather, "all_gather", fp.weights / tp_, dp)
                + collective_seconds(net.reduce_scatter, "reduce_scatter", fp.grads / tp_, dp))
        moved = (4 * step.layers * mb * step.act_bytes + 2 * mb * hops_share("all_gather", dp)[1] * fp.weights / tp_
                 + hops_share("reduce_scatter", dp)[1] * fp.grads / tp_)
        return Cost(comp, comm, 0.0, self.memory(fp, n), moved,
                    ("tensor parallel in pairs of ranks (keep a pair within a node), FSDP across the pairs",))

    def check(self, recipe: Any, ranks: int) -> str | None:
        """Why the recipe's model cannot split over groups of [distributed] tp_size (None: it can)."""
        from ember.models import config_fields
        return tp.unsplit(config_fields(recipe.model.path), recipe.distributed.tp_size)

    def apply(self, model: Any, mesh: Mesh, device: Any) -> Any:
        """The layers split inside each group, then sharded across the groups."""
        from torch.distributed.device_mesh import init_device_mesh
        layers = decoder_layers(model, self.name)
        # Gathering a 2-D-sharded tensor whole (the final weights) takes two all-gathers, and
        # DTensor warns so on every rank each time; the figures are the same either way.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        device_mesh = init_device_mesh(device.type, (mesh.shard, mesh.tp), mesh_dim_names=("dp", "tp"))
        tp.split(model, layers, device_mesh["tp"])
        return fsdp.shard(model, layers, device_mesh["dp"])
