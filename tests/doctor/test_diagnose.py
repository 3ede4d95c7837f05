"""The doctor's ranking on hand-built figures: each case is a misranking users reported, with
the numbers they saw, and the arithmetic checked by hand."""

from __future__ import annotations

import math
import re

import pytest

from ember.doctor.diagnose import (
    THRESHOLD,
    Baseline,
    CheckpointFigures,
    ContentionFigures,
    DdpFigures,
    Figures,
    InputFigures,
    Shape,
    SweepFigures,
    SweepPoint,
    diagnose,
    difference,
)
from ember.doctor.experiments.real_loop import iterations

MS = 1e-3
SPREAD = (-1.0, 0.5, -0.25, 1.0, 0.0, -0.5, 0.25, 0.75, -0.75)  # a fixed, symmetric "noise"


def around(ms: float, jitter: float = 0.02, n: int = 9, shift: int = 0) -> list[float]:
    """n repeated measurements of `ms` milliseconds, spread by +-jitter of it; `shift` rotates
    the noise, so the other side of a comparison taken in rounds does not repeat it."""
    return [ms * MS * (1 + jitter * SPREAD[(i + shift) % len(SPREAD)]) for i in range(n)]


def shape(**kw) -> Shape:
    base = {"micro_batch": 8, "grad_accum": 1, "seq_len": 64, "workers": 0, "threads": 1, "cores": 2, "checkpoint_async": True,
                "checkpoint_every_steps": 20, "checkpoint_every_seconds": 0.0}
    return Shape(**{**base, **kw})


def baseline(**phases_ms: float) -> Baseline:
    phases = {k: v * MS for k, v in phases_ms.items()}
    step = sum(phases.values())
    its = [step * (1 + 0.02 * s) for s in SPREAD]
    return Baseline(its, its, phases, step, step, step * 1.02, 512, 512 / step, 0.2, "measured", "cpu")


def by_cause(findings) -> dict:
    return {x.cause: x for x in findings}


def test_a_difference_counts_only_beyond_its_noise():
    assert not difference(around(10.0), around(10.2)).significant  # 2% apart, 2% jitter
    # taken in rounds, a load that drifts from round to round cancels in the per-round differences
    drift = [1.0, 1.3, 0.8, 1.5, 0.9, 1.2, 1.4, 0.7, 1.1]
    a, b = [10 * MS * x * 1.05 for x in drift], [10 * MS * x for x in drift]
    assert not difference(a, b).significant and difference(a, b, paired=True).significant
    d = difference(around(20.0), around(10.0))
    assert d.significant and d.seconds == pytest.approx(10 * MS)
    assert not difference([1.0, 2.0], [0.0, 0.0]).significant  # two values are no evidence
    assert math.isinf(difference([1.0], [0.0, 0.0, 0.0]).low)
    # a heavy tail (threads descheduled now and then) against a tight side: every fewer-threads
    # step is faster than the median with more threads
    two = [0.096, 0.096, 0.116, 0.144, 0.154, 0.188, 0.2, 0.29, 0.365, 0.38, 0.69, 1.1]
    one = [0.083, 0.089, 0.089, 0.089, 0.09, 0.094, 0.107, 0.109, 0.113, 0.115, 0.118, 0.12]
    assert difference(two, one, "mean").significant and difference(two, one).significant
    # means, for a cost that comes every few steps: 1 in 4 iterations 40 ms slower
    d = difference([10 * MS, 10 * MS, 10 * MS, 50 * MS] * 4, around(10.0, 0.01, 16), "mean")
    assert d.significant and d.seconds == pytest.approx(10 * MS, rel=0.02)


def test_ddp_with_sync_no_slower_than_no_sync_is_not_communication_bound():
    """Reported: `doctor examples/tiny.toml --ddp 2` ranked communication-bound first at 100%
    while its evidence read sync 37.3 ms, no_sync 37.6 ms, the all-reduce fully overlapped."""
    f = Figures(shape(), baseline(data=0.5, forward=12, backward=18, optimizer=6, other=0.5),
                ddp=DdpFigures(2, "gloo", around(37.3, 0.04), around(37.6, 0.04, shift=4), around(4.0)))
    found = diagnose(f)
    comm = by_cause(found)["communication-bound"]
    assert found[0].cause == "compute-bound"
    assert comm.saving_seconds == 0 and comm.saving_share == 0
    hidden = int(re.search(r"(\d+)% of it hidden", comm.evidence[1]).group(1))
    assert hidden >= 90
    assert all(x.saving_share >= 0 for x in found)


