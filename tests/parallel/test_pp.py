"""Pipeline parallelism: every rank a stage of one pipeline; the bubble and the activations'
sends are its cost (the runs themselves: tests/e2e/test_pipeline.py)."""

from __future__ import annotations

from ember.parallel.mesh import Mesh
from ember.parallel.placement import layer_range, rank_name
from ember.parallel.pp import PP, rank_names
from ember.recipe import load_recipe
from tests.helpers import write_recipe
from tests.parallel.figures import FP, STEP, ranks


def test_every_rank_is_a_stage_and_the_stages_read_the_same_rows():
    m = PP().mesh(2, tp_size=2, pp_size=2)
    assert m == Mesh(2, pp=2) and m.dp == 1 and [m.dp_rank(r) for r in (0, 1)] == [0, 0]


def test_a_stage_holds_its_share_of_the_state_and_waits_out_the_bubble():
    c = PP().cost(FP, STEP, ranks(2))
    # bubble (2-1)/(4+2-1) = 1/5: compute 1 s / 2 / (1 - 1/5) = 0.625 s; sends 2 x (2-1) boundaries
    # x 4 micro-batches x 100 bytes at 100 B/s = 8 s; memory 600/2 state + 200 activations + 200 other
    assert (c.compute, c.comm, c.hidden, c.memory, c.moved) == (0.625, 8.0, 0.0, 700.0, 800.0)
    assert c.notes[0] == "bubble 20% with 4 micro-batches over 2 stages (raise [train] grad_accum to shrink it)"


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
