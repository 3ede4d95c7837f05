"""Inference in flight, per device, and how long it took training there to step aside.

Every /v1 request passes through the service (ember.web.api), which calls `begin` before
forwarding it and `end` when its last byte is sent. While any request is in flight on a device,
or for the idle gap after the last one ends, the jobs on that device are asked to soft-pause
(ember.control); the request itself never waits for them. The gap is [inference]
idle_gap_seconds: a number, or "auto", chosen (ember.sched.idle_gap) from the idle periods the
gate measures (from the moment no request is in flight to the next arrival, the last 64) and
the pause latency below. The pause latency is,
for each job that was training, the time from the service's first writing of its inference
pause request to the instant its training stopped, both as the job reports them in every
acknowledgement (and in the ledger event of the pause: the same two numbers), kept for
`/api/stats` and the benchmark. A request that finds training paused takes no sample, nor does
a lease that lapsed before the job reached its check (it never paused). A request naming one of ember's LoRA runs is never
forwarded to an upstream engine, which has not loaded its adapter (`adapter_elsewhere`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ember.infer.runs import BASE, lora_run
from ember.metrics.stats import percentile
from ember.sched.idle_gap import IDLE_PERIODS, Gap, Measured, choose


@dataclass
class Gate:
    device: int
    idle_gap: float | str  # [inference] idle_gap_seconds: seconds, or "auto" (ember.sched.idle_gap)
    in_flight: int = 0
    last_end: float = 0.0
    requests: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=10000))  # seconds, asked -> stopped
    idle_periods: deque = field(default_factory=lambda: deque(maxlen=IDLE_PERIODS))  # seconds, none in flight
    seen: dict = field(default_factory=dict)  # a job's PID -> the count of its newest pause sampled
    lock: threading.Lock = field(default_factory=threading.Lock)
    samples: int = 0  # idle periods and pause latencies taken so far: the gap's inputs changed
    chosen: tuple | None = None  # ((setting, samples), Gap): busy() asks every tick, samples come per request

    def begin(self, now: float | None = None) -> None:
        """A request arrives; if none was in flight, the idle period since the last one ended is
        a sample of the arrival process."""
        now = time.time() if now is None else now
        with self.lock:
            if self.in_flight == 0 and self.requests:
                self.idle_periods.append(max(0.0, now - self.last_end))
                self.samples += 1
            self.in_flight += 1
            self.requests += 1

    def observe(self, ack: dict | None) -> None:
        """A job's acknowledgement (ember.control): its newest pause is one sample, once, when
        that pause was asked for inference of a job that was training (one that was paused
        already for its owner or by hand answers at once and is no sample)."""
        last = (ack or {}).get("last")
        if not isinstance(last, dict) or last.get("reason") != "inference":
            return
        with self.lock:
            if self.seen.get(ack.get("pid")) == last.get("n"):
                return
            self.seen[ack.get("pid")] = last.get("n")
            self.latencies.append(max(0.0, float(last["at"]) - float(last["asked"])))
            self.samples += 1

    def end(self, now: float | None = None) -> None:
        """A request's last byte was sent."""
        with self.lock:
            self.in_flight = max(0, self.in_flight - 1)
            self.last_end = time.time() if now is None else now

    def gap(self) -> Gap:
        """The idle gap in use and how it was chosen (recomputed when a sample or the setting changed)."""
        with self.lock:
            key = (self.idle_gap, self.samples)
            if self.chosen is None or self.chosen[0] != key:
                xs = list(self.latencies)
                p99 = percentile(xs, 99) if xs else None
                self.chosen = (key, choose(self.idle_gap, Measured(tuple(self.idle_periods), p99)))
            return self.chosen[1]

    def busy(self, now: float | None = None) -> bool:
        """Whether training on this device should be paused now."""
        now = time.time() if now is None else now
        return self.in_flight > 0 or now - self.last_end < self.gap().seconds

    def stats(self) -> dict:
        """Requests so far, the pause latencies' p50 and p99 (linear interpolation), and the idle
        gap in use with its rule."""
        xs = list(self.latencies)
        p50, p99 = (percentile(xs, 50), percentile(xs, 99)) if xs else (None, None)
        gap = self.gap()
        return {"device": self.device, "in_flight": self.in_flight, "requests": self.requests,
                "pauses": len(xs), "pause_latency_p50": p50, "pause_latency_p99": p99,
                "idle_periods": len(self.idle_periods), "idle_gap_seconds": gap.seconds,
                "idle_gap_rule": gap.rule}


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
