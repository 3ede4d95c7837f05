"""The doctor's experiments on a machine slower than their estimates: rounds that did not fit
leave no figures behind (a figure with no samples crashed the ranking: CI, a busy machine).
And their protocol: the stop condition (time, or a tight enough interval), the budget's shares."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from ember.data.loader import MicroBatch
from ember.doctor.diagnose import Difference, Shape
from ember.doctor.experiments import contention, sweep
from ember.doctor.experiments.budget import SETTLE_ROUNDS, Budget, Stop
from ember.doctor.experiments.protocol import Experiment, Lab, Result, interleave
from ember.doctor.experiments.runner import AFTER_BASELINE
from ember.errors import EmberError
from ember.events import Events
from ember.recipe import load_recipe
from tests.helpers import write_recipe


@dataclasses.dataclass
class FakeJob:
    recipe: object


SHAPE = Shape(micro_batch=4, grad_accum=1, seq_len=32, workers=0, threads=2, cores=2, checkpoint_async=True,
              checkpoint_every_steps=5, checkpoint_every_seconds=0.0)


def starve(monkeypatch) -> None:
    """Every interleaved comparison ends before its first round (the budget ran out)."""
    for module in (contention, sweep):
        monkeypatch.setattr(module, "interleave", lambda arms, stop, **kw: [[] for _ in arms])
        monkeypatch.setattr(module, "timed_step",
                            lambda job, data: lambda: (0.01, {"h2d": 0.0, "forward": 0.004, "backward": 0.006}))


def lab(r, cpu=None, batch=None, step=0.001) -> Lab:
    return Lab(FakeJob(r), r, SHAPE, step, batch, cpu or {}, Events(), 0.0)


def budget(name: str, seconds: float = 60) -> Budget:
    b = Budget(seconds, time.monotonic(), 0.0, 0.0)
    b.pending = [name]
    return b


def test_interleave_keeps_nothing_when_no_round_fits():
    calls = []
    out = interleave([(lambda: calls.append(1), 1, 0)], Stop(time.monotonic() + 0.05), first_round=1.0)
    assert out == [[]] and calls == []


def test_a_sweep_size_that_got_no_rounds_is_skipped_not_kept(monkeypatch, tmp_path):
    starve(monkeypatch)
    r = load_recipe(write_recipe(tmp_path, train={"micro_batch": 2}))
    monkeypatch.setattr(sweep, "fitting_micro_batches", lambda r: {2: 1, 4: 1, 8: 1})
    got = sweep.Sweep(lab(r, batch=MicroBatch(torch.zeros(2, 32, dtype=torch.long))), None).run(budget("sweep"))
    assert "sweep" not in got.figures
    assert [s.experiment for s in got.skipped] == ["sweep", "sweep"]
    assert "only 0 rounds fitted" in got.skipped[0].reason


def test_fewer_threads_that_got_no_rounds_are_skipped_not_kept(monkeypatch, tmp_path):
    starve(monkeypatch)
    r = load_recipe(write_recipe(tmp_path))
    cpu = {"load": 2.0, "runnable": 3, "others": 1.0, "steal": 0.0, "wait_share": 0.4, "main_wait_share": 0.4}
    found = SimpleNamespace(baseline=SimpleNamespace(step_seconds=0.01))  # the real loop's step
    got = contention.Contention(lab(r, cpu), found).run(budget("contention"))
    c = got.figures["contention"]
    assert c.fewer_threads is None and c.at_threads == []
    assert got.skipped and "only 0 rounds fitted" in got.skipped[-1].reason


def test_interleave_stops_once_the_effect_is_settled():
    """Both sides every round; the effect's interval is tight from SETTLE_ROUNDS rounds on (the
    same 10 ms difference each round): it stops there, long before its 50 rounds or its time."""
    a, b = iter(range(10**6)), iter(range(10**6))
    arms = [(lambda: 0.03 + next(a) * 1e-6, 1, 0), (lambda: 0.02 + next(b) * 1e-6, 1, 0)]
    stop = Stop(time.monotonic() + 600, tolerance=0.001)

    def effect(out):
        return Difference(0.01, 0.0099, 0.0101) if len(out[0]) >= 3 else Difference(0.0, -1.0, 1.0)
    out = interleave(arms, stop, rounds=50, effect=effect)
    assert len(out[0]) == len(out[1]) == SETTLE_ROUNDS
    # an interval wider than the tolerance never stops it before its rounds
    wide = interleave(arms, Stop(time.monotonic() + 600, tolerance=0.001), rounds=9,
                      effect=lambda out: Difference(0.01, 0.0, 0.02))
    assert len(wide[0]) == 9


def test_the_stop_condition_by_hand():
    stop = Stop(time.monotonic() + 100, tolerance=0.004)
    assert stop.fits(50) and not stop.fits(200) and 99 < stop.left() <= 100
    assert stop.settled(Difference(0.05, 0.049, 0.052), SETTLE_ROUNDS)       # 3 ms wide: known
    assert not stop.settled(Difference(0.05, 0.049, 0.052), SETTLE_ROUNDS - 1)  # too few rounds
    assert not stop.settled(Difference(0.05, 0.04, 0.06), 100)                # 20 ms wide
    assert not Stop(time.monotonic() + 100).settled(Difference(0.0, 0.0, 0.0), 100)  # no tolerance: time only
    assert Stop(time.monotonic() - 1).left() == 0.0


def test_budget_shares_what_is_left_among_the_pending():
    b = Budget(100, time.monotonic(), reserve=10, startup=0.0)
    b.pending = ["input", "sweep", "profile"]  # shares 0.10, 0.15, 0.05 of 0.30
    assert b.share(["sweep"]) == pytest.approx(90 * 0.15 / 0.30, abs=0.1)
    b.done("input")  # 0.15 of 0.20 now
    assert b.share(["sweep"]) == pytest.approx(90 * 0.15 / 0.20, abs=0.1)
    assert b.stop("sweep", 0.01).tolerance == 0.01


def test_every_experiment_after_the_baseline_follows_the_protocol(tmp_path):
    r = load_recipe(write_recipe(tmp_path))
    made = [make(lab(r), None) for make in AFTER_BASELINE]
    assert [e.name for e in made] == ["contention", "input", "sweep", "loader", "profile"]
    for e in made:
        assert isinstance(e, Experiment) and isinstance(e.changes, str) and e.changes
    assert Result("x").skip("why").skipped[0].experiment == "x"



def test_the_bf16_peak_is_measured_for_an_fp32_cpu_recipe_within_the_budget(tmp_path, monkeypatch):
    """Both matmul peaks for an fp32 recipe on a CPU; nothing for a bf16 recipe or another device;
    and, with less of the budget left than their first measurement may take, a skip saying so
    instead of a measurement that could run past --budget."""
    from ember.doctor.experiments.runner import PEAKS_SECONDS, _cpu_peaks
    from ember.metrics import peaks
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    timed = []
    real = peaks.time_matmul
    monkeypatch.setattr(peaks, "time_matmul", lambda threads, size, rounds, dtype: timed.append(dtype) or
                        real(threads, 64, 1, dtype))
    fp32, cpu = load_recipe(write_recipe(tmp_path)), torch.device("cpu")
    plenty = Budget(60.0, time.monotonic(), 0.0, 0.0)
    skipped = []
    got = _cpu_peaks(fp32, cpu, 1, plenty, skipped)
    assert set(got) == {"fp32", "bf16"} and min(got.values()) > 0 and timed == ["fp32", "bf16"] and not skipped
    bf16 = load_recipe(write_recipe(tmp_path / "b", precision={"mode": "bf16"}))
    assert _cpu_peaks(bf16, cpu, 1, plenty, skipped) == {}
    assert _cpu_peaks(fp32, torch.device("meta"), 1, plenty, skipped) == {}
    short = Budget(PEAKS_SECONDS / 2, time.monotonic(), 0.0, 0.0)
    assert _cpu_peaks(fp32, cpu, 1, short, skipped) == {} and timed == ["fp32", "bf16"]
    assert [s.experiment for s in skipped] == ["precision"] and "s left" in skipped[0].reason


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_budget_that_is_not_a_finite_positive_number_is_refused_before_anything_runs(tmp_path, budget):
    """`--budget nan` once ran and reported it "used up while loading the model"; `--budget inf`
    ended in setitimer's OverflowError."""
    from ember.doctor.examine import examine
    with pytest.raises(EmberError, match=rf"--budget {budget:g}: must be a finite number of seconds > 0"):
        examine(write_recipe(tmp_path), budget, 1, [], None, Events())


def test_a_deadline_years_away_sets_an_alarm_the_platform_accepts():
    """A large finite --budget (1e12 s) puts the deadline past what setitimer takes."""
    from ember.doctor.experiments.budget import hard_deadline
    budget = Budget(1e12, time.monotonic(), 0.0, 0.0)
    with hard_deadline(budget.deadline, "loading the model", budget):
        pass


def test_a_plots_folder_that_cannot_be_made_is_refused_before_anything_runs(tmp_path):
    """`ember doctor RECIPE --plots FILE` ran every experiment for its --budget, then ended in
    "[Errno 17] File exists" from the plot's mkdir, the report unprinted."""
    from ember.doctor.examine import examine
    taken = tmp_path / "plots.png"
    taken.write_text("")
    with pytest.raises(EmberError, match=r"--plots .*plots\.png: not a folder ember can write doctor\.png into"):
        examine(write_recipe(tmp_path), 60.0, 1, [], None, Events(), taken)
