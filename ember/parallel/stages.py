"""The torch side of pipeline parallelism (ember/parallel/pp.py): this rank's stage of a causal
LM and the pipeline that trains it.

A stage is the model itself with the other stages' modules removed: its decoder layers become a
ModuleDict keyed by their index in the whole model, so every parameter keeps its name
("model.layers.3.mlp.up_proj.weight") and a stage's state dict, optimizer state and checkpoint
are the whole model's, restricted to the stage. Its forward (`StageForward`) is the decoder's
own, cut where the stage ends: the first stage embeds the ids, every stage builds the causal
mask and the rotary embeddings from the micro-batch's positions (the stages of a pipeline read
the same rows) and runs its layers, the last applies the final norm and the head, and the
schedule applies the model's own loss (transformers' ForCausalLMLoss) to the logits. The ranks
form a (dp, pp) device mesh (`Groups`; dp is 1 under 'pp'): a stage talks to its pipeline over
the pp sub-group and, under 'pp+ddp', averages its gradients with the other replicas of the
stage over the dp sub-group.

Each step also says where the stage's time went (`Pipeline.seconds`): computing (its forwards
with the loss, its backwards: `BusyClock`, wrapped around the stage's own calls) and the rest of
the schedule until every stage is done, the bubble: waiting on the other stages, their sends
and receives included. The schedule predicts (stages - 1) / (micro-batches + stages - 1) of it
(ember.parallel.pp.bubble); `ember report` shows both (ember.metrics.rank_times).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ember import faults
from ember.errors import EmberError
from ember.parallel.mesh import Mesh
from ember.parallel.placement import layer_range, rank_name


def split_into_stage(model: nn.Module, mesh: Mesh, device: torch.device) -> nn.Module:
    """Keep this rank's stage of `model` (in place) and attach its Pipeline as `ember_pipeline`:
    stage rank % mesh.pp of replica rank // mesh.pp. Under LoRA `model` is peft's wrapper: the
    stage is cut in the causal LM under it, whose layers carry the adapters, and the parameters
    keep the wrapper's names."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(lm, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(lm, "lm_head"):
        raise EmberError(f"[distributed] strategy = 'pp': {type(model).__name__} is not a decoder laid out as "
                         f"model.embed_tokens / model.layers / model.norm / lm_head (Llama, Qwen, Mistral, "
                         f"SmolLM); use strategy 'fsdp'")
    if lm.lm_head.weight is inner.embed_tokens.weight:
        raise EmberError("[distributed] strategy = 'pp': the model's head shares the embeddings' weight "
                         "(tie_word_embeddings), which would sit on the first and the last stage at once; "
                         "use strategy 'fsdp'")
    n, stages = len(inner.layers), mesh.pp
    if stages > n:  # ember.parallel.pp refuses it before launch, from the model's config
        raise EmberError(f"[distributed] a pipeline of {stages} stages: the model has {n} decoder layers, "
                         f"fewer than the stages; use at most {n} stages")
    groups = Groups.of(mesh, device)
    stage = groups.stage
    mine = layer_range(n, stages, stage)
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in mine})
    first, last = stage == 0, stage == stages - 1
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm, lm.lm_head = None, None
    model.ember_pipeline = Pipeline(model, lm, (stage, stages, n), device, groups)
    return model


@dataclass(frozen=True)
class Groups:
    """This rank's place on the (dp, pp) device mesh and its two sub-groups: the stages of its
    pipeline (sends, receives, the loss) and the replicas of its stage (the gradients' average)."""
    stage: int
    replica: int
    replicas: int
    pp: Any   # torch.distributed.ProcessGroup
    dp: Any

    @staticmethod
    def of(mesh: Mesh, device: torch.device) -> Groups:
        """The groups of `mesh` (dp = its replicas, pp = its stages), made on every rank (a collective)."""
        from torch.distributed.device_mesh import init_device_mesh
        grid = init_device_mesh(device.type, (mesh.dp, mesh.pp), mesh_dim_names=("dp", "pp"))
        return Groups(grid.get_local_rank("pp"), grid.get_local_rank("dp"), mesh.dp,
                      grid["pp"].get_group(), grid["dp"].get_group())


