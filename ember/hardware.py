"""The machine: its devices, cores and RAM. The one model the planner, the doctor, the scheduler
and the dashboard read (ember.device only turns a recipe's `train.device` into a torch device).

A device is an accelerator or the host's RAM, with its memory in bytes:

    kind   total                           free (to a new job)                      read by
    cuda   the device's memory             what the driver reports free             torch, or NVML
    xpu    the device's memory             mem_get_info, else total less reserved   torch
    mps    Metal's recommended working     that less what Metal holds, at most      torch
           set (unified memory)            the host RAM available
    npu    the device's memory             mem_get_info                              torch (torch_npu)
    cpu    MemTotal                        MemAvailable                              psutil
    sim    declared (EMBER_DEVICES=sim:2x8GiB): jobs train on the CPU, and admission, packing and
           preemption treat them as accelerators

How memory is decided from what a backend reports is pure (`mps_memory`, `xpu_memory`), so it is
tested on any machine. `detect()` reads the machine without torch (the service: simulated
devices, else NVML, else host RAM); `for_run()` asks torch for the devices a run would use,
first the one it uses first. A device's `name` and `kind` are what ember.metrics.peaks looks its
peak FLOP/s up by (the table for accelerators, a measured matmul for a CPU).
"""

from __future__ import annotations

import math
import os
import platform
import re
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from ember.errors import EmberError
from ember.paths import ascii_digits

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


class Kind(StrEnum):
    CUDA = "cuda"
    XPU = "xpu"
    MPS = "mps"
    NPU = "npu"
    CPU = "cpu"
    SIM = "sim"


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    kind: Kind
    total: int         # bytes
    free: int          # bytes a new job may use now
    foreign: int = 0   # bytes used by processes that are not ember's jobs (NVML; host RAM: all others)

    @property
    def accelerator(self) -> bool:
        """Whether jobs on it use an accelerator's memory rather than host RAM (sim counts)."""
        return self.kind != Kind.CPU

    def capped(self, free: int) -> Device:
        """The same device with `free` bytes in all (planning for another machine, or a cap)."""
        return replace(self, name=f"{self.name} (capped at {free / 2**30:.3g} GiB)", total=free, free=free)


@dataclass(frozen=True)
class Machine:
    devices: tuple[Device, ...]
    cores: int
    ram_total: int
    ram_available: int


def parse_size(text: str, where: str) -> int:
    """'8GiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise EmberError(f"{where}: {text!r} is not a size; write e.g. 8GiB or 500MB")
    size = float(m.group(1)) * UNITS[m.group(2).lower()]
    if size == math.inf:  # more digits than a float holds: int() of it raised OverflowError
        raise EmberError(f"{where}: {text!r} is too large a size; write e.g. 8GiB or 500MB")
    return int(size)


MAX_SIM_DEVICES = 1024  # declared devices of one kind: more is a typo (sim:80000x1GiB), not a machine


def parse_devices(spec: str) -> tuple[Device, ...]:
    """`sim:2x8GiB` or `sim:8GiB,4GiB` -> simulated devices."""
    where = f"devices {spec!r}"
    if not spec.startswith("sim:"):
        raise EmberError(f"{where}: only simulated devices can be declared (sim:2x8GiB); real "
                         f"accelerators are found through NVML")
    out: list[Device] = []
    for part in spec[4:].split(","):
        count, _, size = part.strip().rpartition("x") if "x" in part else ("1", "", part)
        count = count.strip()
        if not ascii_digits(count) or not 1 <= int(count) <= MAX_SIM_DEVICES:  # not "²"
            raise EmberError(f"{where}: {part!r}: write COUNTxSIZE, e.g. 2x8GiB (COUNT 1 to {MAX_SIM_DEVICES})")
        for _ in range(int(count)):
            n = parse_size(size, where)
            out.append(Device(len(out), f"sim:{len(out)}", Kind.SIM, n, n))
    return tuple(out)


# Pure: how each kind's memory is decided from what its backend reports.

def mps_memory(recommended: int, allocated: int, ram_available: int) -> tuple[int, int]:
    """(total, free) of an Apple GPU: Metal's recommended working set is the most it should hold;
    memory is unified, so what it may still take is also bounded by the host RAM available."""
    return recommended, max(0, min(recommended - allocated, ram_available))


def xpu_memory(total: int, reserved: int, info: tuple[int, int] | None) -> tuple[int, int]:
    """(total, free) of an Intel GPU: the driver's (free, total) where torch has mem_get_info,
    else the device's total less what this process's allocator holds."""
    if info is not None:
        free, total = info
        return total, free
    return total, max(0, total - reserved)


def memory_info() -> tuple[int, int]:
    """Host RAM total and available to a new process, in bytes (Linux: MemTotal, MemAvailable)."""
    import psutil
    vm = psutil.virtual_memory()
    return vm.total, vm.available


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else 'CPU'."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "CPU")
    except OSError:  # no /proc: macOS
        return platform.processor() or "CPU"


def may_have_accelerator() -> bool:
    """Whether `device = "auto"` could pick an accelerator here, known without importing torch:
    a driver's device nodes (NVIDIA, AMD, Intel, WSL), or macOS (MPS). Where it may, torch decides."""
    nodes = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg", "/dev/dri/renderD128")
    return platform.system() == "Darwin" or any(os.path.exists(n) for n in nodes)


