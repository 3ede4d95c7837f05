"""The registry is the one list of strategies: the recipe, the run's checks and the plan read it,
so a strategy registered there is offered, checked and priced without another edit."""

from __future__ import annotations

import subprocess
import sys
import typing
from dataclasses import replace

import pytest

from ember.config import choices
from ember.errors import EmberError
from ember.parallel.mesh import Mesh
from ember.parallel.registry import STRATEGIES, either
from ember.parallel.strategy import Cost, Footprint, Ranks, Step
from ember.plan.advisor import advise
from ember.plan.memory import ModelShape, TrainShape, estimate
from ember.recipe import DistributedConfig, Recipe, explain
from ember.train.sharding import check_distributed, tp_degree
from tests.helpers import ROOT
from tests.parallel.figures import NET


class Halves:
    """A strategy made up for the test: two replicas, each sharded over half the ranks."""
    name = "halves"
    summary = "keeps two replicas, each sharded over half the ranks"
    lora_conflict = "has no adapters"
    whole_model = False

    def mesh(self, world: int, tp_size: int, pp_size: int) -> Mesh:
        return Mesh(world, replicate=2, shard=world // 2)

    def memory(self, fp: Footprint, n: int) -> float:
        return fp.peak / 2

    def cost(self, fp: Footprint, step: Step, ranks: Ranks) -> Cost:
        return Cost(step.seconds / ranks.n, 0.0, 0.0, self.memory(fp, ranks.n), 0.0)

    def apply(self, model, mesh, device):
        return model


def test_the_recipe_offers_and_documents_exactly_the_registered_strategies():
    assert choices(typing.get_type_hints(DistributedConfig)["strategy"]) == tuple(STRATEGIES)
    help_text = next(h for key, _, _, h in explain() if key == "distributed.strategy")
    for s in STRATEGIES.values():
        assert f"'{s.name}' {s.summary}" in help_text


def test_each_strategy_is_registered_under_its_name_with_a_mesh_of_the_world():
    assert list(STRATEGIES) == ["ddp", "fsdp", "tp", "fsdp+tp", "pp", "pp+ddp"]  # the order `ember plan` lists them in
    for name, s in STRATEGIES.items():
        assert s.name == name and s.summary
        m = s.mesh(8, 2, 2)
        assert m.world == 8 and m.replicate * m.shard * m.tp * m.pp == 8


def test_a_mesh_whose_degrees_do_not_multiply_to_the_world_is_refused():
    with pytest.raises(EmberError, match="6 ranks do not divide into replicate x shard x tp x pp = 2 x 2 x 1 x 1"):
        Mesh(6, replicate=2, shard=2)
    with pytest.raises(EmberError, match="each degree is at least 1"):
        Mesh(0, tp=0)


def test_either_lists_names_for_a_message():
    assert either(["ddp"]) == "'ddp'"
    assert either(["ddp", "fsdp"]) == "'ddp' or 'fsdp'"
    assert either(["a", "b", "c"]) == "'a', 'b' or 'c'"


def test_a_registered_strategy_is_checked_by_the_run_and_priced_by_the_plan(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "halves", Halves())
    r = Recipe()
    r.distributed.strategy, r.train.micro_batch = "halves", 4
    check_distributed(r, 4, "recipe.toml")
    assert tp_degree(r, 4) == 1
    with pytest.raises(EmberError, match="recipe.toml: 5 ranks do not divide into replicate x shard x tp x pp = 2 x 2 x 1 x 1"):
        check_distributed(r, 5, "recipe.toml")
    r.method.kind = "lora"
    with pytest.raises(EmberError, match="strategy = 'halves' has no adapters; use strategy 'ddp', 'fsdp', 'tp', 'fsdp\\+tp', 'pp' or 'pp\\+ddp' for LoRA"):
        check_distributed(r, 4, "recipe.toml")
    m = ModelShape("llama", layers=4, hidden=256, intermediate=512, heads=4, kv_heads=4, head_dim=64, vocab=1000)
    t = TrainShape(micro_batch=4, seq_len=64)
    b = estimate(m, t)
    a = advise(m, t, b, accum=2, one_step=1.0, ic=NET, free=1 << 40, counts=(1, 2))
    halves = next(o for o in a.options if o.strategy == "halves")
    assert (halves.devices, halves.memory_bytes, halves.step_seconds) == (2, b.peak // 2, 0.5)
    lora = replace(t, lora=True)  # the plan for LoRA offers only what a LoRA run accepts
    a = advise(m, lora, estimate(m, lora), accum=2, one_step=1.0, ic=NET, free=1 << 40, counts=(1, 2, 4))
    offered = {o.strategy for o in a.options}
    assert "halves" not in offered and {"ddp", "fsdp", "tp", "fsdp+tp"} <= offered


def test_the_registry_recipe_and_plan_import_without_torch():
    """`ember plan` and recipe validation read the strategies; torch loads only when one applies itself."""
    code = ("import sys, ember.parallel.registry, ember.recipe, ember.plan.advisor; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
