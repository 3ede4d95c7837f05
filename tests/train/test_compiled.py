"""[train] compile's pieces in-process: the "auto" rule, the recipe value, and graph breaks
counted and said (dynamo's eager backend: the breaks are dynamo's, no kernel is generated)."""

from __future__ import annotations

import pytest
import torch

from ember.errors import EmberError
from ember.models import BYTE_VOCAB
from ember.recipe import MethodConfig, ModelConfig, load_recipe
from ember.train.compiled import CACHE_VARIABLE, Compiler, break_warning, wanted
from ember.train.dropout import install
from ember.train.model import load_model
from tests.helpers import write_recipe


def test_auto_is_eager_everywhere_and_true_or_false_are_obeyed():
    assert wanted("auto") is False  # on every device, as measured: bench/README, "On a GPU"
    assert (wanted(True), wanted(False)) == (True, False)


def test_the_recipe_takes_true_false_or_auto_and_says_so_for_anything_else(tmp_path):
    assert load_recipe(write_recipe(tmp_path, train={"compile": True})).train.compile is True
    assert load_recipe(write_recipe(tmp_path)).train.compile == "auto"
    with pytest.raises(EmberError, match=r"\[train\] compile = 'yes': must be one of 'auto' or true or false"):
        load_recipe(write_recipe(tmp_path, train={"compile": "yes"}))


def test_graph_breaks_are_counted_with_their_reasons_and_warned_of(tmp_path, monkeypatch):
    """LoRA's keyed dropout runs eagerly (its keys change every step): each is a graph break,
    which the summary counts and the warning names, instead of a silent slowdown."""
    # A Compiler points inductor's cache at $EMBER_HOME through the environment, which the
    # commands this worker starts later inherit: as if their user had chosen that folder
    # (tests/e2e/test_compile.py then found its baseline's kernels elsewhere). Put back after.
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = load_model(ModelConfig(), MethodConfig(kind="lora", dropout=0.1, target_modules=["q_proj"]), False).model
    install(model, seed=0)
    model.train()
    compiler = Compiler(backend="eager")
    try:
        ids = torch.randint(0, BYTE_VOCAB, (2, 16))
        loss = compiler.loss(model, ids, 0, 30.0)
        loss.backward()
        summary = compiler.summary()
        spans = compiler.drain()
    finally:
        compiler.close()
    assert torch.isfinite(loss)
    assert spans and all(end >= start for start, end in spans) and compiler.drain() == []
    assert summary["graph_breaks"] > 0 and summary["graphs"] > 1
    assert sum(summary["break_reasons"].values()) == summary["graph_breaks"]
    warning = break_warning(summary)
    assert warning is not None and f"{summary['graph_breaks']} graph break(s)" in warning
    assert break_warning({**summary, "graph_breaks": 0}) is None


def test_activation_checkpointing_drops_the_input_grad_hooks_and_the_gradients_stay_the_same():
    """transformers and peft hook the input embeddings to call requires_grad_ (each a graph break
    when compiled); ember's non-reentrant checkpointing does without them, gradient for gradient."""
    def grads(keep_hooks: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = load_model(ModelConfig(), MethodConfig(kind="lora"), True).model
        assert not model.get_input_embeddings()._forward_hooks
        if keep_hooks:
            model.enable_input_require_grads()
        model.train()
        ids = torch.randint(0, BYTE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for p in model.parameters() if p.requires_grad]
    with_hooks, without = grads(True), grads(False)
    assert len(with_hooks) == len(without) > 0
    assert all(torch.equal(a, b) for a, b in zip(with_hooks, without))
