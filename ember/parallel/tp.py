"""Tensor parallelism (DTensor's `parallelize_module`): each decoder layer's attention and MLP
projections split over the ranks, column-wise in (q, k, v, gate, up) and row-wise out (o, down),
so a layer costs one all-reduce of its activations in attention and one in the MLP, forward and
backward (four per layer and micro-batch); the embeddings, norms and head stay whole on every
rank, and every rank computes every micro-batch, its share of each layer. The heads, key-value
heads and MLP width must split evenly. Its checkpoint: each rank writes its slices of the split
projections; the tensors every rank holds whole are written once."""

from __future__ import annotations

from typing import Any

from ember.errors import EmberError
from ember.parallel.collectives import collective_seconds, hops_share
from ember.parallel.mesh import Mesh
from ember.parallel.strategy import Cost, Footprint, Ranks, Step, decoder_layers

PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
        "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}
SPLIT = ("num_attention_heads", "num_key_value_heads", "intermediate_size")  # the model's dims it divides


class TP:
    name = "tp"
    summary = ("splits every decoder layer's attention and MLP projections over the ranks (full "
               "fine-tuning; keep it within one node)")
    lora_conflict = "splits the base model's projections, which LoRA wraps"
    whole_model = False

    def mesh(self, world: int, tp_size: int) -> Mesh:
        """One tensor-parallel group of every rank ([distributed] tp_size is fsdp+tp's)."""
        return Mesh(world, tp=world)

    def memory(self, fp: Footprint, n: int) -> float:
        """The layers' state split n ways, and half the activations (the split projections')."""
        f = fp.layer_share
        return fp.peak - fp.state * f * (1 - 1 / n) - fp.activations * 0.5 * (1 - 1 / n)

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost:
        """The layers' compute split n ways, the rest whole; four all-reduces per layer and micro-batch."""
        n, f = ranks.n, fp.layer_share
        comm = 4 * step.layers * step.accum * collective_seconds(ranks.net.all_reduce, "all_reduce", step.act_bytes, n)
        return Cost(step.seconds * (f / n * ranks.busy + (1 - f)), comm, 0.0, self.memory(fp, n),
                    4 * step.layers * step.accum * hops_share("all_reduce", n)[1] * step.act_bytes,
                    ("the layers' activations cross the link four times per micro-batch: keep it within one node",))

    def apply(self, model: Any, mesh: Mesh, device: Any) -> Any:
        """The model's layers split over every rank (a 1-D device mesh)."""
        from torch.distributed.device_mesh import init_device_mesh
        return split(model, decoder_layers(model, self.name), init_device_mesh(device.type, (mesh.tp,)))


def check_dims(config: Any, n: int) -> None:
    """Refuse a model whose heads, key-value heads or MLP width do not split n ways."""
    for name in SPLIT:
        value = getattr(config, name, None) or config.num_attention_heads
        if value % n:
            raise EmberError(f"tensor parallelism over {n} ranks: the model's {name} = {value} does not split "
                             f"{n} ways; use {', '.join(str(d) for d in range(2, 9) if value % d == 0)} ranks "
                             f"per tensor-parallel group, or strategy 'fsdp'")


def split(model: Any, layers: list[Any], device_mesh: Any) -> Any:
    """Every decoder layer's projections split over the ranks of `device_mesh` (1-D)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    check_dims(model.config, device_mesh.size())
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in PLAN.items()}
    for layer in layers:
        parallelize_module(layer, device_mesh, plan)
    return model
