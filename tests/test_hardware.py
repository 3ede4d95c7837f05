"""The machine model (ember.hardware): how each kind of device's memory is decided, from hand-made
backend readings (no GPU here), and what this CPU machine looks like to the planner and the
scheduler alike."""

from __future__ import annotations

import pytest

from ember.errors import EmberError
from ember.hardware import Device, Kind, detect, for_run, mps_memory, parse_devices, xpu_memory

GiB = 2**30


def test_an_mps_device_has_metals_working_set_bounded_by_free_host_ram():
    """MPS was planned against host RAM (plan/devices.py knew only CUDA): its memory is Metal's
    recommended working set, less what Metal holds, never more than the host RAM available."""
    assert mps_memory(16 * GiB, 2 * GiB, 64 * GiB) == (16 * GiB, 14 * GiB)
    assert mps_memory(16 * GiB, 2 * GiB, 10 * GiB) == (16 * GiB, 10 * GiB)  # unified memory: the host is short
    assert mps_memory(16 * GiB, 17 * GiB, 64 * GiB) == (16 * GiB, 0)


def test_an_xpu_device_has_the_drivers_figures_else_total_less_reserved():
    assert xpu_memory(24 * GiB, 1 * GiB, (20 * GiB, 24 * GiB)) == (24 * GiB, 20 * GiB)
    assert xpu_memory(24 * GiB, 1 * GiB, None) == (24 * GiB, 23 * GiB)


def test_devices_say_their_kind_and_can_be_capped():
    d = Device(1, "Apple GPU (mps)", Kind.MPS, 16 * GiB, 14 * GiB)
    assert d.accelerator and d.kind == "mps"
    c = d.capped(4 * GiB)
    assert (c.kind, c.total, c.free, c.index) == (Kind.MPS, 4 * GiB, 4 * GiB, 1) and "capped at 4 GiB" in c.name
    assert [x.total for x in parse_devices("sim:2x8GiB,1GiB")] == [8 * GiB, 8 * GiB, GiB]
    assert all(x.kind == Kind.SIM and x.accelerator for x in parse_devices("sim:2x8GiB"))


def test_this_cpu_machine_is_host_ram_for_the_scheduler_and_the_planner(monkeypatch):
    monkeypatch.delenv("EMBER_DEVICES", raising=False)
    m = detect()
    (host,) = m.devices
    assert host.kind == Kind.CPU and not host.accelerator and host.total == m.ram_total
    assert 0 < host.free <= host.total and host.foreign == host.total - host.free
    (planned,) = for_run("auto")  # no accelerator here: the planner sees the same host RAM
    assert (planned.kind, planned.total) == (Kind.CPU, m.ram_total)
    assert for_run("cpu")[0].kind == Kind.CPU
    with pytest.raises(EmberError, match="no such device is available here"):
        for_run("cuda:1")


@pytest.mark.parametrize("spec", ["sim:²x8GiB", "sim:80000000x1GiB", "sim:0x8GiB"])
def test_a_declared_count_that_is_no_count_is_refused_by_name(spec):
    """EMBER_DEVICES=sim:²x8GiB passed str.isdigit and int() raised a ValueError traceback;
    sim:80000000x1GiB built eighty million devices (minutes, gigabytes) before anything ran."""
    with pytest.raises(EmberError, match=r"write COUNTxSIZE, e\.g\. 2x8GiB \(COUNT 1 to 1024\)"):
        parse_devices(spec)


@pytest.mark.parametrize("where", ["devices", "fit"])
def test_a_size_with_more_digits_than_a_float_holds_is_refused_by_name(where):
    """EMBER_DEVICES=sim:1x111...1GiB and `ember plan --fit 111...1GiB` (400 digits) ended in
    OverflowError: cannot convert float infinity to integer, a traceback."""
    from ember.plan.fit import budget_bytes
    huge = "1" * 400 + "GiB"
    with pytest.raises(EmberError, match="is too large a size; write e.g. 8GiB"):
        parse_devices(f"sim:1x{huge}") if where == "devices" else budget_bytes(huge, [])