def host_device() -> Device:
    """Host RAM as a device: total, and available (MemAvailable) to a new process."""
    total, available = memory_info()
    return Device(0, f"host RAM ({cpu_model()}, {os.cpu_count()} cores)", Kind.CPU, total, available,
                  total - available)


def nvml_devices(own_pids: set[int]) -> tuple[Device, ...] | None:
    """Accelerators through NVML, with the memory foreign processes use; None without NVML."""
    try:
        import pynvml  # nvidia-ml-py
        pynvml.nvmlInit()
    except Exception:  # not installed, or no driver: this machine has no NVIDIA accelerator to manage
        return None
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h) + pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
        foreign = sum(p.usedGpuMemory or 0 for p in procs if p.pid not in own_pids)
        name = pynvml.nvmlDeviceGetName(h)
        out.append(Device(i, name.decode() if isinstance(name, bytes) else name, Kind.CUDA, mem.total, mem.free,
                          foreign))
    return tuple(out)


def foreign_accelerator_pids(own_pids: set[int]) -> dict[int, list[int]]:
    """Per accelerator, the PIDs of processes on it that are not ember's jobs (empty without NVML)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return {}
    out = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h) + pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
        out[i] = [p.pid for p in procs if p.pid not in own_pids]
    return out


def detect(spec: str | None = None, own_pids: set[int] = frozenset()) -> Machine:
    """The machine now, without torch: declared simulated devices, else NVML's accelerators, else host RAM."""
    spec = spec or os.environ.get("EMBER_DEVICES") or None
    total, available = memory_info()
    devices = parse_devices(spec) if spec else nvml_devices(set(own_pids)) or (host_device(),)
    return Machine(devices, os.cpu_count() or 1, total, available)


def torch_devices(kind: Kind) -> list[Device]:
    """Every device of one accelerator kind, as torch sees it (torch is imported here)."""
    import torch
    module = torch.get_device_module(kind.value)
    if kind == Kind.MPS:
        total, free = mps_memory(module.recommended_max_memory(), module.driver_allocated_memory(), memory_info()[1])
        return [Device(0, "Apple GPU (mps)", kind, total, free)]
    out = []
    for i in range(module.device_count()):
        if kind == Kind.XPU:
            info = module.mem_get_info(i) if hasattr(module, "mem_get_info") else None
            total, free = xpu_memory(module.get_device_properties(i).total_memory, module.memory_reserved(i), info)
        else:  # cuda, npu: the driver's figures
            free, total = module.mem_get_info(i)
        out.append(Device(i, f"{module.get_device_name(i)} ({kind}:{i})", kind, total, free))
    return out


def for_run(requested: str) -> list[Device]:
    """The devices a run with `[train] device = requested` would use, the one it uses first at
    the front ('auto': the accelerator torch finds, as ember.device.pick_device decides)."""
    if requested == "cpu" or (requested == "auto" and not may_have_accelerator()):
        return [host_device()]  # torch-free: the supervisor of `ember run --restarts` plans here
    from ember.device import pick_device
    chosen = pick_device(requested)
    if chosen.type == "cpu":
        return [host_device()]
    try:
        kind = Kind(chosen.type)
    except ValueError:
        raise EmberError(f"[train] device = {requested!r}: ember cannot read the memory of {chosen.type} "
                         f"devices; plan with --device-memory, or use 'cpu'") from None
    devices = torch_devices(kind)
    first = chosen.index or 0
    return [d for d in devices if d.index == first] + [d for d in devices if d.index != first]


def name_of(device: Any) -> str:
    """A torch device's name as its driver reports it ('cpu' for the CPU), for the peak table."""
    if device.type == "cpu":
        return "cpu"
    import torch
    module = torch.get_device_module(device.type)
    try:
        return module.get_device_name(device.index or 0)
    except (AttributeError, RuntimeError):
        return device.type
