"""Device choice, precision and determinism, with nothing hard-wired to CUDA."""

from __future__ import annotations

import importlib.util
import os
from contextlib import nullcontext
from typing import Any

import torch

from ember.errors import EmberError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(spec: str) -> torch.device:
    """'auto' -> the accelerator torch finds (CUDA, XPU, NPU, MPS, ...), else CPU."""
    if spec == "auto":
        if importlib.util.find_spec("torch_npu") is not None:
            import torch_npu  # noqa: F401  Ascend NPUs register with torch only when imported
        accel = torch.accelerator.current_accelerator(check_available=True)
        return torch.device(accel.type) if accel is not None else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise EmberError(f"[train] device = {spec!r}: not a torch device; use 'auto', 'cpu', "
                         f"'cuda', 'cuda:1', 'xpu', 'npu' or 'mps'") from None
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is None or not module.is_available():
            raise EmberError(f"[train] device = {spec!r}: no such device is available here; "
                             f"use 'auto' or 'cpu'")
    return device


def device_module(device: torch.device) -> Any | None:
    """torch.cuda, torch.xpu, ... for an accelerator; None for the CPU."""
    return None if device.type == "cpu" else torch.get_device_module(device.type)


def configure_determinism(deterministic: bool, threads: int, device: torch.device) -> int:
    """Fix the thread count and, if asked, force deterministic kernels; returns the threads used."""
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    if deterministic:
        # cuBLAS needs a fixed workspace for deterministic GEMMs; harmless elsewhere.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = False
    return threads


def autocast(device: torch.device, mode: str):
    """An autocast context for bf16/fp16 where the device supports it, else a no-op."""
    if mode == "fp32":
        return nullcontext()
    if not torch.amp.is_autocast_available(device.type):
        raise EmberError(f"[precision] mode = {mode!r}: autocast is not available on "
                         f"{device.type}; use 'fp32'")
    return torch.autocast(device_type=device.type, dtype=DTYPES[mode])


def rng_states(device: torch.device) -> dict[str, Any]:
    """The torch RNG states this process uses: CPU, plus every device of the accelerator type."""
    module = device_module(device)
    return {"cpu": torch.get_rng_state(),
            "device": module.get_rng_state_all() if module is not None else []}


def set_rng_states(states: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    module = device_module(device)
    if module is not None and states["device"]:
        module.set_rng_state_all(states["device"])