def test_ddp_with_exposed_synchronisation_is_communication_bound():
    f = Figures(shape(grad_accum=1), baseline(forward=2, backward=3, optimizer=30, other=1),
                ddp=DdpFigures(2, "gloo", around(330.0), around(130.0, shift=4), around(220.0)))
    found = diagnose(f)
    comm = found[0]
    assert comm.cause == "communication-bound" and comm.changes == {"train.grad_accum": 4}
    # ranked against the step under DDP: the loop's 36 ms + the 200 ms synchronisation exposes
    step = 236 * MS
    assert comm.saving_seconds == pytest.approx(200 * MS * 3 / 4, rel=0.01)
    # the prediction also counts the optimizer steps the change saves (31 ms, 3 in 4 of them)
    assert comm.predicted_step_seconds == pytest.approx(step - 150 * MS - 31 * MS * 3 / 4, rel=0.01)


def test_an_input_saving_needs_a_measured_difference():
    """Reported: on a run folder, input-bound first with 13.9 s/step saving while the data
    wait measured 6.5 ms. A 6.5 ms wait inside a 2 s step's noise saves nothing measurable."""
    f = Figures(shape(), baseline(data=6.5, forward=800, backward=1100, optimizer=100),
                input=InputFigures(around(2006.5), around(2000.0, shift=4), 6.5 * MS, 900.0, 150.0, 2))
    inp = by_cause(diagnose(f))["input-bound"]
    assert inp.saving_seconds == 0 and "interval -" in inp.evidence[0]


def test_an_input_saving_is_at_most_the_wait():
    # 20 ms a micro-batch to load, 5 ms to compute: 2 loaders give 10 ms a micro-batch
    f = Figures(shape(), baseline(data=20, forward=2, backward=2.5, optimizer=0.5, checkpoint=0.5, other=0.5),
                input=InputFigures(around(25.0), around(5.0, shift=4), 20 * MS, 50.0, 50.0, 2))
    inp = diagnose(f)[0]
    assert inp.cause == "input-bound" and inp.changes == {"data.workers": 2}
    assert inp.saving_seconds == pytest.approx(15 * MS, rel=0.01)  # 25 ms -> max(5, 10) ms
    assert inp.predicted_step_seconds == pytest.approx(26 * MS - 15 * MS, rel=0.01)


def test_synchronous_checkpoint_every_step_is_checkpoint_bound_first():
    """Reported: every_steps = 1, async = false on the tiny example: input-bound first (71%),
    checkpoint-bound third (11%), with a 164 ms step whose phases added up to 21 ms. The real
    loop's phases add up to its step; the checkpoint's measured cost ranks it first."""
    f = Figures(shape(checkpoint_async=False, checkpoint_every_steps=1),
                baseline(data=1, h2d=0.1, forward=7.9, backward=10, optimizer=3, checkpoint=140, other=2),
                input=InputFigures(around(22.0, 0.05), around(21.5, 0.05, shift=4), 0.6 * MS, None, 1500.0, 2),
                checkpoint=CheckpointFigures("off", 0, around(164.0), around(24.0), 140 * MS, 3 * MS, 1.0,
                                             24 * 3600))
    assert sum(f.baseline.phases.values()) == pytest.approx(164 * MS)
    found = diagnose(f)
    assert [x.cause for x in found][:2] == ["checkpoint-bound", "compute-bound"]
    ck = found[0]
    # 140 ms a checkpoint against a day between interruptions: Young/Daly says every ~155 s
    assert ck.changes == {"checkpoint.every_seconds": "auto", "checkpoint.every_steps": 0, "checkpoint.async": True}
    assert ck.saving_seconds == pytest.approx(140 * MS, rel=0.01)
    assert by_cause(found)["input-bound"].saving_seconds == 0


def test_a_time_based_interval_remedy_turns_every_steps_off():
    """Reported: the remedy said every_seconds = "auto" while every_steps still forced saves."""
    f = Figures(shape(checkpoint_every_steps=1),
                baseline(forward=8, backward=10, optimizer=2, checkpoint=25, other=15),
                checkpoint=CheckpointFigures("off", 0, around(60.0), around(20.0), 25 * MS, 0.0, 1.0, 24 * 3600))
    ck = diagnose(f)[0]
    assert ck.cause == "checkpoint-bound"
    assert ck.changes == {"checkpoint.every_seconds": "auto", "checkpoint.every_steps": 0}
    # 40 ms a checkpoint, each step; Young/Daly's interval is minutes: nearly all of it saved
    assert ck.saving_seconds == pytest.approx(40 * MS, rel=0.01)


