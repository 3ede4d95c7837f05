"""Where one optimizer step's time goes: data wait, host-to-device copy, forward, backward,
gradient synchronisation, optimizer, checkpoint blocking; under pipeline parallelism also the
bubble, the time a stage waits on the others inside the schedule (a phase of its runs only); and
`serve`, co-serving's gaps, in the steps that answered requests (ember.infer.coserve).

On CPU every operation is synchronous, so wall-clock between marks is exact. On an accelerator
the marks are device events, resolved once at the end of the step (one synchronisation per
step, after the optimizer; the loop already synchronises on each micro-batch's loss), except the
data wait, which is host time by nature.
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "h2d", "forward", "backward", "sync", "optimizer", "checkpoint")


class StepTimer:
    """`begin()`; after each part `lap(phase)` (device work) or `wait(phase)` (host waiting, such
    as for data); `end()` returns seconds per phase. Repeated phases add up (micro-batches)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def begin(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.t = self.began = self.last = time.perf_counter()
        self.skipped = 0.0
        self.mark = self._event()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        if self.cuda:
            e = self._event()
            self.pending.append((phase, self.mark, e))
            self.mark = e
        else:
            self.totals[phase] += now - self.t
        self.t = self.last = now

    def wait(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.t  # `serve`: only in co-serving steps
        self.t = self.last = now
        self.mark = self._event()

    def skip(self, seconds: float) -> None:
        """`seconds` of the host time since the last mark belong to no phase: a soft pause inside
        the step, accounted as its own goodput bucket (ember.train.between), and left out of the
        step's seconds by the same figure. The rest of that time (checking for the pause, writing
        its ledger event) stays with the next phase, as it does in a step that does not pause."""
        self.t += seconds
        self.skipped += seconds
        self.mark = self._event()

    def split(self, parts: dict[str, float], rest: str) -> None:
        """The host time since the last mark, the work before it synchronised (a pipeline's step):
        `parts`' seconds to their phases, what they leave to `rest`."""
        now = time.perf_counter()
        for phase, seconds in parts.items():
            self.totals[phase] = self.totals.get(phase, 0.0) + seconds
        self.totals[rest] += max(0.0, now - self.t - sum(parts.values()))
        self.t = self.last = now
        self.mark = self._event()

    def end(self) -> dict[str, float]:
        if self.pending:
            self.pending[-1][2].synchronize()
            self.last = time.perf_counter()  # the device's tail of the step is the step's too
            for phase, a, b in self.pending:
                self.totals[phase] += a.elapsed_time(b) / 1000
        return self.totals

    def seconds(self) -> float:
        """The step's seconds: from begin() to its last mark (on an accelerator, to the end of its
        device work), without the skipped ones. Read from the same clock readings as the phases,
        so on a CPU they add up to it exactly: read apart, a process descheduled between the two
        readings (13 ms once, on 2 cores under a load of 8) put them apart."""
        return self.last - self.began - self.skipped

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