class StageForward(nn.Module):
    """One stage's forward over the stage model's modules (held, not owned: `lm` is registered
    outside the module tree so the stage model stays the one that names the parameters)."""

    def __init__(self, lm: nn.Module, first: bool, last: bool):
        super().__init__()
        self.__dict__["lm"] = lm  # not a submodule: see the class docstring
        self.first, self.last = first, last
        self.at: Any = lambda first: None  # told each micro-batch's first row before its forward (LoRA's dropout)
        for i, p in enumerate(lm.parameters()):  # PipelineStage reads its module's parameters
            self.register_parameter(f"p{i}", p)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`rows`: each row's position in the data stream (the schedule splits it with the rows)."""
        from transformers.masking_utils import create_causal_mask
        self.at(int(rows[0]))
        faults.point("pipeline.stage_forward")  # a stage dying or stalling inside the schedule (tests)
        inner = self.lm.model
        h = inner.embed_tokens(x) if self.first else x
        mask = create_causal_mask(config=inner.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        rope = inner.rotary_emb(h, position_ids=position_ids)
        for layer in inner.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=position_ids, use_cache=False)
        return self.lm.lm_head(inner.norm(h)) if self.last else h


class BusyClock:
    """Seconds a stage computes inside the schedule's step, by kind (forward with the loss, backward):
    host time on CPU, device events on an accelerator (resolved at the step's end, after its sync)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.take()

    def timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, its time counted as `kind`."""
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn(*args, **kwargs)
                b.record()
                self.pending.append((kind, a, b))
                return out
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - t
        return run

    def take(self) -> dict[str, float]:
        """The seconds counted since the last take, and a fresh count."""
        out = getattr(self, "seconds", {})
        for kind, a, b in getattr(self, "pending", []):
            b.synchronize()
            out[kind] += a.elapsed_time(b) / 1000
        self.seconds, self.pending = {"forward": 0.0, "backward": 0.0}, []
        return out


