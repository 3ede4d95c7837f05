"""How ranks split a model: DDP replicates it and averages gradients; FSDP2 (`fully_shard`) shards
parameters, gradients and optimizer state, one unit per decoder layer plus the root (embeddings,
final norm and head), as torchtitan does; tensor parallelism (DTensor's `parallelize_module`)
splits each decoder layer's attention and MLP projections, column-wise in (q, k, v, gate, up)
and row-wise out (o, down), so each layer costs one all-reduce of its activations in attention
and one in the MLP, forward and backward; the embeddings, norms and head stay whole on every
rank. A one-process run gets its model back unchanged."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from ember.errors import EmberError
from ember.recipe import Recipe, Strategy
from ember.world import World


def check_distributed(recipe: Recipe, ranks: int, where: str) -> None:
    """What a recipe must satisfy to train on `ranks` processes; raises with the fix."""
    t = recipe.train
    s = recipe.distributed.strategy
    if s in (Strategy.TP, Strategy.FSDP_TP) and recipe.method.kind == "lora":
        raise EmberError(f"{where}: [distributed] strategy = '{s}' splits the base model's projections, "
                         f"which LoRA wraps; use strategy 'ddp' or 'fsdp' for LoRA")
    if s == Strategy.FSDP_TP and (ranks % recipe.distributed.tp_size or ranks == recipe.distributed.tp_size):
        raise EmberError(f"{where}: [distributed] strategy = 'fsdp+tp' with tp_size = {recipe.distributed.tp_size} "
                         f"needs a multiple of {recipe.distributed.tp_size} ranks, at least "
                         f"{2 * recipe.distributed.tp_size}; got {ranks}")
    dp = ranks // tp_degree(recipe, ranks)  # the ranks that read different rows
    rows = t.micro_batch * t.grad_accum
    if rows % dp:  # each rank takes whole micro-batches, or equal slices of each (data.row_parts)
        step = dp // math.gcd(t.micro_batch, dp)
        raise EmberError(f"{where}: [train] micro_batch x grad_accum = {t.micro_batch} x {t.grad_accum} = {rows} rows "
                         f"is the batch of one optimizer step over all data-parallel ranks, shared out evenly, so "
                         f"with {dp} of them it must be a multiple of {dp}; set [train] grad_accum = "
                         f"{step * -(-t.grad_accum // step)}")
    if t.loss_chunk:
        raise EmberError(f"{where}: [train] loss_chunk = {t.loss_chunk} calls the model's parts around "
                         f"the DDP/FSDP wrapper, which then misses its gradient hooks; set it to 0 for a "
                         f"distributed run")
    if recipe.guard.spike_action == "rollback":
        raise EmberError(f"{where}: [guard] spike_action = 'rollback' is not available in a distributed run "
                         f"yet; use 'skip' or 'warn'")
    if s != Strategy.DDP and recipe.eval.prompts:
        raise EmberError(f"{where}: [eval] prompts with [distributed] strategy = '{s}': generating needs the "
                         f"whole model in one process; use strategy 'ddp', or leave prompts out (the held-out "
                         f"loss works under every strategy)")
    if s == Strategy.FSDP and recipe.method.kind == "lora" and recipe.method.export_merged:
        raise EmberError(f"{where}: [method] export_merged with [distributed] strategy = 'fsdp': the merge "
                         f"needs the whole model in one process; export it afterwards from the final "
                         f"adapter, or use strategy 'ddp'")


def parallelize(model: nn.Module, recipe: Recipe, world: World, device: torch.device) -> nn.Module:
    """The model the loop trains: wrapped for the recipe's strategy when there are several ranks."""
    if not world.distributed:
        return model
    if recipe.distributed.strategy == Strategy.DDP:
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    strategy = recipe.distributed.strategy
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise EmberError(f"[distributed] strategy = '{strategy}': {type(model).__name__} has no decoder layers "
                         f"(modules named *DecoderLayer); use strategy 'ddp'")
    if strategy == Strategy.TP:
        return tensor_parallel(model, layers, init_device_mesh(device.type, (world.size,)))
    if strategy == Strategy.FSDP:
        mesh = None  # the default group: every rank
    else:  # fsdp+tp: tensor parallel inside groups of tp ranks, FSDP across the groups
        # Gathering a 2-D-sharded tensor whole (the final weights) takes two all-gathers, and
        # DTensor warns so on every rank each time; the figures are the same either way.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        tp = world.size // world.dp_size
        mesh2 = init_device_mesh(device.type, (world.dp_size, tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, layers, mesh2["tp"])
        mesh = mesh2["dp"]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tp_degree(recipe: Recipe, ranks: int) -> int:
    """Ranks per tensor-parallel group: all of them for 'tp', [distributed] tp_size for 'fsdp+tp'."""
    s = recipe.distributed.strategy
    return ranks if s == Strategy.TP else recipe.distributed.tp_size if s == Strategy.FSDP_TP else 1


def unwrapped(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 shards in place: the same object)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


TP_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
           "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}


def tensor_parallel(model: nn.Module, layers: list[nn.Module], mesh: Any) -> nn.Module:
    """Every decoder layer's projections split over the ranks of `mesh` (a 1-D device mesh)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    cfg, n = model.config, mesh.size()
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, name, None) or cfg.num_attention_heads
        if value % n:
            raise EmberError(f"tensor parallelism over {n} ranks: the model's {name} = {value} does not split "
                             f"{n} ways; use {', '.join(str(d) for d in range(2, 9) if value % d == 0)} ranks "
                             f"per tensor-parallel group, or strategy 'fsdp'")
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()}
    for layer in layers:
        parallelize_module(layer, mesh, plan)
    return model


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm to max_norm (0: only measure it); return the norm before.
    Under tensor parallelism some gradients are DTensors (shards, on one mesh or, with fsdp+tp,
    on two) and some plain (replicated on every rank): each sharded tensor's norm is reduced
    over its shards, the plain ones are whole already, and they add up as squares."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if hasattr(g, "full_tensor")]
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    meshes = {id(g.device_mesh) for g in sharded}
    if not sharded or (not plain and len(meshes) == 1):  # one process, DDP, FSDP: torch's own
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.nn.utils.get_total_norm(grads))
    squares = sum(float(torch.linalg.vector_norm(g).full_tensor()) ** 2 for g in sharded)
    squares += float(torch.nn.utils.get_total_norm(plain)) ** 2 if plain else 0.0
    total = squares ** 0.5
    scale = max_norm / (total + 1e-6)  # as torch's clip_grad_norm_, which clamps it at 1
    if max_norm > 0 and scale < 1:
        with torch.no_grad():
            for g in grads:
                g.mul_(scale)
    return total
