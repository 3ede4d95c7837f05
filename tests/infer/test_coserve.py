"""Co-serving's guards (ember.infer.coserve): what serving changes is put back exactly; the whole
runs are tests/e2e/test_coserve.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.infer.adapters import RequestError
from ember.infer.batching import Batcher, Job
from ember.infer.coserve import preserved, swapped
from ember.infer.engine import Sampling


def test_preserved_puts_back_each_modules_flag_requires_grad_and_the_rng():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    model.train()
    model[2].eval()  # mixed flags: model.train() afterwards would not restore these
    model[0].weight.requires_grad_(False)
    torch.manual_seed(11)
    expected = torch.rand(3)  # what the stream draws next, had nothing been served
    torch.manual_seed(11)
    with preserved(model):
        assert not any(m.training for m in model.modules())
        torch.rand(100)  # serving draws: the training's stream must not see it
        model[2].weight.requires_grad_(True)
        model[0].weight.requires_grad_(True)
    assert [m.training for m in model.modules()] == [True, True, True, False]
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad
    assert torch.equal(torch.rand(3), expected)


def test_swapped_serves_the_given_weights_then_the_live_ones_bit_for_bit():
    model = nn.Linear(3, 3)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    committed = {"weight": torch.randn(3, 3)}
    with swapped(model, committed):
        assert torch.equal(model.weight, committed["weight"]) and torch.equal(model.bias, live["bias"])
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())
    assert model.weight.requires_grad and model.weight.grad is None


def test_a_request_after_the_loop_closed_is_refused_with_503():
    batcher = Batcher(engine=None, threaded=False)
    batcher.close()
    job = Job("live", [1, 2], Sampling(max_tokens=2, temperature=0))
    batcher.submit(job)
    with pytest.raises(RequestError) as e:
        job.started()
    assert e.value.status == 503 and not batcher.pending()
