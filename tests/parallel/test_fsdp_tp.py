"""FSDP with tensor parallelism: tp inside groups of tp_size ranks, fsdp across the groups."""

from __future__ import annotations

import pytest

from ember.errors import EmberError
from ember.parallel.fsdp_tp import FSDPTP
from ember.parallel.mesh import Mesh
from tests.parallel.figures import FP, STEP, ranks
from tests.parallel.ranks import apply_on_ranks


def test_groups_of_tp_size_ranks_at_least_two_of_them():
    m = FSDPTP().mesh(8, tp_size=2, pp_size=2)
    assert m == Mesh(8, shard=4, tp=2) and m.dp == 4 and [m.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(EmberError, match="with tp_size = 2 needs a multiple of 2 ranks, at least 4; got 2"):
        FSDPTP().mesh(2, tp_size=2, pp_size=2)
    with pytest.raises(EmberError, match="needs a multiple of 4 ranks, at least 8; got 6"):
        FSDPTP().mesh(6, tp_size=4, pp_size=2)


def test_the_plan_prices_pairs_of_ranks_from_four_devices_on():
    assert FSDPTP().cost(FP, STEP, ranks(2)) is None
    c = FSDPTP().cost(FP, STEP, ranks(4))
    # 2 pairs: compute 1 s x (0.8/2 + 0.2) / 2; 2 micro-batches a pair, each 4 x 2 layers all-reduces
    # of 100 bytes in the pair (1 s) and 2 gathers of half the 400 weight bytes across the pairs
    # (1 s); one reduce-scatter of half the gradients (1 s)
    assert c.compute == pytest.approx(0.3)
    assert (c.comm, c.hidden, c.moved) == (16.0 + 4.0 + 1.0, 0.0, 1600 + 400 + 100)
    assert c.memory == 1000 - 600 * 3 / 4 - 200 * 0.25


def test_it_takes_lora_and_does_not_hold_the_whole_model():
    assert FSDPTP().lora_conflict == "" and not FSDPTP().whole_model


def test_applied_on_four_ranks_it_splits_in_pairs_shards_across_them_and_computes_the_plain_models_gradients(
        tmp_path):
    for rank in apply_on_ranks("fsdp+tp", 4, tmp_path, tp_size=2):
        assert rank["layout"]["o_proj"] == {"kind": "DTensor", "mesh": [2, 2], "placements": ["S(0)", "S(1)"]}
        assert rank["layout"]["q_proj"]["mesh"] == [2, 2]  # sharded across the pairs, split within
        assert rank["layout"]["embed"] == {"kind": "DTensor", "mesh": [2], "placements": ["S(0)"]}  # fsdp only
        assert rank["loss"] == pytest.approx(rank["reference"], rel=1e-6)
        assert rank["grad_difference"] < 1e-6