def test_contention_ranks_first_when_fewer_threads_measure_faster():
    """Reported: 1.1 s a step with 2 threads, 0.025 s with 1, on a busy machine: called
    compute-bound, remedy bf16."""
    f = Figures(shape(threads=2), baseline(data=1, forward=500, backward=550, optimizer=49),
                contention=ContentionFigures(3.9, 5, 1.8, 0.0, 0.6, 600 * MS, 1, around(1100.0), around(25.0, shift=4)))
    found = diagnose(f)
    top = found[0]
    assert top.cause == "contention" and top.changes == {"train.threads": 1}
    assert top.saving_seconds == pytest.approx(1075 * MS, rel=0.01)
    assert "1.80 cores" in top.evidence[0]


def test_contention_on_one_thread_counts_only_when_others_use_the_cores():
    quiet = ContentionFigures(0.3, 1, 0.1, 0.0, 0.3, 30 * MS)  # its own waits, not others'
    busy = ContentionFigures(3.5, 4, 1.5, 0.0, 0.5, 45 * MS)
    b = baseline(forward=40, backward=45, optimizer=5)
    assert by_cause(diagnose(Figures(shape(), b, contention=quiet)))["contention"].saving_seconds == 0
    top = diagnose(Figures(shape(), b, contention=busy))[0]
    assert top.cause == "contention" and top.saving_seconds == pytest.approx(45 * MS) and top.changes == {}


def test_contention_counts_the_wait_when_fewer_threads_are_not_faster():
    """CI: busy loops on both cores, 2 threads; fewer threads measured no faster (the busy
    loops happened to leave the doctor alone meanwhile). The finding said 0 s and ranked below
    an overhead of 13 ms, though the training thread had waited 40 ms a step for a CPU."""
    b = baseline(forward=30, backward=30, optimizer=15, other=13)
    f = Figures(shape(threads=2), b,
                contention=ContentionFigures(2.1, 4, 1.0, 0.0, 0.5, 40 * MS, 1, around(38.0), around(38.0, shift=1)))
    top = diagnose(f)[0]
    assert top.cause == "contention" and top.saving_seconds == pytest.approx(40 * MS) and top.changes == {}
    assert "run when the machine is free" in top.remedy


def test_overhead_prediction_by_hand():
    """Micro batch 1: forward+backward 1.0 ms a sample; at 8, 0.25 ms a sample (measured
    interleaved). The change keeps grad_accum 1, so a step carries 8x the tokens and pays the
    update, checkpoint and bookkeeping once for all 8."""
    f = Figures(shape(micro_batch=1, checkpoint_every_steps=5),
                baseline(data=0.2, forward=0.4, backward=0.6, optimizer=1.5, checkpoint=0.3, other=0.2),
                sweep=SweepFigures([SweepPoint(8, around(3.5), around(2.0), around(1.0, shift=4))], {1: 1, 8: 8}))
    top = diagnose(f)[0]
    assert top.cause == "overhead-bound" and top.changes == {"train.micro_batch": 8}
    # data 0.2 + forward/backward 1.0 x 0.25 + (1.5 + 0.3 + 0.2) / 8 = 0.7 ms per 1-sample step
    assert top.predicted_step_seconds == pytest.approx(0.7 * MS, rel=0.01)
    # its own saving leaves out the checkpoint's 0.3 ms amortised (that is the checkpoint's cause):
    # 1.0 x 0.75 + (1.5 + 0.2) x 7/8
    assert top.saving_seconds == pytest.approx(2.2375 * MS, rel=0.01)


def test_ranking_order_and_no_negative_share():
    # two causes whose savings overlap add up to more than the step: shares stay in [0, 1]
    f = Figures(shape(checkpoint_async=False, checkpoint_every_steps=1),
                baseline(data=20, forward=2, backward=2, optimizer=1, checkpoint=20, other=1),
                input=InputFigures(around(25.0), around(5.0), 20 * MS, 1000.0, 1000.0, 2),
                checkpoint=CheckpointFigures("off", 0, around(46.0), around(27.0), 20 * MS, 1 * MS, 1.0, 86400))
    found = diagnose(f)
    assert [x.cause for x in found] == ["input-bound", "checkpoint-bound", "compute-bound"]
    assert all(0 <= x.saving_share <= 1 for x in found)
    assert found[-1].saving_share == pytest.approx(5 / 46)
    assert all(x.saving_share >= THRESHOLD for x in found[:2])


