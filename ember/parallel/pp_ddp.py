"""Pipeline parallelism x DDP, the 2-D mesh (dp, pp): the ranks divide into ranks / pp_size
replicas of one pipeline of [distributed] pp_size stages (ember/parallel/pp.py); replica r is
ranks r x pp_size ... (r + 1) x pp_size - 1 (ember/parallel/mesh.py).

The batch: each replica reads its own share of the rows, as DDP's ranks do. The step's
grad_accum micro-batches are dealt out over the replicas, grad_accum / replicas to each (or,
when grad_accum is not a multiple of the replicas, an equal slice of every micro-batch's rows:
ember.data.loader.row_parts), and each pipeline runs its share under [distributed] schedule; so
micro_batch x grad_accum stays the step's batch, as in a one-process or a 1-D 'pp' run of the
same recipe, and the bubble is (stages - 1) / (micro-batches per replica + stages - 1).

The gradients: after the schedule, each stage's are averaged over the stage's replicas by one
explicit all-reduce over the dp sub-group (summed, then divided by the replicas:
ember.parallel.stages.Pipeline.average_over_replicas), not by a DDP wrapper on the stage: the
schedule runs the stage's backward itself, one micro-batch at a time, where DDP's reducer would
have to be told which backward is the last; the explicit reduce sums in one order that every
replica receives alike, so the replicas stay bit-identical and a resume exact. It runs after the
backward, not overlapped with it (priced so). The loss is the replicas' mean, as DDP's.

Its checkpoint: each stage's parameters and optimizer state under the whole model's names, as
'pp' writes them; a stage's replicas hold the same tensors under the same names, and DCP's save
planner writes each once (dedup_save_plans). It loads by name into any layout, DCP resharding
(tested: 2 stages x 2 replicas -> 2 stages of one pipeline). LoRA composes as under 'pp'.
`ember plan` prices pipelines of the recipe's pp_size stages over n >= 2 x pp_size ranks, each
stage's memory from the layers it holds (ember.parallel.pp.stage_memory)."""

from __future__ import annotations

from typing import Any

from ember.errors import EmberError
from ember.parallel.collectives import collective_seconds, hops_share
from ember.parallel.mesh import Mesh
from ember.parallel.pp import bubble, fullest, micro_batches, parts_of, refusal, refused, stage_memory
from ember.parallel.strategy import Cost, Footprint, Ranks, Step


class PPDDP:
    name = "pp+ddp"
    summary = ("is the 2-D mesh: pipelines of pp_size stages ('pp'), ranks / pp_size replicas of them "
               "reading different rows, each stage's gradients averaged over its replicas")
    lora_conflict = ""
    whole_model = False

    def mesh(self, world: int, tp_size: int, pp_size: int) -> Mesh:
        """Pipelines of pp_size stages, at least two of them."""
        if world % pp_size or world == pp_size:
            raise EmberError(f"[distributed] strategy = '{self.name}' with pp_size = {pp_size} needs a multiple "
                             f"of {pp_size} ranks, at least {2 * pp_size}; got {world}")
        return Mesh(world, replicate=world // pp_size, pp=pp_size)

    def memory(self, fp: Footprint, n: int) -> float:
        """The fullest stage of one replica's pipeline."""
        return max(self.peaks(fp, n))

    def peaks(self, fp: Footprint, n: int) -> list[float]:
        """Each stage's peak in one replica's pipeline of pp_size stages over its share of the
        micro-batches, n ranks in all (ember.parallel.pp.stage_memory)."""
        parts = parts_of(fp)
        accum, schedule, stages = parts.pipeline
        return stage_memory(parts, stages, micro_batches(accum, max(1, n // stages)), schedule)

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost | None:
        """Each replica's pipeline over its share of the micro-batches, stretched by the bubble; the
        sends between stages; one all-reduce of a stage's gradients over the replicas, not hidden."""
        p, n, link = parts_of(fp).pipeline[2], ranks.n, ranks.net.all_reduce
        if n < 2 * p or n % p or p > step.layers:
            return None
        dp = n // p
        m = micro_batches(step.accum, dp)  # one pipeline's, each of act bytes
        if refused(parts_of(fp), p, m):
            return None
        act = step.act_bytes * step.accum / (m * dp)
        share = bubble(p, m)
        sends = 2 * (p - 1) * m * (link.latency + act / link.bandwidth)
        reduce = collective_seconds(link, "all_reduce", fp.grads / p, dp)
        notes = [f"pipelines of {p} stages ([distributed] pp_size), {dp} replicas of each averaging a "
                 f"stage's gradients", f"bubble {share:.0%} with {m} micro-batches per pipeline over {p} "
                 f"stages (raise [train] grad_accum to shrink it)"]
        if m < p:
            notes.append(f"{m} micro-batches per pipeline < {p} stages: some stages never overlap")
        peaks = self.peaks(fp, n)
        notes.append(fullest(peaks))
        return Cost(ranks.compute(step.seconds) / (1 - share), sends + reduce, 0.0, max(peaks),
                    2 * m * act + hops_share("all_reduce", dp)[1] * fp.grads / p, tuple(notes))

    def apply(self, model: Any, mesh: Mesh, device: Any) -> Any:
        """This rank's stage of its replica's pipeline (ember.parallel.stages)."""
        from ember.parallel.stages import split_into_stage
        return split_into_stage(model, mesh, device)

    def check(self, recipe: Any, ranks: int) -> str | None:
        """What a recipe asks that its pipelines cannot do (None: nothing)."""
        stages = recipe.distributed.pp_size
        if ranks % stages or ranks == stages:  # no layout: `mesh` refuses it, with the ranks it needs
            return None
        return refusal(recipe, (stages, ranks // stages), f"pp_size = {stages} stages",
                       "set [distributed] pp_size to at most {layers}")
