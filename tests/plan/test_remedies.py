"""The remedies that reach beyond one process: FSDP's figure is the registry's FSDP arithmetic
(the one the advisor prints) and its text says how ember applies it, on the devices this
machine has; CPU offload says what it saves where there is no accelerator; a distributed
launch is checked per rank with the same arithmetic."""

from __future__ import annotations

import pytest

from ember.errors import EmberError
from ember.hardware import Device, Kind
from ember.parallel.registry import STRATEGIES
from ember.parallel.strategy import Footprint
from ember.plan.advisor import advise
from ember.plan.memory import estimate
from ember.plan.planner import plan_memory, planned_devices
from ember.plan.remedies import train_shape
from ember.ranks import Topology
from ember.recipe import load_recipe
from tests.helpers import write_recipe
from tests.plan.test_parallel import net

# builtin:tiny, full fine-tuning, fp32, micro batch 4 x 128 tokens: tests/plan/test_memory.py::
# test_full_fp32_by_hand has its peak, 8,770,816 bytes at the loss's backward (no gradients yet),
# of which weights 125,376 x 4 and AdamW's moments 2 x 125,376 x 4.
PEAK, WEIGHTS, OPTIMIZER, LAYER = 8_770_816, 125_376 * 4, 2 * 125_376 * 4, (46_080 + 2 * 64) * 4
# FSDP over 2 ranks: half of weights + gradients + optimizer state, and two layers gathered at once.
FSDP_2 = PEAK - (WEIGHTS + OPTIMIZER) // 2 + 2 * LAYER
FREE = 9_400_000  # with the 10% margin: the FSDP rank fits (9.23 MB), one process does not (9.65 MB)


def gpus(n: int, free: int = FREE) -> list[Device]:
    return [Device(i, f"gpu{i}", Kind.CUDA, free, free) for i in range(n)]


def host(free: int = FREE) -> list[Device]:
    return [Device(0, "host RAM", Kind.CPU, free, free)]


@pytest.fixture
def recipe(tmp_path):
    return load_recipe(write_recipe(tmp_path, data={"seq_len": 128}))


def named(plan, name):
    return next(x for x in plan.remedies if x.name == name)


def test_fsdp_remedy_is_the_registrys_fsdp_arithmetic_for_two_ranks(recipe):
    plan = plan_memory(recipe, None, gpus(2))
    assert plan.memory.peak == PEAK and not plan.fits
    fsdp = named(plan, "FSDP across 2 devices")
    assert FSDP_2 == 8_388_224
    assert fsdp.peak == FSDP_2
    fp = Footprint(peak=PEAK, state=WEIGHTS + OPTIMIZER, activations=plan.memory.activations, weights=WEIGHTS,
                   grads=WEIGHTS, layer=LAYER, layer_share=0.9)
    assert fsdp.peak == int(STRATEGIES["fsdp"].memory(fp, 2))
    # the figure the advisor prints for fsdp on 2 devices
    m, t = plan.model, train_shape(recipe)
    advice = advise(m, t, estimate(m, t), 1, 1.0, net(1e9), FREE, counts=(1, 2))
    assert fsdp.peak == next(o for o in advice.options if o.strategy == "fsdp" and o.devices == 2).memory_bytes
    # two accelerators here: ember applies it, with the recipe change and the launch that starts the ranks
    assert fsdp.available and fsdp.fits
    assert fsdp.changes == {"distributed.strategy": "fsdp"} and fsdp.launch == "--nproc 2"
    assert "--nproc 2" in fsdp.how and 'strategy = "fsdp"' in fsdp.how
    assert "does not do" not in fsdp.how and "remote compute" not in fsdp.how
    # it is never part of the one-process combination
    assert all("distributed.strategy" not in x.changes for x in plan.remedies if x.name == "combined")


