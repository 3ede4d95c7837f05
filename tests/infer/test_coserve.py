"""Co-serving's guards (ember.infer.coserve): what serving changes is put back exactly; the whole
runs are tests/e2e/test_coserve.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ember.infer.adapters import RequestError
from ember.infer.batching import Batcher, Job
from ember.infer.coserve import Credit, Gaps, preserved, swapped
from ember.infer.engine import Engine, Sampling


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


def test_credit_answers_a_quiet_moments_request_whole_and_holds_a_steady_stream_to_its_share():
    # A request after a quiet stretch: the whole saved-up burst is this gap's budget, not a share
    # of one 40 ms micro-batch (which a 64-token answer needs several gaps to fit in).
    quiet = Credit(share=1.0, burst=1.0)
    for _ in range(100):
        quiet.trained(0.04)  # gaps with nothing queued save up, to the burst and no more
    assert quiet.trained(0.04) == 1.0
    quiet.served(0.07)
    assert quiet.trained(0.04) == 1.0 - 0.07 + 0.04

    # A stream that never lets up: over T seconds of training, serving took at most
    # share x T + burst (the turn a gap takes without credit aside, none here).
    steady, served, trained = Credit(share=0.5, burst=1.0), 0.0, 0.0
    for _ in range(1000):
        budget = steady.trained(0.04)
        trained += 0.04
        take = max(0.0, budget)  # a request always queued: the gap spends all it may
        steady.served(take)
        served += take
    assert served <= 0.5 * trained + 1.0 + 1e-9 and served >= 0.5 * trained

    # A debt (a gap's one turn past its credit) is paid back by training before serving more.
    debt = Credit(share=1.0, burst=0.5)
    debt.served(0.8)
    assert debt.trained(0.1) == pytest.approx(-0.2)


def test_no_burst_is_the_share_of_each_gap_alone():
    none = Credit(share=2.0, burst=0.0)
    assert none.trained(0.0) == 0.0
    for dt in (0.04, 0.01, 0.1):
        assert none.trained(dt) == pytest.approx(2.0 * dt)  # nothing saved from earlier gaps


def test_a_gap_with_credit_answers_a_request_whole_and_one_without_takes_one_turn():
    """The gap's two bounds on builtin:tiny's real decode loop: with the burst saved up, one gap
    answers a queued 12-token request to its end; with no credit, a gap takes one turn."""
    engine = Engine("builtin:tiny", [], seed=7)
    engine.load()

    def queued():
        batcher = Batcher(engine, threaded=False)
        job = Job("base", list(range(40, 50)), Sampling(max_tokens=12, temperature=0))
        batcher.submit(job)
        return SimpleNamespace(batcher=batcher, model=engine.model), job

    saved, job = queued()
    whole = Gaps(saved, share=0.0, burst=3600.0)
    assert whole.gap() > 0 and not saved.batcher.pending()
    job.started()
    assert len(list(job.tokens())) == 12 and whole.turns > 1  # many turns in the one gap
    broke, _ = queued()
    one = Gaps(broke, share=0.0, burst=0.0)
    one.gap()
    assert one.turns == 1 and broke.batcher.pending()
    one.gap()
    assert one.turns == 2 and broke.batcher.pending()
