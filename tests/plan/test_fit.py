"""`ember plan --fit MEM` (ember/plan/fit.py): the pick fits by the plan's own numbers and nothing
that fits is predicted faster; the effective batch is held; the sequence is kept unless allowed;
an impossible budget says what the smallest peak was; the printed --set lines, applied to the
recipe, plan to the printed peak and step time."""

from __future__ import annotations

import json
import math

import pytest

from ember.errors import EmberError
from ember.hardware import Device, Kind
from ember.metrics.peaks import Peak
from ember.models import config_fields
from ember.plan.fit import NothingFits, budget_bytes, candidates, peak_between, search, space
from ember.plan.memory import ModelShape
from ember.plan.planner import make_plan, plan_memory
from ember.plan.remedies import fits
from ember.recipe import load_recipe
from tests.helpers import measured_peak, run_ember, write_recipe

PEAK = Peak(1e12, "test: 1 TFLOP/s")
BUDGET = 2_000_000  # builtin:tiny, micro batch 4 x accum 2 x seq 32: 3.2 MiB as written; some fit, some not


@pytest.fixture
def path(tmp_path):
    return write_recipe(tmp_path, train={"micro_batch": 4, "grad_accum": 2}, cost={"peak_tflops": 1.0})


@pytest.fixture
def tiny():
    return ModelShape.from_config(config_fields("builtin:tiny"))


def test_the_pick_fits_by_the_plans_numbers_and_nothing_that_fits_is_predicted_faster(path, tiny):
    r, budget = load_recipe(path), 1_000_000  # only adapters with checkpointing, micro batch 1, fit
    found = candidates(r, tiny, budget, PEAK)
    assert any(c.fits for c in found) and not all(c.fits for c in found)  # the budget decides something
    pick = search(r, tiny, budget, PEAK).best[0]
    assert pick.fits and fits(pick.peak, budget, r.plan.memory_margin) and pick.with_margin <= budget
    assert all(c.step_seconds >= pick.step_seconds for c in found if c.fits)
    assert any(c.step_seconds < pick.step_seconds for c in found if not c.fits)  # faster ones exist, too big
    assert pick.changes  # as written it does not fit


def test_the_effective_batch_is_held_over_every_split(path, tiny):
    r = load_recipe(path)
    found = candidates(r, tiny, BUDGET, PEAK)
    assert {c.micro_batch * c.grad_accum for c in found} == {8}
    assert {(c.micro_batch, c.grad_accum) for c in found} == {(1, 8), (2, 4), (4, 2), (8, 1)}


def test_the_sequence_is_kept_unless_allowed(path, tiny):
    r = load_recipe(path)
    kept = candidates(r, tiny, BUDGET, PEAK)
    assert {c.seq_len for c in kept} == {32} and not any("data.seq_len" in c.changes for c in kept)
    small = 900_000  # nothing fits at seq 32 (930,124 bytes at the least, with margin); something at 16
    with pytest.raises(NothingFits):
        search(r, tiny, small, PEAK)
    allowed = search(r, tiny, small, PEAK, allow_seq=True)
    assert {c.seq_len for c in allowed.best} == {16} and allowed.best[0].changes["data.seq_len"] == 16
    assert {c.micro_batch * c.grad_accum for c in allowed.best} == {8}


def test_an_impossible_budget_names_the_smallest_peak_and_what_to_try(path, tiny):
    r = load_recipe(path)
    smallest = min(candidates(r, tiny, 1000, PEAK), key=lambda c: c.peak)
    with pytest.raises(NothingFits) as e:
        search(r, tiny, 1000, PEAK)
    text = str(e.value)
    assert f"smallest predicted peak of the {len(candidates(r, tiny, 1000, PEAK))} configurations" in text
    assert f"{smallest.peak / 2**20:.1f} MiB" in text and smallest.describe() in text
    assert "--fit-seq" in text and "a budget of at least" in text


def test_the_printed_set_lines_plan_to_the_printed_peak_and_time(path, tiny):
    r = load_recipe(path)
    fit = search(r, tiny, BUDGET, PEAK)
    assert len(fit.best) >= 3
    device = [Device(0, "test", Kind.CUDA, 80 * 2**30, 80 * 2**30)]  # peak_tflops: the time needs no table
    for c in fit.best:
        again = load_recipe(path, c.overrides())
        assert plan_memory(again, None, device).memory.peak == c.peak
        assert again.train.micro_batch * again.train.grad_accum == 8
        planned = make_plan(again, None, None, device).time.step_seconds
        assert math.isclose(planned * 1e12 / PEAK.flops, c.step_seconds, rel_tol=1e-12)


