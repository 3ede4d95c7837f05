"""Pipeline parallelism (torch.distributed.pipelining): the decoder layers split into one stage
per rank, in order and as evenly as they go (the embeddings on the first stage, the final norm,
the head and the loss on the last); the step's grad_accum micro-batches flow through the stages
under a schedule, [distributed] schedule: 'gpipe' (every forward, then every backward) or '1f1b'
(one forward, one backward once the pipeline is full: at most `stages` micro-batches' activations
held at once). Each stage sends its micro-batch's hidden states to the next and their gradient
back; every stage reads the same rows (the first stage needs the ids, the last the labels).
Several pipelines side by side, each reading its share of the rows: ember/parallel/pp_ddp.py.

Its cost: the bubble, (p-1)/(m+p-1) of the step with m micro-batches over p stages, when a stage
waits, and one send of the activations per stage boundary and micro-batch, each way. Its memory
per device: its fullest stage's (`stage_memory`), from the layers `layer_range` gives each stage
(the split the run makes), its end of the model and the schedule's micro-batches in flight; the
plan prices the pieces (ember.plan.layout.stage_parts; bench/pipeline_memory.py measures them). Its
checkpoint: each stage writes its own parameters and optimizer state under their names in the
whole model, so a checkpoint loads back into the same stages (ember/ckpt/sharded.py).

LoRA composes: peft's adapters sit in the layers a stage keeps, and each micro-batch's dropout
keys are set as the schedule starts its forward. What it does not do yet, refused where a recipe
asks: stages x FSDP/TP (stages x DDP replicas is 'pp+ddp'), the held-out evaluation (its
forward needs every stage), LoRA dropout under activation checkpointing, fp16's loss scaling,
and models whose head shares the embeddings' weight (they would sit on two stages). The torch side is
ember/parallel/stages.py, imported when a run applies it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ember.parallel.mesh import Mesh
from ember.parallel.placement import layer_range, rank_name
from ember.parallel.strategy import Cost, Footprint, Ranks, StageParts, Step

SCHEDULES = ("gpipe", "1f1b")  # [distributed] schedule; torch's ScheduleGPipe and Schedule1F1B
STAGE_NOTE = "memory per stage"  # how the note naming the fullest stage begins (`ember plan` prints it)


class PP:
    name = "pp"
    summary = ("(pipeline parallelism) splits the decoder layers into one stage per rank and runs the "
               "step's grad_accum micro-batches through them under [distributed] schedule")
    lora_conflict = ""
    whole_model = False

    def mesh(self, world: int, tp_size: int, pp_size: int) -> Mesh:
        """Every rank a stage of one pipeline ([distributed] pp_size is 'pp+ddp''s)."""
        return Mesh(world, pp=world)

    def memory(self, fp: Footprint, n: int) -> float:
        """The fullest of its n stages."""
        return max(self.peaks(fp, n))

    def peaks(self, fp: Footprint, n: int) -> list[float]:
        """Each of its n stages' peak (`stage_memory`), over the step's grad_accum micro-batches."""
        parts = parts_of(fp)
        accum, schedule, _ = parts.pipeline
        return stage_memory(parts, n, accum, schedule)

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost | None:
        """Compute split n ways and stretched by the bubble; one send of the activations per
        boundary and micro-batch, forward and backward, none of it hidden."""
        p, m = ranks.n, step.accum
        if p > step.layers or refused(parts_of(fp), p, m):  # refused at launch (a stage would hold no layer)
            return None
        share = bubble(p, m)
        link = ranks.net.all_reduce  # point-to-point priced as one hop of the fitted link
        sends = 2 * (p - 1) * m * (link.latency + step.act_bytes / link.bandwidth)
        notes = [f"bubble {share:.0%} with {m} micro-batches over {p} stages (raise [train] grad_accum to shrink it)"]
        if m < p:
            notes.append(f"grad_accum = {m} < {p} stages: some stages never overlap")
        peaks = self.peaks(fp, p)
        notes.append(fullest(peaks))
        return Cost(ranks.compute(step.seconds) / (1 - share), sends, 0.0, max(peaks),
                    2 * m * step.act_bytes, tuple(notes))

    def apply(self, model: Any, mesh: Mesh, device: Any) -> Any:
        """This rank's stage of the model (the other stages' modules removed), carrying the
        pipeline that runs it (`pipeline_of`)."""
        from ember.parallel.stages import split_into_stage
        return split_into_stage(model, mesh, device)

    def check(self, recipe: Any, ranks: int) -> str | None:
        """What a recipe asks that a pipeline run cannot do yet (None: nothing)."""
        return refusal(recipe, (ranks, 1), f"{ranks} stages (one per rank)", "use at most {layers} ranks")


def refusal(recipe: Any, layout: tuple[int, int], what: str, fewer: str) -> str | None:
    """Why pipelines of `layout` = (stages, replicas) cannot run `recipe` (None: they can); `what`
    names the stages, `fewer` says what to do when the model has fewer decoder layers ({layers})."""
    from ember.models import config_fields
    (stages, replicas), fields = layout, config_fields(recipe.model.path)
    layers = getattr(fields, "num_hidden_layers", None)
    if layers is not None and stages > layers:
        return (f"{what} for the model's {layers} decoder layers: a stage would hold none; "
                + fewer.format(layers=layers))
    accum = recipe.train.grad_accum
    if recipe.distributed.schedule == "1f1b" and micro_batches(accum, replicas) < stages:
        over = f" over {replicas} replicas" if replicas > 1 else ""
        return (f"schedule '1f1b' runs at least one micro-batch per stage, and grad_accum = {accum}{over} "
                f"gives each pipeline {micro_batches(accum, replicas)} for {stages} stages; set [train] "
                f"grad_accum = {stages * replicas} or [distributed] schedule = 'gpipe'")
    if getattr(fields, "tie_word_embeddings", False):
        return ("the model's head shares the embeddings' weight (tie_word_embeddings), which would "
                "sit on the first and the last stage at once; use strategy 'fsdp'")
    if recipe.eval.holdout or recipe.eval.files:
        return ("the held-out evaluation runs the whole model's forward in one process, which no "
                "stage holds; set [eval] holdout = 0 and files = [] (evaluate afterwards on the "
                "final weights), or use strategy 'ddp'")
    if recipe.method.kind == "lora" and recipe.method.dropout and recipe.train.activation_checkpointing:
        return ("LoRA's dropout with [train] activation_checkpointing: 1F1B runs a micro-batch's "
                "backward (where checkpointing recomputes its dropout) after later forwards, which "
                "moved the dropout's keys on; set [method] dropout = 0 or activation_checkpointing = false")
    if recipe.precision.mode == "fp16":
        return ("[precision] mode = 'fp16' scales the loss before backward (GradScaler), and the "
                "schedule runs backward itself on the unscaled loss; use 'bf16' or 'fp32'")
    if recipe.train.compile is True:
        return ("[train] compile = true compiles the whole model's loss, not a stage's; set it to "
                "'auto' or false (the stages run eagerly)")
    return None


def refused(parts: StageParts, stages: int, micro_batches: int) -> bool:
    """Whether the run refuses pipelines of `stages` stages over `micro_batches` each for what the
    plan knows of the model and the schedule (`refusal` says why): a head tied to the embeddings,
    or 1F1B with fewer micro-batches than stages."""
    return parts.tied or (parts.pipeline[1] == "1f1b" and micro_batches < stages)


def micro_batches(grad_accum: int, replicas: int) -> int:
    """The micro-batches each of `replicas` pipelines runs a step: its share of grad_accum, or all of
    them cut into slices of rows when grad_accum is not a multiple (ember.data.loader.row_parts)."""
    return grad_accum * (replicas // math.gcd(grad_accum, replicas)) // replicas


def bubble(stages: int, micro_batches: int) -> float:
    """The share of a step a stage waits under GPipe or 1F1B, every stage's forward and backward
    of a micro-batch taking the same time: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def parts_of(fp: Footprint) -> StageParts:
    """The stage parts of `fp`; the plan fills them (ember.plan.layout.footprint)."""
    if fp.stages is None:
        raise ValueError("a pipeline's memory needs the footprint's stage parts (ember.plan.layout.footprint)")
    return fp.stages


def in_flight(stages: int, stage: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations `stage` holds at once: GPipe runs every forward before any
    backward; 1F1B runs min(m, stages - stage) forwards before its first backward (torch's
    Schedule1F1B warm-up), then one forward after each backward."""
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - stage)


def stage_memory(sp: StageParts, stages: int, micro_batches: int, schedule: str) -> list[float]:
    """Each stage's bytes at its peak, from the layers `layer_range` gives it (the split the run
    makes): the larger of (a) its state, the schedule's in-flight micro-batches' activations and
    the stage's own output kept for each (torch's fwd_cache), the receive buffers torch keeps per
    micro-batch (hidden states in, their gradients back), the loss's buffers on the last stage,
    and its gradients only when a forward follows a backward (1F1B with more micro-batches than in
    flight); and (b) the optimizer step: its state, the buffers, the update's temporaries."""
    out = []
    for s in range(stages):
        first, last = s == 0, s == stages - 1
        held = [sp.layer] * len(layer_range(sp.layers, stages, s)) + [sp.first] * first + [sp.last] * last
        state, grads = sum(x.state for x in held), sum(x.grads for x in held)
        k = in_flight(stages, s, micro_batches, schedule)
        per_micro = sum(x.acts for x in held) + sp.per_forward + (0 if last else sp.boundary)
        buffers = micro_batches * sp.boundary * ((not first) + (not last))
        with_grads = schedule == "1f1b" and micro_batches > k
        flight = state - (0 if with_grads else grads) + buffers + sum(x.copies for x in held) + k * per_micro \
            + sum(x.transient for x in held)
        out.append(max(flight, state + buffers + sp.update))
    return out


def fullest(peaks: list[float]) -> str:
    """Which stage peaks highest, as the plan's note says it."""
    s = max(range(len(peaks)), key=peaks.__getitem__)
    each = ", ".join(f"{p / 2**20:.1f}" for p in peaks)
    return f"{STAGE_NOTE} {each} MiB: stage {s} of {len(peaks)} is the fullest"


def stages_of(recipe: Any, ranks: int) -> int:
    """The stages of each pipeline of a run of `recipe` over `ranks` ranks (1: it runs none)."""
    return {PP.name: ranks, "pp+ddp": recipe.distributed.pp_size}.get(recipe.distributed.strategy, 1)


def rank_names(recipe: Any, ranks: int) -> Callable[[int], str]:
    """How the launcher names the ranks of a run of `recipe` over `ranks` ranks (ember.ranks): by
    their stage (and replica) under a pipeline (from the model's config: the launcher holds no model)."""
    stages = stages_of(recipe, ranks)
    if stages == 1 or ranks % stages:  # no pipeline, or a layout the run refuses with the reason
        return rank_name
    from ember.models import config_fields
    layers = getattr(config_fields(recipe.model.path), "num_hidden_layers", None) or 0
    return lambda rank: rank_name(rank, stages, layers, ranks // stages)


def pipeline_of(model: Any) -> Any:
    """The pipeline a pipeline-parallel stage carries (ember.parallel.stages.Pipeline); None for
    any other model."""
    return getattr(model, "ember_pipeline", None)


def names_of(model: Any) -> Callable[[int], str]:
    """How a rank's messages name the ranks (ember.train.watchdog): by their stage when `model` is a
    pipeline's stage."""
    pipe = pipeline_of(model)
    return pipe.name if pipe is not None else rank_name