def test_fsdp_without_two_accelerators_is_listed_for_two_machines_not_applied_here(recipe):
    one_gpu = named(plan_memory(recipe, None, gpus(1)), "FSDP across 2 devices")
    assert one_gpu.peak == FSDP_2 and not one_gpu.available and one_gpu.fits
    assert "this machine has 1 cuda device" in one_gpu.how and "--nnodes 2" in one_gpu.launch
    cpu = named(plan_memory(recipe, None, host()), "FSDP across 2 devices")
    assert cpu.peak == FSDP_2 and not cpu.available and cpu.fits  # on each of two machines like this one
    # two CPU ranks here share the host RAM: together they hold more than one process
    assert "no accelerator" in cpu.how and "2 x 8.0 MiB = 16.0 MiB" in cpu.how and "--nnodes 2" in cpu.how
    assert "does not do" not in cpu.how


def test_cpu_offload_saves_nothing_without_an_accelerator(recipe):
    on_host = named(plan_memory(recipe, None, host()), "CPU offload of the optimizer state")
    assert on_host.peak == PEAK and not on_host.available and "saves nothing" in on_host.how
    on_gpu = named(plan_memory(recipe, None, gpus(1)), "CPU offload of the optimizer state")
    assert on_gpu.peak == PEAK - OPTIMIZER and not on_gpu.available


def test_a_distributed_launch_is_checked_per_rank_with_the_strategys_arithmetic(tmp_path):
    from ember.launch import check_ranks
    fsdp = load_recipe(write_recipe(tmp_path / "f", data={"seq_len": 128}, distributed={"strategy": "fsdp"}))
    planned = check_ranks(fsdp, plan_memory(fsdp, None, gpus(2)), Topology(nproc=2))
    assert planned.fits and planned.peak == int(FSDP_2 * 1.1)
    ddp = load_recipe(write_recipe(tmp_path / "d", data={"seq_len": 128}))  # a whole replica per rank
    with pytest.raises(EmberError, match="per rank under \\[distributed\\] strategy = 'ddp'"):
        check_ranks(ddp, plan_memory(ddp, None, gpus(2)), Topology(nproc=2))
    with pytest.raises(EmberError, match="--nproc 2: each rank takes one cuda device and this machine has 1"):
        check_ranks(fsdp, plan_memory(fsdp, None, gpus(1)), Topology(nproc=2))
    assert plan_memory(fsdp, None, host(14_000_000)).fits  # one process fits there, two CPU ranks do not
    with pytest.raises(EmberError, match="2 ranks sharing host RAM"):
        check_ranks(fsdp, plan_memory(fsdp, None, host(14_000_000)), Topology(nproc=2))


@pytest.mark.parametrize("gib", [float("nan"), float("inf"), 0.0, -1.0])
def test_device_memory_that_is_not_a_finite_positive_number_is_refused(tmp_path, gib):
    """`ember plan --device-memory nan` (or inf) once ended in int()'s ValueError (OverflowError)."""
    r = load_recipe(write_recipe(tmp_path))
    with pytest.raises(EmberError, match=rf"--device-memory {gib:g}: must be a finite number of GiB > 0"):
        planned_devices(r, gib)


@pytest.mark.parametrize("rdzv", ["node0:²", "node0:99999", "node0:0", "node0:٣٣"])
def test_a_rendezvous_port_that_is_no_port_is_refused_before_torchrun(rdzv):
    """--rdzv node0:² passed str.isdigit and reached torchrun's rendezvous, whose int() raised
    there; 99999 and 0 are no TCP port either."""
    with pytest.raises(EmberError, match=r"--rdzv .*: give node 0's address as HOST:PORT"):
        Topology(nproc=1, nnodes=2, node_rank=0, rdzv=rdzv).check()


def test_a_micro_batch_of_two_to_the_forty_is_planned_without_counting_to_it(tmp_path):
    """[train] micro_batch = 2^40: `ember plan`, and `ember run`'s check before launch, tried every
    number below it as the gradient accumulation remedy's micro batch, and never finished."""
    r = load_recipe(write_recipe(tmp_path), ["train.micro_batch=1099511627776"])
    plan = plan_memory(r, None, host())
    accumulate = named(plan, "gradient accumulation")  # the largest micro batch that fits FREE
    assert not plan.fits and accumulate.fits
    assert accumulate.changes == {"train.micro_batch": 8, "train.grad_accum": 2**37}
