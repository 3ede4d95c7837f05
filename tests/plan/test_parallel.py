"""The parallelism advisor's arithmetic against figures worked by hand."""

from __future__ import annotations

import pytest

from ember.plan.memory import ModelShape, TrainShape, estimate
from ember.plan.advisor import Interconnect, Link, advise, collective_seconds, fit

MB = 1e6


def link(bandwidth: float, latency: float = 0.0) -> Link:
    return Link(latency, bandwidth)


def net(bandwidth: float, latency: float = 0.0, backend: str = "gloo") -> Interconnect:
    return Interconnect(2, 2, backend, link(bandwidth, latency), link(bandwidth, latency), link(bandwidth, latency))


def test_ring_collectives_by_hand():
    # all-reduce of 100 MB over 4 ranks: 6 hops, each rank moves 2*3/4 = 1.5 x 100 MB
    assert collective_seconds(link(100 * MB, 1e-3), "all_reduce", 100 * MB, 4) == pytest.approx(6e-3 + 1.5)
    # all-gather of a 100 MB tensor over 4 ranks: 3 hops, 3/4 of it arrives at each rank
    assert collective_seconds(link(100 * MB, 1e-3), "all_gather", 100 * MB, 4) == pytest.approx(3e-3 + 0.75)
    assert collective_seconds(link(1.0), "all_reduce", 1e9, 1) == 0


def test_fit_recovers_latency_and_bandwidth():
    sizes = [4 << 10, 1 << 20, 16 << 20]
    truth = link(500 * MB, 50e-6)
    times = [collective_seconds(truth, "all_reduce", s, 2) for s in sizes]
    got = fit("all_reduce", 2, sizes, times)
    assert got.latency == pytest.approx(50e-6, rel=1e-6) and got.bandwidth == pytest.approx(500 * MB, rel=1e-6)


M = ModelShape("llama", layers=4, hidden=256, intermediate=512, heads=4, kv_heads=4, head_dim=64, vocab=1000)
T = TrainShape(micro_batch=4, seq_len=64)


def test_ddp_step_is_half_the_compute_plus_the_gradient_all_reduce():
    b = estimate(M, T)
    grads = b.trainable * 4
    a = advise(M, T, b, accum=2, one_step=1.0, ic=net(100 * MB), free=1 << 40, counts=(1, 2))
    ddp = next(o for o in a.options if o.strategy == "ddp")
    # gloo: nothing hidden; 2 ranks move 2*(1/2) = 1 x the gradient bytes
    assert ddp.step_seconds == pytest.approx(0.5 + grads / (100 * MB))
    assert ddp.efficiency == pytest.approx(1.0 / (2 * ddp.step_seconds))


def test_a_slow_link_says_stay_on_one_device():
    b = estimate(M, T)
    a = advise(M, T, b, accum=2, one_step=0.05, ic=net(1 * MB), free=1 << 40, counts=(1, 2, 4))
    assert a.recommended.devices == 1
    assert a.reasons[0].startswith("stay on one device and accumulate gradients")


def test_a_fast_link_recommends_the_fastest_efficient_layout():
    b = estimate(M, T)
    a = advise(M, T, b, accum=8, one_step=10.0, ic=net(10_000 * MB), free=1 << 40, counts=(1, 2, 4, 8))
    assert (a.recommended.strategy, a.recommended.devices) == ("ddp", 8)


def test_cores_shared_by_ranks_do_not_add_compute():
    """Two CPU ranks on a machine whose cores one process already uses: no faster, only talk."""
    b = estimate(M, T)
    a = advise(M, T, b, accum=2, one_step=1.0, ic=net(100 * MB), free=1 << 40, counts=(1, 2), slots=1)
    ddp = next(o for o in a.options if o.strategy == "ddp")
    assert ddp.compute_seconds == pytest.approx(1.0) and a.recommended.devices == 1


def test_fsdp_fits_where_ddp_does_not():
    b = estimate(M, T)
    a = advise(M, T, b, accum=4, one_step=1.0, ic=net(10_000 * MB), free=int(b.peak * 0.9), counts=(1, 2, 4))
    assert not next(o for o in a.options if o.devices == 1).fits
    assert a.recommended.strategy == "fsdp" and a.recommended.fits


