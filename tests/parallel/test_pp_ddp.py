"""Pipeline parallelism x DDP: pipelines of pp_size stages, replicas of them reading different rows;
its cost is the bubble over a replica's share of the micro-batches, the sends, and the all-reduce
of a stage's gradients over its replicas (the runs themselves: tests/e2e/test_pipeline_ddp.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ember.errors import EmberError
from ember.parallel.mesh import Mesh
from ember.parallel.pp import micro_batches, rank_names, stage_memory
from ember.parallel.pp_ddp import PPDDP
from ember.plan.advisor import advise
from ember.plan.memory import ModelShape, TrainShape, estimate
from ember.recipe import load_recipe
from ember.train.sharding import check_distributed, tp_degree
from tests.helpers import write_recipe
from tests.parallel.figures import FP, NET, PARTS, STEP, ranks


def test_pipelines_of_pp_size_stages_at_least_two_of_them_the_replicas_reading_different_rows():
    m = PPDDP().mesh(4, tp_size=2, pp_size=2)
    assert m == Mesh(4, replicate=2, pp=2) and m.dp == 2
    assert [m.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # ranks 0, 1: replica 0's stages
    assert PPDDP().mesh(6, tp_size=2, pp_size=3) == Mesh(6, replicate=2, pp=3)
    with pytest.raises(EmberError, match="with pp_size = 2 needs a multiple of 2 ranks, at least 4; got 2"):
        PPDDP().mesh(2, tp_size=2, pp_size=2)
    with pytest.raises(EmberError, match="with pp_size = 3 needs a multiple of 3 ranks, at least 6; got 4"):
        PPDDP().mesh(4, tp_size=2, pp_size=3)


def test_each_pipeline_runs_its_replicas_share_of_the_micro_batches():
    assert [micro_batches(4, r) for r in (1, 2, 4)] == [4, 2, 1]
    assert micro_batches(3, 2) == 3 and micro_batches(4, 3) == 4  # each a slice of every micro-batch's rows


def test_the_plan_prices_the_bubble_the_sends_and_the_replicas_all_reduce():
    assert PPDDP().cost(FP, STEP, ranks(2)) is None and PPDDP().cost(FP, STEP, ranks(3)) is None
    c = PPDDP().cost(FP, STEP, ranks(4))
    # 2 replicas of 2 stages, 2 of the 4 micro-batches each: bubble (2-1)/(2+2-1) = 1/3, compute
    # 1 s / 4 / (2/3) = 0.375 s; sends 2 x 1 boundary x 2 micro-batches x 100 B at 100 B/s = 4 s;
    # the stage's half of the 400 gradient bytes all-reduced over 2 replicas: 2(2-1)/2 x 200 B = 2 s;
    # memory: the fuller stage of a pipeline running 2 micro-batches under 1F1B (figures.py's parts):
    # the last, 160 of state + 4 input receive buffers + 1 in flight of 41 + the loss's 40
    assert c.compute == pytest.approx(0.375)
    assert (c.comm, c.hidden, c.memory, c.moved) == (6.0, 0.0, 245.0, 2 * 2 * 100 + 200)
    assert "bubble 33% with 2 micro-batches per pipeline over 2 stages" in c.notes[1]
    six = PPDDP().cost(FP, STEP, ranks(6))  # 3 replicas: every micro-batch cut in 3, 4 slices each
    assert six.notes[1].startswith("bubble 20% with 4 micro-batches per pipeline")


def test_the_plan_prices_pipelines_of_the_recipes_pp_size():
    # pp_size 4 over 8 ranks: 2 replicas, 4 micro-batches each under 1F1B, 4 layers, one a stage
    fp = replace(FP, stages=replace(PARTS, layers=4, pipeline=(8, "1f1b", 4)))
    assert PPDDP().memory(fp, 8) == max(stage_memory(fp.stages, 4, 4, "1f1b"))
    # stage 0, the layer and the embeddings: 150 - 30 (4 in flight, no gradient yet) + 8 + 4 x 18 = 200;
    # stage 3, the layer and the head: 160 + 8 + 1 x 41 + 40 = 249 (not 2 stages' halves of the model)
    assert PPDDP().memory(fp, 8) == 249 and stage_memory(fp.stages, 4, 4, "1f1b")[0] == 200
    c = PPDDP().cost(fp, replace(STEP, accum=8, layers=4), ranks(8))
    assert c.notes[0].startswith("pipelines of 4 stages") and c.notes[-1].endswith("stage 3 of 4 is the fullest")
    assert PPDDP().cost(fp, replace(STEP, accum=8, layers=4), ranks(4)) is None  # one pipeline: 'pp'


def test_ember_plan_ranks_it_beside_the_others_from_four_devices_on():
    m = ModelShape("llama", layers=4, hidden=256, intermediate=512, heads=4, kv_heads=4, head_dim=64, vocab=1000)
    t = TrainShape(micro_batch=4, seq_len=64)
    a = advise(m, t, estimate(m, t), accum=4, one_step=1.0, ic=NET, free=1 << 40, counts=(1, 2, 4))
    ours = [o for o in a.options if o.strategy == "pp+ddp"]
    assert [o.devices for o in ours] == [4] and ours[0].fits and ours[0].step_seconds > 0
    assert ours[0].memory_bytes < next(o for o in a.options if o.strategy == "ddp" and o.devices == 4).memory_bytes


@pytest.mark.parametrize("ranks, sets, said", [
    (4, ["train.grad_accum=2"], "schedule '1f1b' runs at least one micro-batch per stage, and grad_accum = 2 "
                                "over 2 replicas gives each pipeline 1 for 2 stages; set [train] grad_accum = 4 "
                                "or [distributed] schedule = 'gpipe'"),
    (6, ["distributed.pp_size=3", "train.grad_accum=6"],
     "pp_size = 3 stages for the model's 2 decoder layers: a stage would hold none; set [distributed] pp_size "
     "to at most 2"),
    (2, ["train.grad_accum=4"], "with pp_size = 2 needs a multiple of 2 ranks, at least 4; got 2"),
    (5, ["train.grad_accum=10"], "with pp_size = 2 needs a multiple of 2 ranks, at least 4; got 5"),
    (3, [], "with pp_size = 2 needs a multiple of 2 ranks, at least 4; got 3"),  # not 1F1B's micro-batches
    (4, ["train.grad_accum=4", "eval.holdout=0.1"], "the held-out evaluation runs the whole model's forward"),
])
def test_what_its_pipelines_cannot_do_is_refused_with_the_fix(tmp_path, ranks, sets, said):
    r = load_recipe(write_recipe(tmp_path), ["distributed.strategy=pp+ddp", *sets])
    with pytest.raises(EmberError) as e:
        check_distributed(r, ranks, "recipe.toml")
    assert str(e.value).startswith("recipe.toml: ") and said in str(e.value)


def test_a_recipe_it_can_run_passes_and_its_stages_read_the_same_rows(tmp_path):
    r = load_recipe(write_recipe(tmp_path), ["distributed.strategy=pp+ddp", "train.grad_accum=4"])
    check_distributed(r, 4, "recipe.toml")
    assert tp_degree(r, 4) == 2  # the 2 stages of a pipeline read one replica's rows
    gpipe = load_recipe(write_recipe(tmp_path), ["distributed.strategy=pp+ddp", "distributed.schedule=gpipe"])
    check_distributed(gpipe, 4, "recipe.toml")  # GPipe runs one micro-batch through 2 stages


def test_a_rank_is_named_by_its_stage_and_replica(tmp_path):
    r = load_recipe(write_recipe(tmp_path), ["distributed.strategy=pp+ddp"])  # builtin:tiny: 2 layers
    assert [rank_names(r, 4)(k) for k in (1, 2)] == ["rank 1 (pipeline stage 1 of 2, layer 1, replica 0 of 2)",
                                                    "rank 2 (pipeline stage 0 of 2, layer 0, replica 1 of 2)"]


def test_gradients_are_averaged_in_buckets_of_one_dtype_and_bounded_size():
    import torch

    from ember.parallel.stages import _buckets
    grads = [torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(10), torch.zeros(1)]
    # 16 + 16 bytes of fp32; the bf16 one alone; 40 bytes, over the limit, alone; then a new bucket
    assert [[len(g) for g in b] for b in _buckets(grads, limit=32)] == [[4, 4], [2], [10], [1]]
