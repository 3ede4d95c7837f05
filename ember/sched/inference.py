"""Inference in flight, per device, and how long it took training there to step aside.

Every /v1 request passes through the service (ember.web.api), which calls `begin` before
forwarding it and `end` when its last byte is sent. While any request is in flight on a device,
or for [inference] idle_gap_seconds after the last one ends, the jobs on that device are asked
to soft-pause (ember.control); the request itself never waits for them. The time from a request
that found training running to every job there acknowledging its pause is the pause latency,
kept for `/api/stats` and the benchmark. A request naming one of ember's LoRA runs is never
forwarded to an upstream engine, which has not loaded its adapter (`adapter_elsewhere`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ember.infer.runs import BASE, lora_run


@dataclass
class Gate:
    device: int
    idle_gap: float
    in_flight: int = 0
    last_end: float = 0.0
    requests: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=10000))  # seconds, request -> paused
    pending: float | None = None   # when the first request of the current busy period arrived
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, training: bool, paused_at: float | None = None) -> None:
        """A request arrives. `training`: some job on the device has not acknowledged a pause, so
        this request starts a latency sample (unless an earlier one in flight did); otherwise
        `paused_at` is when the last job there acknowledged, which closes a pending sample that the
        scheduler has not taken yet (the pause can land between two requests and its tick)."""
        with self.lock:
            if training:
                if self.pending is None:
                    self.pending = time.time()
            else:
                if paused_at is not None:
                    self._sample(paused_at)
                self.pending = None
            self.in_flight += 1
            self.requests += 1

    def arrive(self, acks: list[dict]) -> None:
        """A request arrives; `acks`: what each job on the device last acknowledged (ember.control)."""
        paused = all(a.get("state") == "paused" for a in acks)
        # Paused already: an earlier request's pause the scheduler has not sampled yet closes now.
        self.begin(not paused, max((a.get("time", 0.0) for a in acks), default=None) if paused else None)

    def acknowledged(self, acks: list[dict], acked_at: float) -> None:
        """A job on the device acknowledged a pause at `acked_at`: a sample once all of them did."""
        if all(a.get("state") == "paused" for a in acks):
            self.paused(max([a.get("time", acked_at) for a in acks] + [acked_at]))

    def end(self) -> None:
        with self.lock:
            self.in_flight = max(0, self.in_flight - 1)
            self.last_end = time.time()

    def busy(self, now: float | None = None) -> bool:
        """Whether training on this device should be paused now."""
        now = time.time() if now is None else now
        return self.in_flight > 0 or now - self.last_end < self.idle_gap

    def paused(self, acked_at: float) -> None:
        """Every job on the device acknowledged the pause at `acked_at`: one latency sample."""
        with self.lock:
            self._sample(acked_at)

    def _sample(self, acked_at: float) -> None:
        if self.pending is not None:
            self.latencies.append(max(0.0, acked_at - self.pending))
            self.pending = None

    def stats(self) -> dict:
        xs = sorted(self.latencies)

        def q(p: float) -> float | None:
            return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None
        return {"device": self.device, "in_flight": self.in_flight, "requests": self.requests,
                "pauses": len(xs), "pause_latency_p50": q(0.5), "pause_latency_p99": q(0.99)}


def adapter_elsewhere(upstream: str, roots: list[Path], model: object) -> str | None:
    """Why a /v1 request for `model` cannot go to the `upstream` engine ([inference] upstream):
    it names one of ember's LoRA runs (under `roots`), which that engine has not loaded and
    would answer with its base model. None when it may go."""
    if not upstream or not isinstance(model, str) or model == BASE:
        return None
    path = lora_run(roots, model)
    if path is None:
        return None
    return (f"model {model!r} is ember's LoRA run {path}; the upstream engine "
            f"{upstream} ([inference] upstream) has not loaded its adapter and "
            f"would answer with its base model. Serve adapters with the built-in engine ([inference] "
            f"upstream = \"\"), or write the run as a model of its own (`ember export {path} --format "
            f"gguf`) and load that into the upstream engine")
