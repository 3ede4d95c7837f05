"""Tensor parallelism: every decoder layer's projections split over all the ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ember.errors import EmberError
from ember.parallel.mesh import Mesh
from ember.parallel.tp import TP, check_dims
from ember.recipe import load_recipe
from ember.train.sharding import check_distributed
from tests.helpers import write_recipe
from tests.parallel.figures import FP, STEP, ranks
from tests.parallel.ranks import apply_on_ranks


def test_all_ranks_are_one_group_that_reads_the_same_rows():
    m = TP().mesh(4, tp_size=2, pp_size=2)
    assert m == Mesh(4, tp=4) and m.dp == 1 and m.dp_rank(3) == 0


def test_the_layers_state_and_half_the_activations_split():
    # 0.8 of the state is the layers'; half the activations are the split projections'
    assert TP().memory(FP, 2) == pytest.approx(1000 - 600 * 0.8 / 2 - 200 * 0.5 / 2)


def test_four_all_reduces_of_the_activations_per_layer_and_micro_batch():
    c = TP().cost(FP, STEP, ranks(2))
    # the layers' 0.8 of the compute split 2 ways, the rest whole; 4 x 2 layers x 4 micro-batches
    # all-reduces of 100 bytes over 2 ranks, 1 s each
    assert c.compute == pytest.approx(0.8 / 2 + 0.2)
    assert (c.comm, c.hidden, c.moved) == (32.0, 0.0, 3200.0)
    assert "keep it within one node" in c.notes[0]


def test_heads_and_mlp_width_must_split_evenly():
    check_dims(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=8), 2)
    bad = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3, intermediate_size=12)
    with pytest.raises(EmberError, match="num_key_value_heads = 3 does not split 2 ways; use 3 ranks per "
                                         "tensor-parallel group, or strategy 'fsdp'"):
        check_dims(bad, 2)


def test_it_takes_lora_and_does_not_hold_the_whole_model():
    assert TP().lora_conflict == "" and not TP().whole_model


def test_applied_on_two_ranks_it_splits_the_projections_and_computes_the_plain_models_gradients(tmp_path):
    for rank in apply_on_ranks("tp", 2, tmp_path):
        assert rank["layout"]["q_proj"] == {"kind": "DTensor", "mesh": [2], "placements": ["S(0)"]}  # column-wise
        assert rank["layout"]["o_proj"] == {"kind": "DTensor", "mesh": [2], "placements": ["S(1)"]}  # row-wise
        assert rank["layout"]["embed"] == {"kind": "Tensor"}  # whole on every rank
        assert rank["loss"] == pytest.approx(rank["reference"], rel=1e-6)
        assert rank["grad_difference"] < 1e-6


def test_lora_adapters_split_with_their_base_and_compute_the_plain_peft_models_gradients(tmp_path):
    """Column-wise (q): lora_B's output rows split as the base's, lora_A whole; row-wise (o):
    lora_A's input columns split, lora_B whole. base(x) + B(A(x)) on the shards gives one
    process's loss, and every adapter's gradient (gathered whole) one process's."""
    for rank in apply_on_ranks("tp", 2, tmp_path, lora=True):
        split = {k: v["placements"] for k, v in rank["layout"].items() if v["kind"] == "DTensor"}
        assert split == {"q_proj.lora_B": ["S(0)"], "o_proj.lora_A": ["S(1)"]}
        assert rank["loss"] == pytest.approx(rank["reference"], rel=1e-6)
        assert rank["grad_difference"] < 1e-6


def test_with_lora_the_frozen_base_layers_split_and_the_adapters_add_little():
    """A LoRA plan over 2 TP ranks: a rank saves at least 0.45 of the decoder layers' frozen fp32
    weights (half of them, less what it keeps whole; 0.65 here with half the split projections'
    activations); full fine-tuning, whose gradients and Adam state split too, about 3x that."""
    from ember.plan.layout import footprint
    from ember.plan.memory import ModelShape, TrainShape, estimate
    m = ModelShape("llama", layers=8, hidden=512, intermediate=1024, heads=8, kv_heads=8, head_dim=64, vocab=1000)
    lora, full = TrainShape(micro_batch=2, seq_len=64, lora=True), TrainShape(micro_batch=2, seq_len=64)
    layers = m.layers * m.layer_params() * 4
    saved = {}
    for name, t in [("lora", lora), ("full", full)]:
        fp = footprint(m, estimate(m, t), t)
        saved[name] = fp.peak - TP().memory(fp, 2)
    assert saved["lora"] >= 0.45 * layers
    assert 2.5 < saved["full"] / saved["lora"] < 5


@pytest.mark.parametrize("strategy, ranks, sets", [("tp", 4, []), ("fsdp+tp", 8, ["distributed.tp_size=4"])])
def test_a_model_whose_heads_do_not_split_is_refused_before_any_rank_starts(tmp_path, strategy, ranks, sets):
    """builtin:tiny has 2 key-value heads: `ember run --nproc 4` under 'tp' (or 'fsdp+tp' in
    groups of 4) passed the launch's checks, started the ranks, and each rank failed in check_dims
    after loading the model."""
    r = load_recipe(write_recipe(tmp_path), [f"distributed.strategy={strategy}", "train.grad_accum=2", *sets])
    with pytest.raises(EmberError, match="recipe.toml: .*num_key_value_heads = 2 does not split 4 ways"):
        check_distributed(r, ranks, "recipe.toml")
    splits = r.with_changes({"distributed.tp_size": 2}) if sets else r  # 2 ways: it splits
    check_distributed(splits, ranks if sets else 2, "recipe.toml")