class Pipeline:
    """This rank's stage under a schedule of torch.distributed.pipelining, built at the first step
    (it needs the step's micro-batch count and the recipe's schedule)."""

    def __init__(self, root: nn.Module, lm: nn.Module, place: tuple[int, int, int], device: torch.device,
                 groups: Groups):
        """`place`: this stage's index, the stages, and the whole model's decoder layers."""
        self.root, self.lm, self.device, self.groups = root, lm, device, groups
        self.stage, self.stages, self.layers = place
        self.forward = StageForward(lm, self.stage == 0, self.last)
        self.schedule: Any = None
        self.shape: tuple[int, int] | None = None
        self.normalizer = 1.0
        self.clock = BusyClock(device)
        self.seconds: dict[str, float] = {}  # the last step's: forward, backward, bubble (the module docstring)

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def name(self, rank: int) -> str:
        """How messages name `rank`: its stage and layers (ember.parallel.placement.rank_name)."""
        return rank_name(rank, self.stages, self.layers, self.groups.replicas)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the model's own loss, as the one-process step computes it (sum over learned tokens / the step's count)
        return self.lm.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1],
                                     num_items_in_batch=self.normalizer)

    def _build(self, kind: str, micro_batches: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        stage = PipelineStage(self.forward, self.stage, self.stages, self.device, group=self.groups.pp)
        # the schedule calls these for the stage's compute; between them it sends, receives and waits
        stage.forward_one_chunk = self.clock.timed("forward", stage.forward_one_chunk)
        stage.backward_one_chunk = self.clock.timed("backward", stage.backward_one_chunk)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
        # scale_grads=False: each micro-batch's loss is already its share of the step's mean
        self.schedule = cls(stage, micro_batches, loss_fn=self.clock.timed("forward", self._loss), scale_grads=False)

    def step(self, batches: list[Any], normalizer: float, kind: str, at: Any = lambda first: None) -> float:
        """Forward and backward of the step's micro-batches (ember.data.loader.MicroBatch, on the
        device) through every stage; the step's loss (the sum of the micro-batches' losses), the
        same on every stage (one all-reduce from the last: a sync point). `at(first)` is called
        before each micro-batch's forward with its first row's stream position (LoRA's dropout
        keys, which activation checkpointing's recomputation in backward would also need: refused)."""
        if self.schedule is None:
            self._build(kind, len(batches))
        shape = tuple(batches[0].ids.shape)
        if self.shape is None:
            self.shape = shape
        if any(tuple(b.ids.shape) != self.shape for b in batches):
            raise EmberError(f"[distributed] strategy = 'pp': a micro-batch of shape "
                             f"{[tuple(b.ids.shape) for b in batches]} after {self.shape}: the stages exchange "
                             f"tensors of one fixed shape; set [data] packing = 'documents' or 'mixed' "
                             f"(rows of seq_len tokens) rather than 'padded'")
        self.normalizer = normalizer
        self.forward.at = at
        ids = torch.cat([b.ids for b in batches])
        positions = torch.cat([b.positions if b.positions is not None else
                               torch.arange(b.ids.shape[1], device=b.ids.device).expand_as(b.ids)
                               for b in batches])
        labels = torch.cat([b.labels if b.labels is not None else b.ids for b in batches])
        rows = torch.cat([torch.arange(b.ids.shape[0]) + b.first for b in batches])
        losses: list[torch.Tensor] = []
        args = (ids,) if self.stage == 0 else ()
        start = time.perf_counter()  # the stages start together: the loop's token count is an all-reduce
        self.schedule.step(*args, target=labels if self.last else None, losses=losses if self.last else None,
                           return_outputs=False, position_ids=positions, rows=rows)
        total = torch.tensor([sum(float(x) for x in losses) if self.last else 0.0], dtype=torch.float64)
        # the last stage's loss, to every stage of this pipeline; a stage done early waits here (the bubble)
        dist.all_reduce(total, group=self.groups.pp)
        loss, wall = float(total), time.perf_counter() - start
        busy = self.clock.take()
        self.seconds = {**busy, "bubble": max(0.0, wall - sum(busy.values()))}
        return loss

    def sum_over_stages(self, value: float) -> float:
        """`value` summed over the stages of this pipeline (a gradient norm's squares: each stage holds
        its own parameters; after `average_over_replicas` every replica sums the same)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.groups.pp)
        return float(t)

    def average_over_replicas(self) -> None:
        """Each gradient of this stage averaged over the stage's replicas (ember/parallel/pp_ddp.py):
        summed in buckets of flattened gradients, then divided by the replicas. A sync point."""
        if self.groups.replicas == 1:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        grads = [p.grad for p in self.root.parameters() if p.grad is not None]
        for bucket in _buckets(grads):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.groups.dp)  # every replica receives the same sum
            flat.div_(self.groups.replicas)
            for g, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(averaged)

    def gathered_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (each stage's, gathered; None elsewhere). Under LoRA
        the adapter's alone, as peft saves them: peft picks a model's adapter weights by visiting
        its LoRA layers, which only the stage that holds them can do."""
        if hasattr(self.root, "peft_config"):
            from peft import get_peft_model_state_dict
            sd = get_peft_model_state_dict(self.root)
        else:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            sd = get_model_state_dict(self.root)
        # one replica's stages hold the whole model: the others send nothing
        mine = {k: v.detach().cpu() for k, v in sd.items()} if self.groups.replica == 0 else {}
        out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, out, dst=0)
        return {k: v for part in out for k, v in part.items()} if out is not None else None


def _buckets(grads: list[torch.Tensor], limit: int = 25 << 20) -> list[list[torch.Tensor]]:
    """`grads` in order, cut into runs of one dtype of at most `limit` bytes each (one tensor alone
    when larger): one all-reduce per bucket, without copying every gradient at once."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or g.dtype != out[-1][0].dtype or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out
