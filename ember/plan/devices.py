"""The devices a plan is for: each accelerator's memory, or host RAM on a CPU machine."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ember.errors import EmberError
from ember.plan.memory import GiB


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cpu" or an accelerator type
    total: int
    free: int


def detect_devices(requested: str) -> list[Device]:
    """The devices a run of this recipe would use: each accelerator's memory, or host RAM. Torch
    is imported only where an accelerator may be used: on a CPU machine planning stays torch-free
    (the supervisor of `ember run --restarts` plans, and never trains)."""
    if requested == "cpu" or (requested == "auto" and not may_have_accelerator()):
        return [host_memory()]
    import torch
    want = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EmberError(f"[train] device = {requested!r}: no CUDA device on this machine")
        first = int(want.split(":")[1]) if ":" in want else 0  # the device the run would use first
        order = [first] + [i for i in range(torch.cuda.device_count()) if i != first]
        out = []
        for i in order:
            free, total = torch.cuda.mem_get_info(i)
            out.append(Device(f"{torch.cuda.get_device_name(i)} (cuda:{i})", "cuda", total, free))
        return out
    return [host_memory()]


def may_have_accelerator() -> bool:
    """Whether `device = "auto"` could pick an accelerator here: an NVIDIA driver (its device
    nodes), or macOS (MPS, which the run does not plan for yet; torch decides there)."""
    return sys.platform == "darwin" or os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")


def host_memory() -> Device:
    """Host RAM: total, and available (MemAvailable) to a new process."""
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    kib = {k: int(v.split()[0]) * 1024 for k, v in info.items() if k in ("MemTotal", "MemAvailable")}
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "CPU")
    return Device(f"host RAM ({model}, {os.cpu_count()} cores)", "cpu", kib["MemTotal"], kib["MemAvailable"])


def replace_memory(devices: list[Device], free: int) -> list[Device]:
    """The same devices with `free` bytes each (planning for another machine, or a cap)."""
    return [Device(f"{d.name} (capped at {free / GiB:.3g} GiB)", d.kind, free, free) for d in devices]
