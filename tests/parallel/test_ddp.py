"""DDP: every rank a replica; the gradients' all-reduce is its only traffic."""

from __future__ import annotations

import pytest

from ember.parallel.ddp import DDP
from ember.parallel.mesh import Mesh
from tests.parallel.figures import FP, STEP, ranks
from tests.parallel.ranks import apply_on_ranks


def test_every_rank_is_a_replica_that_reads_its_own_rows():
    m = DDP().mesh(4, tp_size=2, pp_size=2)
    assert m == Mesh(4, replicate=4) and m.dp == 4 and m.tp == 1


def test_a_replica_holds_what_one_process_holds_and_all_reduces_the_gradients():
    c = DDP().cost(FP, STEP, ranks(2))
    # compute 1 s / 2; all-reduce over 2 ranks moves 2(2-1)/2 = 1 x the 400 gradient bytes at 100 B/s
    assert (c.compute, c.comm, c.hidden, c.memory, c.moved, c.notes) == (0.5, 4.0, 0.0, 1000, 400.0, ())
    assert DDP().cost(FP, STEP, ranks(2, overlap=True)).hidden == pytest.approx(2 / 3 * 0.5)  # behind backward
    assert DDP().cost(FP, STEP, ranks(3)).notes == ("micro_batch x grad_accum = 8 rows do not share out over 3 ranks",)


def test_it_trains_lora_and_every_rank_holds_the_whole_model():
    assert DDP().lora_conflict == "" and DDP().whole_model


def test_applied_on_two_ranks_it_wraps_the_model_and_computes_the_plain_models_gradients(tmp_path):
    for rank in apply_on_ranks("ddp", 2, tmp_path):
        assert rank["wrapper"] == "DistributedDataParallel"
        assert rank["layout"]["q_proj"] == {"kind": "Tensor"}  # whole on every rank
        assert rank["loss"] == pytest.approx(rank["reference"], rel=1e-6)
        assert rank["grad_difference"] < 1e-6
