"""What the service packs jobs onto: this machine's devices, cores and RAM, read without torch.

Accelerators come from NVML (`nvidia-ml-py`, where installed): index, name, total and free
memory, and the processes on each. With none, the machine's one device is its host RAM
("cpu"). For tests and rehearsals, `EMBER_DEVICES` (or `ember serve --devices`) declares
simulated devices instead: `sim:2x8GiB` is two devices of 8 GiB each; jobs placed on them
train on the CPU, and admission, packing and preemption treat them as accelerators.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ember.errors import EmberError

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    kind: str          # "cuda", "sim" or "cpu"
    total: int         # bytes
    foreign: int = 0   # bytes used by processes that are not ember's jobs (NVML)


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
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_devices(spec: str) -> tuple[Device, ...]:
    """`sim:2x8GiB` or `sim:8GiB,4GiB` -> simulated devices."""
    where = f"devices {spec!r}"
    if not spec.startswith("sim:"):
        raise EmberError(f"{where}: only simulated devices can be declared (sim:2x8GiB); real "
                         f"accelerators are found through NVML")
    out: list[Device] = []
    for part in spec[4:].split(","):
        count, _, size = part.strip().rpartition("x") if "x" in part else ("1", "", part)
        if not count.strip().isdigit() or int(count) < 1:
            raise EmberError(f"{where}: {part!r}: write COUNTxSIZE, e.g. 2x8GiB")
        for _ in range(int(count)):
            out.append(Device(len(out), f"sim:{len(out)}", "sim", parse_size(size, where)))
    return tuple(out)


def memory_info() -> tuple[int, int]:
    """Host RAM total and available, in bytes (/proc/meminfo)."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"], info["MemAvailable"]


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
        out.append(Device(i, name.decode() if isinstance(name, bytes) else name, "cuda", mem.total, foreign))
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
    """The machine now: declared simulated devices, else NVML's accelerators, else host RAM."""
    spec = spec or os.environ.get("EMBER_DEVICES") or None
    total, available = memory_info()
    if spec:
        devices = parse_devices(spec)
    else:
        devices = nvml_devices(set(own_pids)) or (Device(0, "host RAM", "cpu", total, total - available),)
    return Machine(devices, os.cpu_count() or 1, total, available)
