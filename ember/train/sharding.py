"""A run's side of the parallelism strategies (ember/parallel): what a recipe must satisfy to
train on several ranks, the strategy's mesh and its model, and clipping gradients some of which
are split. A one-process run gets its model back unchanged."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ember.errors import EmberError
from ember.parallel.mesh import Mesh
from ember.parallel.registry import STRATEGIES, either
from ember.recipe import Recipe
from ember.world import World


def check_distributed(recipe: Recipe, ranks: int, where: str) -> None:
    """What a recipe must satisfy to train on `ranks` processes; raises with the fix."""
    t = recipe.train
    s = STRATEGIES[recipe.distributed.strategy]
    lora = recipe.method.kind == "lora"
    if lora and s.lora_conflict:
        raise EmberError(f"{where}: [distributed] strategy = '{s.name}' {s.lora_conflict}; use strategy "
                         f"{either(n for n, x in STRATEGIES.items() if not x.lora_conflict)} for LoRA")
    if (own := getattr(s, "check", None)) and (why := own(recipe, ranks)):  # a strategy's own limits
        raise EmberError(f"{where}: [distributed] strategy = '{s.name}': {why}")
    dp = mesh(recipe, ranks, where).dp  # the ranks that read different rows
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
    if recipe.optimizer.state_dtype == "int8":
        raise EmberError(f"{where}: [optimizer] state_dtype = 'int8' trains in one process only for now (a "
                         f"distributed checkpoint goes through DCP, which does not know bitsandbytes' 8-bit "
                         f"state); use state_dtype = 'fp32' with several ranks")
    if recipe.method.quantize != "none":
        raise EmberError(f"{where}: [method] quantize = '{recipe.method.quantize}' (QLoRA) trains in one process "
                         f"only for now (DDP, FSDP and tensor parallelism do not handle 4-bit weights here); "
                         f"use quantize = 'none' with several ranks, or train on one device")
    if recipe.guard.spike_action == "rollback":
        raise EmberError(f"{where}: [guard] spike_action = 'rollback' is not available in a distributed run "
                         f"yet; use 'skip' or 'warn'")
    whole = either(n for n, x in STRATEGIES.items() if x.whole_model)
    if not s.whole_model and recipe.eval.prompts:
        raise EmberError(f"{where}: [eval] prompts with [distributed] strategy = '{s.name}': generating needs the "
                         f"whole model in one process; use strategy {whole}, or leave prompts out (the held-out "
                         f"loss works under every strategy)")
    if not s.whole_model and lora and recipe.method.export_merged:
        raise EmberError(f"{where}: [method] export_merged with [distributed] strategy = '{s.name}': the merge "
                         f"needs the whole model in one process; export it afterwards from the final "
                         f"adapter, or use strategy {whole}")


def mesh(recipe: Recipe, ranks: int, where: str = "") -> Mesh:
    """How `ranks` divide under the recipe's strategy; refused, at `where`, when they cannot."""
    try:
        return STRATEGIES[recipe.distributed.strategy].mesh(ranks, recipe.distributed.tp_size, recipe.distributed.pp_size)
    except EmberError as e:
        raise EmberError(f"{where}: {e}" if where else str(e)) from None


def parallelize(model: nn.Module, recipe: Recipe, world: World, device: torch.device) -> nn.Module:
    """The model the loop trains: the recipe's strategy applied when there are several ranks."""
    if not world.distributed:
        return model
    return STRATEGIES[recipe.distributed.strategy].apply(model, mesh(recipe, world.size), device)


def tp_degree(recipe: Recipe, ranks: int) -> int:
    """Ranks that read the same rows: a tensor-parallel group's, a pipeline's stages."""
    m = mesh(recipe, ranks)
    return m.tp * m.pp


def unwrapped(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 shards in place: the same object)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def clip_gradients(params: list[nn.Parameter], max_norm: float,
                   stages: Callable[[float], float] | None = None) -> float:
    """Clip the global gradient norm to max_norm (0: only measure it); return the norm before.
    `stages`: under pipeline parallelism, sums a value over the stages, each of which holds its
    own parameters (their squares add up to the whole model's).
    Under tensor parallelism some gradients are DTensors (shards, on one mesh or, with fsdp+tp,
    on two) and some plain (replicated on every rank): each sharded tensor's norm is reduced
    over its shards, the plain ones are whole already, and they add up as squares."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if hasattr(g, "full_tensor")]
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    meshes = {id(g.device_mesh) for g in sharded}
    if stages is not None:
        return _scale(grads, stages(float(torch.nn.utils.get_total_norm(grads)) ** 2 if grads else 0.0) ** 0.5,
                      max_norm)
    if not sharded or (not plain and len(meshes) == 1):  # one process, DDP, FSDP: torch's own
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.nn.utils.get_total_norm(grads))
    squares = sum(float(torch.linalg.vector_norm(g).full_tensor()) ** 2 for g in sharded)
    squares += float(torch.nn.utils.get_total_norm(plain)) ** 2 if plain else 0.0
    return _scale(grads, squares ** 0.5, max_norm)


def _scale(grads: list[torch.Tensor], total: float, max_norm: float) -> float:
    """Scale `grads` so that their global norm `total` becomes max_norm (0: leave them); `total`."""
    scale = max_norm / (total + 1e-6)  # as torch's clip_grad_norm_, which clamps it at 1
    if max_norm > 0 and scale < 1:
        with torch.no_grad():
            for g in grads:
                g.mul_(scale)
    return total
