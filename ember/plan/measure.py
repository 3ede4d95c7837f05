"""Measured peak memory of a training step, to check the estimate against.

On CUDA: `torch.cuda.max_memory_allocated` over the step. On CPU there is no allocator
counter, so: the bytes of every live tensor when the step starts (found through the garbage
collector, each storage once), plus the high point of the running sum of the allocation and
free events `torch.profiler` records during the step. Measured on the second step, once the
optimizer state exists.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import torch


def training_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, device: torch.device,
                  precision: str, loss_chunk: int) -> Callable[[], None]:
    """The step the memory plan estimates, as the training loop takes it: forward with labels
    (autocast per `precision`), backward, clip, the optimizer's update, gradients set to None."""
    from ember.device import autocast
    from ember.train.loss import causal_lm_loss
    from ember.train.model import trainable_parameters
    params = trainable_parameters(model)

    def step() -> None:
        with autocast(device, precision):
            loss = causal_lm_loss(model, ids, loss_chunk)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of all tensor storages alive on `device` (parameters, optimizer state, buffers...)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), torch.Tensor) and obj.device.type == device.type and obj.layout == torch.strided:
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, ReferenceError):
            continue
    return sum(seen.values())


def _allocations(node: Any, out: list[tuple[int, int]], device_type: str) -> None:
    if node.tag == torch._C._profiler._EventType.Allocation and node.extra_fields.device.type == device_type:
        out.append((node.start_time_ns, node.extra_fields.alloc_size))
    for child in node.children:
        _allocations(child, out, device_type)


def step_peak(step: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated on `device` while `step()` runs (call it after a warm-up step)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    if device.type != "cpu":
        raise ValueError(f"peak memory on {device.type} is not measured yet (CUDA and CPU are)")
    base = live_tensor_bytes(device)
    from torch.profiler import ProfilerActivity, profile
    sys.stderr.flush()
    saved = os.dup(2)  # kineto prints start/stop lines on the C side of stderr: keep them out
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    events: list[tuple[int, int]] = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        _allocations(root, events, "cpu")
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return base + peak
