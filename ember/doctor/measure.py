"""Measurements of the real training step (ember.train.loop.train_step, on in-memory batches):
its peak memory, to check the plan's estimate against, and its time (a `Calibration`).

On CUDA: `torch.cuda.max_memory_allocated` over the step. On CPU there is no allocator
counter, so: the bytes of every live tensor when the step starts (found through the garbage
collector, each storage once), plus the high point of the running sum of the allocation and
free events `torch.profiler` records during the step. Measured on the second step, once the
optimizer state exists.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ember.plan.planner import Calibration
from ember.recipe import Recipe


def synthetic(batch: Any) -> Any:
    """Stands in for the loop's Data: the same in-memory micro-batch (a MicroBatch, or a tensor
    of token ids), forever."""
    from ember.data.loader import MicroBatch
    batch = MicroBatch(batch) if isinstance(batch, torch.Tensor) else batch
    return SimpleNamespace(iter=itertools.repeat((0, batch)), batches=SimpleNamespace(first_ordinal=0),
                           advance=lambda micro_batches: 0, close=lambda: None)


def measured_step(model: torch.nn.Module, ids: torch.Tensor, device: torch.device, precision: str = "fp32",
                  loss_chunk: int = 0, recipe: Recipe | None = None, grad_accum: int = 1) -> Callable[[], Any]:
    """The loop's own train_step on `model` with the micro-batch `ids` (`grad_accum` times), as a
    callable: forward with labels (autocast per `precision`), backward, clip, AdamW's update,
    gradients to None."""
    from ember.train.loop import train_step
    from ember.train.parts import build_parts
    r = recipe or Recipe()
    r = dataclasses.replace(r, precision=dataclasses.replace(r.precision, mode=precision),
                            train=dataclasses.replace(r.train, loss_chunk=loss_chunk, grad_accum=grad_accum,
                                                      micro_batch=ids.shape[0]),
                            data=dataclasses.replace(r.data, seq_len=ids.shape[1]))
    parts = build_parts(r, device, model)
    data = synthetic(ids)
    return lambda: train_step(parts, data)


def calibrate(r: Recipe, steps: int = 3, bundle: Any = None, device: torch.device | None = None) -> Calibration:
    """Measure, on this machine, a micro-batch's step time and the step's peak memory, with random
    tokens of the recipe's shape and the real model."""
    if bundle is None:
        bundle, device = build_for_measurement(r)
    model = bundle.model
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (r.train.micro_batch, r.data.seq_len), device=device)
    # The peak of a step as the recipe accumulates it: from its second micro-batch on the gradients
    # of the ones before are alive through the backward (full fine-tuning with grad_accum 3: +10%
    # over one micro-batch's step); the third and later are the second again.
    accum = min(r.train.grad_accum, 2)
    step = measured_step(model, ids, device, r.precision.mode, r.train.loss_chunk, r, accum)
    step()  # the optimizer state exists from here on
    peak = step_peak(step, device)
    if accum > 1:  # a micro-batch's time: the one-micro-batch step (the plan multiplies it)
        del step
        step = measured_step(model, ids, device, r.precision.mode, r.train.loss_chunk, r)
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()  # the loss's .item() in the step synchronises an accelerator
        times.append(time.perf_counter() - t0)
    return Calibration(statistics.median(times), peak)


def build_for_measurement(r: Recipe) -> tuple[Any, torch.device]:
    """The recipe's model on its device, seeded, in training mode (no run folder, no data)."""
    from ember.ckpt.state import seed_all
    from ember.device import configure_determinism, pick_device
    from ember.train.model import load_model
    device = pick_device(r.train.device)
    configure_determinism(False, r.train.threads, device)
    seed_all(r.train.seed)
    bundle = load_model(r.model, r.method, r.train.activation_checkpointing)
    bundle.model.to(device).train()
    return bundle, device


def loader_rate(r: Recipe, tokens_path: Path, batches: int = 50) -> float:
    """Micro-batches per second the input pipeline delivers with nothing consuming them."""
    from ember.ckpt.state import DataCursor
    from ember.data.loader import PackedBatches, make_loader, resolve_packing
    packed = PackedBatches(tokens_path, r.data.seq_len, r.train.micro_batch, r.train.seed, DataCursor(),
                           *resolve_packing(r.data, tokens_path))
    loader = make_loader(packed, batches, r.data.workers, pin=False)
    t0 = time.perf_counter()
    n = sum(1 for _ in loader)
    return n / max(time.perf_counter() - t0, 1e-9)


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