def test_two_ranks_of_two_threads_on_two_cores_name_core_sharing_not_the_link():
    """Issue 27, item 12: 50% efficiency where two ranks of two threads share two cores is the
    cores' doing; the advisor said it was the communication."""
    b = estimate(M, T)
    one_host = Interconnect(2, 1, "gloo", link(1000 * MB), link(1000 * MB), link(1000 * MB))
    a = advise(M, T, b, accum=2, one_step=1.0, ic=one_host, free=1 << 40, counts=(1, 2), slots=1,
               threads=2, cores=2)
    assert a.recommended.devices == 1
    assert "because 2 ranks x 2 threads per rank = 4 threads on 2 cores: the ranks share the cores" in a.reasons[0]
    slow = Interconnect(2, 1, "gloo", link(1 * MB), link(1 * MB), link(1 * MB))
    quiet = advise(M, T, b, accum=2, one_step=1.0, ic=slow, free=1 << 40, counts=(1, 2), slots=2,
                   threads=1, cores=2)
    assert "share the cores" not in quiet.reasons[0] and "because " in quiet.reasons[0]


def test_a_pipelines_memory_is_its_fullest_stages_and_the_plan_names_it():
    import io

    from rich.console import Console

    from ember.cli.plan import render_parallel
    from ember.parallel.pp import stage_memory
    from ember.plan.layout import footprint
    b = estimate(M, T)
    a = advise(M, T, b, accum=8, one_step=1.0, ic=net(100 * MB), free=1 << 40, counts=(1, 4, 8),
               pipeline=("gpipe", 4))
    pp = next(o for o in a.options if o.strategy == "pp" and o.devices == 4)
    # GPipe holds all 8 micro-batches on every stage; the last also keeps their logits and log-softmax
    stages = stage_memory(footprint(M, b, T, (8, "gpipe", 4)).stages, 4, 8, "gpipe")
    assert pp.memory_bytes == int(max(stages)) == int(stages[3])
    # the recipe's pp_size 4 over 8 ranks: 2 replicas of 4 stages, 4 micro-batches each
    ppddp = next(o for o in a.options if o.strategy == "pp+ddp")
    assert ppddp.devices == 8 and ppddp.memory_bytes == int(stage_memory(
        footprint(M, b, T, (8, "gpipe", 4)).stages, 4, 4, "gpipe")[3])
    out = io.StringIO()
    render_parallel(a, Console(file=out, width=200))
    assert "  pp on 4: memory per stage " in out.getvalue()
    assert "pp+ddp on 8: memory per stage " in out.getvalue() and "stage 3 of 4 is the fullest" in out.getvalue()


def test_no_tensor_parallel_layout_is_offered_where_the_heads_do_not_split():
    """A model of 2 key-value heads over a 100 MB/s link: the advisor recommended 'tp on 4' (and
    priced tp on 8), which the run refuses (ember.parallel.tp.check_dims); fsdp+tp's pairs split it."""
    m = ModelShape("llama", layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=1000)
    a = advise(m, T, estimate(m, T), accum=1, one_step=1.0, ic=net(100 * MB), free=1 << 40)
    assert {o.devices for o in a.options if o.strategy == "tp"} == {2}
    assert {o.devices for o in a.options if o.strategy == "fsdp+tp"} == {4, 8}
    assert (a.recommended.strategy, a.recommended.devices) != ("tp", 4)


def test_no_pipeline_is_offered_that_the_run_refuses():
    """A model whose head shares the embeddings' weight (tie_word_embeddings, as SmolLM's): when it
    did not fit one device the advisor recommended 'pp on 8', which the run refuses (the weight
    would sit on the first and the last stage); so is 1F1B with fewer micro-batches than stages,
    which it priced and recommended too ('pp on 2' at grad_accum 1)."""
    tied = ModelShape("llama", layers=8, hidden=256, intermediate=512, heads=4, kv_heads=4, head_dim=64, vocab=1000,
                      tied=True)
    b = estimate(tied, T)
    a = advise(tied, T, b, accum=8, one_step=1.0, ic=net(10 * MB), free=int(b.peak * 0.6), pipeline=("1f1b", 2))
    assert not [o for o in a.options if o.strategy in ("pp", "pp+ddp")]
    assert a.recommended is None or a.recommended.strategy not in ("pp", "pp+ddp")
    b = estimate(M, T)
    one = advise(M, T, b, accum=1, one_step=1.0, ic=net(10 * MB), free=int(b.peak * 0.6), pipeline=("1f1b", 2))
    assert not [o for o in one.options if o.strategy in ("pp", "pp+ddp")]
    gpipe = advise(M, T, b, accum=1, one_step=1.0, ic=net(10 * MB), free=int(b.peak * 0.6), pipeline=("gpipe", 2))
    assert {o.devices for o in gpipe.options if o.strategy == "pp"} == {2, 4}  # GPipe runs one micro-batch
