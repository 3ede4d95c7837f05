"""Pipeline parallelism: every rank a stage of one pipeline; the bubble and the activations'
sends are its cost (the runs themselves: tests/e2e/test_pipeline.py)."""

from __future__ import annotations

from ember.parallel.mesh import Mesh
from ember.parallel.placement import layer_range, rank_name
from dataclasses import replace

from ember.parallel.pp import PP, bubble, fullest, in_flight, rank_names, stage_memory
from ember.recipe import load_recipe
from tests.helpers import write_recipe
from tests.parallel.figures import FP, PARTS, STEP, ranks


def test_every_rank_is_a_stage_and_the_stages_read_the_same_rows():
    m = PP().mesh(2, tp_size=2, pp_size=2)
    assert m == Mesh(2, pp=2) and m.dp == 1 and [m.dp_rank(r) for r in (0, 1)] == [0, 0]


def test_a_stage_holds_its_share_of_the_state_and_waits_out_the_bubble():
    c = PP().cost(FP, STEP, ranks(2))
    # bubble (2-1)/(4+2-1) = 1/5: compute 1 s / 2 / (1 - 1/5) = 0.625 s; sends 2 x (2-1) boundaries
    # x 4 micro-batches x 100 bytes at 100 B/s = 8 s; memory: the fuller stage's (below), the last's 249
    assert (c.compute, c.comm, c.hidden, c.memory, c.moved) == (0.625, 8.0, 0.0, 249.0, 800.0)
    assert c.notes[0] == "bubble 20% with 4 micro-batches over 2 stages (raise [train] grad_accum to shrink it)"
    assert c.notes[-1].endswith("stage 1 of 2 is the fullest")


def test_each_stage_holds_its_layers_its_end_of_the_model_and_the_schedules_micro_batches():
    # 1F1B, 4 micro-batches over 2 stages (tests/parallel/figures.py's parts):
    # stage 0, layer 0 and the embeddings: state 150 (30 of it gradients), 2 in flight of 10 + 5
    # + 1 + 2 (its output, kept) each, a 2-byte gradient receive buffer per micro-batch (8): the
    # gradients exist (a third forward follows the first backward): 150 + 8 + 2 x 18 = 194 >
    # the update's 150 + 8 + 30;
    # stage 1, layer 1 and the head: state 160, 1 in flight of 10 + 30 + 1, the loss's 40, 4
    # input receive buffers: 160 + 8 + 41 + 40 = 249
    assert stage_memory(PARTS, 2, 4, "1f1b") == [194, 249]
    # GPipe: every micro-batch in flight on both, and no gradient yet when the backwards begin:
    # 150 - 30 + 8 + 4 x 18 = 200; 160 - 30 + 8 + 4 x 41 + 40 = 342
    assert stage_memory(PARTS, 2, 4, "gpipe") == [200, 342]
    # one stage holds everything and runs the micro-batches one at a time, as one process
    # accumulating gradients: 310 of state + 1 in flight of 20 + 5 + 30 + 1 + the loss's 40
    assert stage_memory(PARTS, 1, 4, "1f1b") == [310 + 56 + 40]


def test_1f1b_holds_fewer_micro_batches_the_later_the_stage():
    assert [in_flight(4, s, 8, "1f1b") for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(4, s, 2, "1f1b") for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight(4, s, 8, "gpipe") for s in range(4)] == [8, 8, 8, 8]


def test_four_stages_take_their_layers_as_the_run_splits_them():
    # 5 layers over 4 stages: 2, 1, 1, 1 (layer_range); 4 micro-batches under 1F1B, 4, 3, 2, 1 in flight
    parts = replace(PARTS, layers=5)
    # stage 0: 2 layers + embeddings: 250 of state (50 gradients), no gradient at 4 in flight (no
    # forward after a backward): 250 - 50 + 8 + 4 x (25 + 1 + 2) = 320
    # stage 1: a layer: 100 + 16 of buffers (input and gradient) + 3 in flight of 13, with gradients;
    # stage 2: 2 in flight (142) or the update's 100 + 16 + 30 = 146, the higher
    # stage 3: a layer and the head: 160 + 8 + 1 x 41 + 40 = 249
    assert stage_memory(parts, 4, 4, "1f1b") == [320, 100 + 16 + 3 * 13, 100 + 16 + 30, 249]
    assert PP().memory(replace(FP, stages=parts), 4) == 320
    assert fullest([320.0, 155.0, 146.0, 249.0]).endswith("stage 0 of 4 is the fullest")


def test_the_bubble_for_any_stages_and_micro_batches():
    assert bubble(2, 2) == 1 / 3 and bubble(4, 8) == 3 / 11 and bubble(8, 4) == 7 / 11 and bubble(4, 1) == 3 / 4


def test_no_layout_with_more_stages_than_layers():
    assert PP().cost(FP, STEP, ranks(3)) is None  # STEP has 2 layers


def test_layers_split_in_order_the_first_stages_taking_one_more():
    assert [list(layer_range(5, 2, s)) for s in (0, 1)] == [[0, 1, 2], [3, 4]]
    assert [list(layer_range(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]


def test_a_rank_is_named_by_its_stage_and_layers_on_a_pipeline_only(tmp_path):
    assert [rank_name(r, 2, 4) for r in (0, 1)] == ["rank 0 (pipeline stage 0 of 2, layers 0-1)",
                                                   "rank 1 (pipeline stage 1 of 2, layers 2-3)"]
    assert rank_name(2, 3, 5) == "rank 2 (pipeline stage 2 of 3, layer 4)" and rank_name(1) == "rank 1"
    r = load_recipe(write_recipe(tmp_path), ["distributed.strategy=pp"])  # builtin:tiny: 2 layers
    assert rank_names(r, 2)(1) == "rank 1 (pipeline stage 1 of 2, layer 1)"
    assert rank_names(load_recipe(write_recipe(tmp_path), []), 2)(1) == "rank 1"  # DDP: a replica is a rank
