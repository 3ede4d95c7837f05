"""Activation checkpointing's recomputation priced by its ops' fixed cost beside its FLOPs
(ember.plan.recompute.recomputed_ops, Peak.per_op_s, ember.metrics.peaks.with_op_cost)."""

from __future__ import annotations

import json
import math
from dataclasses import replace


from ember.metrics import peaks
from ember.metrics.peaks import Peak, with_op_cost
from ember.models import config_fields
from ember.plan.memory import ModelShape, TrainShape
from ember.plan.planner import estimated_seconds
from ember.plan.recompute import recomputed_ops
from ember.plan.remedies import step_flops, train_shape
from ember.recipe import load_recipe
from tests.helpers import write_recipe
from tests.plan.ops import second_step_ops

SHAPE = ModelShape("llama", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32, vocab=100)
PEAK = Peak(1e12, "test: 1 TFLOP/s")


def _step_ops(tmp_path, method: dict, ac: bool) -> tuple[int, TrainShape]:
    """Ops of builtin:tiny's second micro-batch step (its update included) under `method`."""
    n, r = second_step_ops(tmp_path / f"{sorted(method.items())}{ac}".replace("/", "_"), method, ac)
    return n, train_shape(r)


def test_the_ops_priced_are_the_ops_a_checkpointed_step_adds(tmp_path):
    """A checkpointed step's ops less the plain step's, counted in real steps of builtin:tiny,
    are recomputed_ops' within 3% (full, LoRA on every linear and on one with dropout, QLoRA);
    the plain step recomputes nothing."""
    m = ModelShape.from_config(config_fields("builtin:tiny"))
    seen = {}
    for name, method in {"full": {"kind": "full"}, "lora": {"kind": "lora"},
                         "lora q dropout": {"kind": "lora", "target_modules": ["q_proj"], "dropout": 0.1},
                         "qlora": {"kind": "lora", "quantize": "nf4"}}.items():
        plain, t = _step_ops(tmp_path, method, False)
        checkpointed, t_ac = _step_ops(tmp_path, method, True)
        assert recomputed_ops(m, t) == 0
        seen[name] = (checkpointed - plain, recomputed_ops(m, t_ac))
    assert all(math.isclose(counted, priced, rel_tol=0.03) for counted, priced in seen.values()), seen
    assert seen["full"][0] > seen["lora q dropout"][0] and seen["lora"][0] > seen["lora q dropout"][0], seen


def test_the_priced_time_grows_with_the_recomputed_ops_at_fixed_flops():
    """Two checkpointed models of nearly the same FLOPs, one with four times the layers, each a
    quarter the size: each recomputed op's fixed cost makes the one with more layers slower by
    that cost times the extra ops; without it (the old pricing) the two differ by their FLOPs only."""
    many = ModelShape("llama", layers=8, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, vocab=100)
    t = TrainShape(4, 32, lora=True, activation_checkpointing=True)
    assert math.isclose(step_flops(many, t, 2), step_flops(SHAPE, t, 2), rel_tol=0.25)
    assert recomputed_ops(SHAPE, t) == 2 * (85 + 7 * 17) and recomputed_ops(many, t) == 4 * recomputed_ops(SHAPE, t)
    costly = replace(PEAK, per_op_s=1e-5)
    flops_gap = estimated_seconds(many, t, 2, PEAK, 0.35) - estimated_seconds(SHAPE, t, 2, PEAK, 0.35)
    gap = estimated_seconds(many, t, 2, costly, 0.35) - estimated_seconds(SHAPE, t, 2, costly, 0.35)
    assert math.isclose(gap - flops_gap, 2 * 3 * recomputed_ops(SHAPE, t) * 1e-5)
    assert gap > 10 * abs(flops_gap)
    plain = replace(t, activation_checkpointing=False)  # nothing recomputed: nothing to price
    assert estimated_seconds(many, plain, 2, costly, 0.35) == estimated_seconds(many, plain, 2, PEAK, 0.35)


def test_a_cpu_measures_its_recomputed_ops_cost_once(tmp_path, monkeypatch):
    """On a CPU each recomputed op's cost is measured and cached in $EMBER_HOME like the CPU
    peak: the second plan reads it back; an accelerator's is 0 (not measured)."""
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    first = with_op_cost(PEAK, "cpu", 1)
    assert 0 < first.per_op_s < 1e-2 and "recomputed ops" in first.source, first
    cached = json.loads((tmp_path / "home/cache/cpu_peak.json").read_text())
    (record,) = [v for k, v in cached.items() if k.startswith("recomputed op")]
    assert math.isclose(1 / record["flops"], first.per_op_s) and record["at"] > 0
    # read back, not measured again, at the load it was measured under (measured under load, it
    # is measured again once the machine is quieter: ember.metrics.peaks.stale)
    monkeypatch.setattr(peaks, "others_share", lambda window=0.1: record.get("others"))
    assert with_op_cost(PEAK, "cpu", 1) == first
    assert with_op_cost(PEAK, "cuda", 1) == PEAK


def test_fit_ranks_qlora_ahead_of_checkpointed_lora_where_the_recomputation_costs_more(tmp_path):
    """bench/fit_check.py's case 3 (builtin:tiny, seq 64, 4 x 2, budget 0.22x the recipe's peak):
    only checkpointed LoRA and QLoRA fit; measured here QLoRA rank 4 is the faster (65 against 79
    ms). With each 4-bit call and each recomputed op at the cost measured here (~55 and ~12 µs),
    the search picks QLoRA; with the recomputation priced by its FLOPs only, checkpointed LoRA."""
    from ember.metrics.peaks import Bandwidth
    from ember.plan.fit import search
    path = write_recipe(tmp_path, data={"seq_len": 64}, train={"micro_batch": 4, "grad_accum": 2})
    r, m = load_recipe(path), ModelShape.from_config(config_fields("builtin:tiny"))
    rate = Bandwidth(7.31e9, "test: 7.31 GB/s, 55 µs a call", per_call_s=55e-6)
    peak = Peak(1e11, "test: 100 GFLOP/s (this CPU, one thread: ~113)")
    whole = search(r, m, 2**40, peak, bandwidth=rate).as_written
    budget = int(whole.with_margin * 0.22)
    old = search(r, m, budget, peak, bandwidth=rate).best[0]
    new = search(r, m, budget, replace(peak, per_op_s=12e-6), bandwidth=rate).best[0]
    assert (old.method, old.rank, old.activation_checkpointing) == ("lora", 4, True), old
    assert (new.method, new.rank, new.activation_checkpointing) == ("qlora", 4, False), new