def test_plan_time_counts_activation_checkpointings_recomputation(path):
    """The time `ember plan` predicts (and --fit ranks by) includes the second forward that
    activation checkpointing costs: the remedy's own compute factor."""
    device = [Device(0, "test", Kind.CUDA, 2**20, 2**20)]  # too small: the remedies are listed
    off = make_plan(load_recipe(path), None, None, device)
    on = make_plan(load_recipe(path, ["train.activation_checkpointing=true"]), None, None, device)
    factor = next(x.flops_factor for x in off.remedies if x.name == "activation checkpointing")
    assert factor > 1.1
    assert math.isclose(on.time.step_seconds, off.time.step_seconds * factor, rel_tol=1e-9)


def test_int8_state_that_buys_nothing_is_not_listed(path, tiny):
    """LoRA adapters of the tiny model are all under the 8-bit threshold: int8 state changes a
    setting and saves nothing there, so no listed LoRA configuration carries it; full fine-tuning's
    large tensors do save, and int8 is listed where it buys a larger micro batch."""
    r = load_recipe(path)
    found = candidates(r, tiny, BUDGET, PEAK)
    same = [(c, next(d for d in found if d.state_dtype == "fp32" and d.changes == {
        k: v for k, v in c.changes.items() if k != "optimizer.state_dtype"})) for c in found
        if c.method == "lora" and c.state_dtype == "int8"]
    assert same and all(c.peak == d.peak and c.fits == d.fits for c, d in same) and any(c.fits for c, _ in same)
    best = search(r, tiny, BUDGET, PEAK).best
    assert not any(c.method == "lora" and c.state_dtype == "int8" for c in best)
    full8 = next(c for c in best if c.method == "full")
    assert full8.state_dtype == "int8" and not any(
        c.fits and c.method == "full" and c.state_dtype == "fp32" and c.micro_batch >= full8.micro_batch for c in found)


def test_ember_plan_fit_prints_the_pick_as_set_lines(path):
    done = run_ember("plan", path, "--fit", "2MB")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("1. fastest that fits: "))
    assert "MiB peak" in lines[first] and "s/step predicted" in lines[first]
    assert lines[first + 1].strip().startswith("--set ")
    as_json = run_ember("plan", path, "--fit", "2MB", "--json")
    got = json.loads(as_json.stdout)
    assert got["budget"] == BUDGET and got["best"][0]["overrides"] == [
        x.removeprefix("--set ") for x in lines[first + 1].strip().split(" --set ")]
    never = run_ember("plan", path, "--fit", "1kB")
    assert never.returncode == 1 and "nothing fits" in never.stderr and "Traceback" not in never.stderr
    unitless = run_ember("plan", path, "--fit", "8")
    assert unitless.returncode == 2 and "give a unit" in unitless.stderr


# A family without formulas (issue 30: --fit searches it by its traced steps)

@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """A one-layer GPT-NeoX model (a trace's time is its number of ops: one layer keeps it short)."""
    import torch
    import transformers as tf

    from ember.train.model import ByteTokenizer
    folder = tmp_path_factory.mktemp("families") / "gpt_neox"
    torch.manual_seed(0)
    tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=1,
                                           num_attention_heads=4, vocab_size=1000,
                                           max_position_embeddings=512)).save_pretrained(folder)
    ByteTokenizer().save(folder)
    return folder


def test_a_peak_derived_from_micro_batches_1_and_2_is_the_traced_one(tmp_path, neox):
    """peak_between: the step at micro batch 5 from its traces at 1 and 2, to the byte;
    none where the steps differ (a chunked loss has more chunks at a larger batch)."""
    from ember.doctor.fake_step import trace
    path = write_recipe(tmp_path, model={"path": str(neox)}, data={"seq_len": 32}, train={"grad_accum": 2})
    extra = ["method.kind=lora", "train.activation_checkpointing=true"]
    at = {mb: trace(load_recipe(path, [*extra, f"train.micro_batch={mb}"])) for mb in (1, 2, 5)}
    assert at[1].peak_bytes < at[2].peak_bytes < at[5].peak_bytes  # the batch decides something
    assert peak_between(at[1], at[2], 5) == at[5].peak_bytes
    chunked = [trace(load_recipe(path, ["train.loss_chunk=32", f"train.micro_batch={mb}"])) for mb in (1, 2)]
    assert peak_between(*chunked, 3) is None