def test_every_second_of_a_loop_iteration_is_in_a_phase():
    """Between two metrics rows: the row's phases (checkpoint included), the rest is "other"."""
    phases = {"data": 0.001, "h2d": 0.0, "forward": 0.004, "backward": 0.006, "sync": 0.0,
              "optimizer": 0.002, "checkpoint": 0.0}
    rows = [{"time": 100.0, "step_seconds": 0.013, "phases": phases},
            {"time": 100.020, "step_seconds": 0.013, "phases": phases},
            {"time": 100.185, "step_seconds": 0.013, "phases": {**phases, "checkpoint": 0.140}}]
    its = iterations(rows)
    assert [round(w, 6) for w, _, _ in its] == [0.02, 0.165]
    for wall, ph, _ in its:
        assert sum(ph.values()) == pytest.approx(wall)
    assert its[0][1]["other"] == pytest.approx(0.007) and its[1][1]["other"] == pytest.approx(0.012)


def test_a_checkpoint_as_often_as_young_daly_says_gets_no_interval_remedy():
    # a 20 s checkpoint against interruptions every hour: Daly says ~6 min; every 1000 steps of 0.5 s is longer
    f = Figures(shape(checkpoint_every_steps=1000), baseline(forward=200, backward=250, optimizer=30, checkpoint=20),
                checkpoint=CheckpointFigures("every", 8, around(480.0), around(3000.0), 20.0, 0.0, 1000.0, 3600))
    ck = by_cause(diagnose(f))["checkpoint-bound"]
    assert ck.saving_seconds == 0 and ck.changes == {}


def test_a_long_checkpoint_period_is_measured_once_a_stretch_and_amortised():
    # one checkpoint every 8 steps measured: +50 ms a step on average, so 400 ms a checkpoint;
    # the recipe's is every 100 steps: 4 ms a step
    f = Figures(shape(checkpoint_every_steps=100), baseline(forward=30, backward=40, optimizer=10, checkpoint=4),
                checkpoint=CheckpointFigures("every", 8, around(80.0, 0.01, 16),
                                             [80 * MS] * 7 * 2 + [480 * MS] * 2, 0.4, 0.0, 100.0, 86400))
    ck = by_cause(diagnose(f))["checkpoint-bound"]
    assert "4.00 ms per step" in ck.evidence[1]
    assert ck.changes["checkpoint.every_steps"] == 0


def test_a_prediction_counts_every_measured_effect_of_the_change():
    """No measurable synchronisation: communication saves nothing of its own, but its change
    (4x the accumulation) still makes 4x fewer optimizer steps, and the prediction says so."""
    f = Figures(shape(), baseline(data=0.5, forward=12, backward=18, optimizer=6, other=2),
                ddp=DdpFigures(2, "gloo", around(37.3, 0.04), around(37.6, 0.04, shift=4), around(4.0)))
    comm = by_cause(diagnose(f))["communication-bound"]
    assert comm.saving_seconds == 0
    assert comm.predicted_step_seconds == pytest.approx((38.5 - 8 * 3 / 4) * MS)


@pytest.mark.parametrize("bf16, named", [(1.24e12, True), (0.5e12, False)])
def test_a_cpu_that_multiplies_bf16_much_faster_is_named_in_the_compute_bound_finding(bf16, named):
    """An fp32 recipe on a CPU with AMX (bf16 matmuls measured 3.7x fp32's on this project's
    Xeon): the compute-bound finding says so, with both figures, and names [precision] bf16;
    a CPU whose bf16 is not at least BF16_FASTER times as fast is not told to switch."""
    from ember.doctor.diagnose import BF16_FASTER
    f = Figures(shape(), baseline(data=0.5, forward=12, backward=18, optimizer=6, other=0.5),
                cpu_peaks={"fp32": 0.334e12, "bf16": bf16})
    compute = by_cause(diagnose(f))["compute-bound"]
    said = [e for e in compute.evidence if "bf16 matmuls" in e]
    assert bool(said) == named == (bf16 >= BF16_FASTER * 0.334e12)
    assert ('mode = "bf16"' in compute.remedy) == named and compute.changes == {}
    if named:
        assert said == ["this CPU's bf16 matmuls measured 3.7x its fp32 ones (1.24 against 0.334 TFLOP/s, 1024x1024)"]
