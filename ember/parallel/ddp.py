"""DDP: every rank holds the whole model and computes its share of the step's micro-batches (or
of their rows); backward all-reduces the gradients, once per optimizer step (accumulation syncs
only the last micro-batch). Its checkpoint: the replicated tensors, written once."""

from __future__ import annotations

from typing import Any

from ember.parallel.collectives import collective_seconds, hops_share
from ember.parallel.mesh import Mesh
from ember.parallel.strategy import Cost, Footprint, Ranks, Step


class DDP:
    name = "ddp"
    summary = "replicates the model and averages gradients"
    lora_conflict = ""
    whole_model = True

    def mesh(self, world: int, tp_size: int, pp_size: int) -> Mesh:
        """Every rank a replica."""
        return Mesh(world, replicate=world)

    def memory(self, fp: Footprint, n: int) -> float:
        """A replica holds what one process holds."""
        return fp.peak

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost:
        """Compute split n ways; one all-reduce of the gradients, hidden behind backward where it can be."""
        n, compute = ranks.n, ranks.compute(step.seconds)
        notes = () if step.micro_batch * step.accum % n == 0 else (
            f"micro_batch x grad_accum = {step.micro_batch * step.accum} rows do not share out over {n} ranks",)
        return Cost(compute, collective_seconds(ranks.net.all_reduce, "all_reduce", fp.grads, n),
                    ranks.hidden(compute), self.memory(fp, n), hops_share("all_reduce", n)[1] * fp.grads, notes)

    def apply(self, model: Any, mesh: Mesh, device: Any) -> Any:
        """The model under DistributedDataParallel (the default process group: every rank)."""
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