def test_a_family_without_formulas_gets_a_fit_whose_pick_fits_when_measured(tmp_path, neox):
    """--fit on GPT-NeoX (no formulas: before, it refused): every configuration traced or derived,
    the pick the fastest predicted that fits, and its step run for real peaks within the budget."""
    from ember.doctor.traced import traced_step
    from ember.plan.fit import FitRequest, fit_recipe
    path = write_recipe(tmp_path, model={"path": str(neox)}, data={"seq_len": 32},
                        train={"micro_batch": 1, "grad_accum": 1}, cost={"peak_tflops": 1.0})
    budget = 2_500_000  # full: 8.4 MB with the margin (5.7 MB with int8 state); LoRA rank 4: 2.6 MB, 2.4 MB with
    fit = fit_recipe(FitRequest(path, [], "2.5MB"), None, traced_step)  # activation checkpointing
    pick = fit.best[0]
    assert not fit.as_written.fits and 0 < fit.fitting < fit.searched
    assert pick.fits and pick.with_margin <= budget and (pick.method, pick.rank) == ("lora", 4)
    assert pick.activation_checkpointing and all(c.step_seconds >= pick.step_seconds for c in fit.best)
    assert any("steps traced" in n for n in fit.notes) and not any("QLoRA not searched" in n for n in fit.notes)
    # QLoRA searched too (its 4-bit calls counted in the trace, priced): slower than LoRA of its rank
    qlora, lora = ({c.rank: c for c in fit.best if c.method == m} for m in ("qlora", "lora"))
    assert qlora and all(qlora[k].step_seconds > lora[k].step_seconds for k in set(qlora) & set(lora))
    measured = measured_peak(load_recipe(path, pick.overrides()))
    assert measured <= budget and abs(pick.peak / measured - 1) <= 0.005, (pick.peak, measured)


def test_a_family_without_formulas_gets_qlora_where_only_a_4_bit_base_fits(tmp_path, neox):
    """--fit on GPT-NeoX at a budget LoRA does not fit: the pick is QLoRA, its step traced with the
    4-bit base on fake tensors (before, a 4-bit base could not be traced and QLoRA was not
    searched: nothing fitted), and run for real it peaks within the budget and 0.5% of the plan."""
    from ember.doctor.traced import traced_step
    from ember.plan.fit import FitRequest, fit_recipe
    path = write_recipe(tmp_path, model={"path": str(neox)}, data={"seq_len": 32},
                        train={"micro_batch": 1, "grad_accum": 1}, cost={"peak_tflops": 1.0})
    budget = 2_200_000  # LoRA rank 4 with activation checkpointing: 2.37 MB with the margin; QLoRA rank 4: 2.03 MB
    fit = fit_recipe(FitRequest(path, [], "2.2MB"), None, traced_step)
    pick = fit.best[0]
    assert {c.method for c in fit.best} == {"qlora"}
    assert pick.fits and pick.with_margin <= budget and pick.rank == 4
    assert pick.changes["method.quantize"] == "nf4" and pick.changes["method.kind"] == "lora"
    measured = measured_peak(load_recipe(path, pick.overrides()))
    assert measured <= budget and abs(pick.peak / measured - 1) <= 0.005, (pick.peak, measured)


def test_a_budget_of_other_digits_is_no_size_and_not_told_to_add_a_unit():
    """`--fit ²` passed str.isdigit and was told "give a unit, e.g. --fit ²GiB", which is no size
    either: the hint sent the user to a second refusal."""
    with pytest.raises(EmberError) as refused:
        budget_bytes("²", [])
    assert "'²' is not a size; write e.g. 8GiB" in str(refused.value) and "²GiB" not in str(refused.value)


def test_a_batch_of_two_to_the_forty_rows_is_split_by_its_divisors_without_counting_to_it(path):
    """`ember plan --fit` with [train] grad_accum = 2^40 tried every number up to 2^40 as a micro
    batch (`n % d == 0` for each): it never finished."""
    r = load_recipe(path, ["train.micro_batch=1", "train.grad_accum=1099511627776"])
    assert space(r)["micro_batch"] == [2**k for k in range(41)]
    from ember.plan.remedies import divisors  # the one divisor search, shared with the remedies
    assert divisors(10**12) == sorted({2**a * 5**b for a in range(13) for b in range(13)})  # all 169
    assert divisors(2**61 - 1) == [1, 2**61 - 1]  # a prime
