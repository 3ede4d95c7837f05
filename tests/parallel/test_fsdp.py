"""FSDP: the state sharded over every rank; the weights gathered per micro-batch."""

from __future__ import annotations

import pytest

from ember.parallel.fsdp import FSDP
from ember.parallel.mesh import Mesh
from tests.parallel.figures import FP, STEP, ranks
from tests.parallel.ranks import apply_on_ranks


def test_every_rank_holds_a_shard_and_reads_its_own_rows():
    m = FSDP().mesh(4, tp_size=2, pp_size=2)
    assert m == Mesh(4, shard=4) and m.dp == 4 and m.tp == 1


def test_memory_is_a_shard_of_the_state_and_two_gathered_layers():
    assert FSDP().memory(FP, 2) == 1000 - 600 / 2 + 2 * 50
    assert FSDP().memory(FP, 4) == 1000 - 600 * 3 / 4 + 2 * 50


def test_each_micro_batch_gathers_the_weights_twice_and_the_step_reduce_scatters_once():
    c = FSDP().cost(FP, STEP, ranks(2))
    # 2 micro-batches a rank; an all-gather of 400 bytes over 2 ranks moves 200 (2 s), as does the
    # reduce-scatter of the 400 gradient bytes: 2 x 2 x 2 s + 2 s
    assert (c.compute, c.comm, c.hidden, c.memory, c.moved) == (0.5, 10.0, 0.0, 800, 2 * 2 * 200 + 200)


def test_it_trains_lora_but_no_rank_holds_the_whole_model():
    assert FSDP().lora_conflict == "" and not FSDP().whole_model


def test_applied_on_two_ranks_it_shards_every_parameter_and_computes_the_plain_models_gradients(tmp_path):
    for rank in apply_on_ranks("fsdp", 2, tmp_path):
        for name in ("q_proj", "o_proj", "embed"):
            assert rank["layout"][name] == {"kind": "DTensor", "mesh": [2], "placements": ["S(0)"]}
        assert rank["loss"] == pytest.approx(rank["reference"], rel=1e-6)
        assert rank["grad_difference"] < 1e-6
