"""Tensor parallelism (DTensor's `parallelize_module`): each decoder layer's attention and MLP
projections split over the ranks, column-wise in (q, k, v, gate, up) and row-wise out (o, down),
so a layer costs one all-reduce of its activations in attention and one in the MLP, forward and
backward (four per layer and micro-batch); the embeddings, norms and head stay whole on every
rank, and every rank computes every micro-batch, its share of each layer. The heads, key-value
heads and MLP width must split evenly. Its checkpoint: each rank writes its slices of the split
projections; the tensors every rank holds whole are written once.

LoRA (peft's `lora.Linear`: base_layer + lora_B(lora_A(dropout(x))) * scale) splits with its
base, by DTensor's own styles on the sub-modules: column-wise, lora_B's output rows split as the
base's are (lora_A whole, its input replicated), so both local outputs are the same columns;
row-wise, lora_A's input columns split as the base's are (lora_B whole), and its partial sums
are all-reduced as the base's are (r values per token, beside the base's hidden size). The input
of a row-wise layer is then this rank's columns: its keyed dropout is told which (`split`), and
draws the whole row's mask and keeps those columns, the mask one process draws, sliced."""

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
    summary = ("splits every decoder layer's attention and MLP projections over the ranks, LoRA's "
               "adapters with them (keep it within one node)")
    lora_conflict = ""
    whole_model = False

    def mesh(self, world: int, tp_size: int, pp_size: int) -> Mesh:
        """One tensor-parallel group of every rank ([distributed] tp_size is fsdp+tp's)."""
        return Mesh(world, tp=world)

    def memory(self, fp: Footprint, n: int) -> float:
        """The layers' state split n ways, and half the activations (the split projections')."""
        f = fp.layer_share
        return fp.peak - fp.state * f * (1 - 1 / n) - fp.activations * 0.5 * (1 - 1 / n)

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost | None:
        """The layers' compute split n ways, the rest whole; four all-reduces per layer and micro-batch
        (None where the model's heads or MLP width do not split n ways: the run refuses it)."""
        n, f = ranks.n, fp.layer_share
        if any(d % n for d in fp.tp_dims):
            return None
        comm = 4 * step.layers * step.accum * collective_seconds(ranks.net.all_reduce, "all_reduce", step.act_bytes, n)
        return Cost(step.seconds * (f / n * ranks.busy + (1 - f)), comm, 0.0, self.memory(fp, n),
                    4 * step.layers * step.accum * hops_share("all_reduce", n)[1] * step.act_bytes,
                    ("the layers' activations cross the link four times per micro-batch: keep it within one node",))

    def check(self, recipe: Any, ranks: int) -> str | None:
        """Why the recipe's model cannot split over `ranks` (None: it can), known before any rank starts."""
        from ember.models import config_fields
        return unsplit(config_fields(recipe.model.path), ranks)

    def apply(self, model: Any, mesh: Mesh, device: Any) -> Any:
        """The model's layers split over every rank (a 1-D device mesh)."""
        from torch.distributed.device_mesh import init_device_mesh
        return split(model, decoder_layers(model, self.name), init_device_mesh(device.type, (mesh.tp,)))


def check_dims(config: Any, n: int) -> None:
    """Refuse a model whose heads, key-value heads or MLP width do not split n ways."""
    if why := unsplit(config, n):
        raise EmberError(why)


def unsplit(config: Any, n: int) -> str | None:
    """Why a model's heads, key-value heads or MLP width do not split n ways (None: they do)."""
    for name in SPLIT:
        value = getattr(config, name, None) or config.num_attention_heads
        if value % n:
            ways = ", ".join(str(d) for d in range(2, 9) if value % d == 0)  # none for one key-value head
            use = f"use {ways} ranks per tensor-parallel group, or strategy 'fsdp'" if ways else "use strategy 'fsdp'"
            return f"tensor parallelism over {n} ranks: the model's {name} = {value} does not split {n} ways; {use}"
    return None


def split(model: Any, layers: list[Any], device_mesh: Any) -> Any:
    """Every decoder layer's projections split over the ranks of `device_mesh` (1-D), with their
    LoRA adapters where peft wrapped them."""
    check_dims(model.config, device_mesh.size())
    for layer in layers:
        layer_plan(layer, device_mesh)
    return model


def layer_plan(layer: Any, device_mesh: Any) -> None:
    """One decoder layer's projections split (PLAN); a LoRA-wrapped one, its base and adapters."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    style = {"col": ColwiseParallel, "row": RowwiseParallel}
    plan = {}
    for key, how in PLAN.items():
        module = layer.get_submodule(key)
        if not hasattr(module, "base_layer"):  # a plain nn.Linear
            plan[key] = style[how]()
            continue
        plan[f"{key}.base_layer"] = style[how]()
        split_side = "lora_B" if how == "col" else "lora_A"  # the other side stays whole
        for adapter in getattr(module, split_side):
            plan[f"{key}.{split_side}.{adapter}"] = style[how]()
        if how == "row":  # this rank's input columns: the dropout slices the whole row's mask
            for dropout in module.lora_dropout.values():
                if hasattr(dropout, "split"):
                    dropout.split = (device_mesh.get_local_rank(), device_mesh.size())
    parallelize_module(layer, device_mesh, plan)
