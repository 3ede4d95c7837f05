"""What the training loop does between two micro-batches of one optimizer step, so that a pause
or a stop (the owner's `ember yield`, a preemption) takes the device within one micro-batch
instead of one whole step (grad_accum micro-batches):

    a soft pause   waits right there (ember.control): the step's accumulated gradients wait in
                   memory and the step goes on where it stopped, so nothing it computes changes
    a stop         undoes the step: its gradients are dropped and the process's RNGs rewound to
                   the step's start (`begin` recorded them), so the state is exactly the last
                   completed step's (the weights and the optimizer change only at the step's
                   end; the data cursor moves only once the step is counted). The loop then
                   saves that state and exits; the resumed run computes the step whole, as the
                   uninterrupted run did (bit-identical, tests/train/test_between.py)

    co-serving     ([serve] coserve) answers queued inference requests with the live model
                   (ember.infer.coserve) before every micro-batch, a step's first too; it
                   changes nothing training computes; its time is the step's phase `serve`

One process only: the ranks of a distributed run compute each micro-batch together (FSDP gathers
in it), so they agree to stop, and pause, at step boundaries (ember.train.loop). Co-serving is
refused with several ranks (ember.launch).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ember.control import PausePoint, from_environment
from ember.train.job import Job
from ember.train.recorder import RunRecorder
from ember.train.signals import StopRequest


class Serving(Protocol):
    """Co-serving's side of the gaps (ember.infer.coserve, started by ember.web.coserve)."""

    def gap(self) -> float:
        """Answer queued requests for a while; the seconds it took (0.0: none waited)."""

    def close(self, drain: bool) -> None:
        """Refuse new requests; finish those under way (`drain`), else answer them with an error."""


class NotServing:
    """No co-serving: every gap is empty."""

    def gap(self) -> float:
        return 0.0

    def close(self, drain: bool) -> None:
        pass


class Between:
    """The loop's point between micro-batches: `begin()` as a step starts, `__call__(done)` after
    `done` of its micro-batches (True: the step was undone, the run stops); `pauses` is also
    checked at each step boundary; the loop closes `serving` as it ends."""

    def __init__(self, job: Job, stop: StopRequest, record: RunRecorder, serving: Serving | None = None):
        self.job, self.stop, self.record = job, stop, record
        self.serving = serving or NotServing()
        # A soft pause holds one process; the ranks of a distributed run stop together instead.
        self.pauses = PausePoint(None if job.world.distributed else from_environment(), lambda: stop.requested,
                                 lambda: release_cached_memory(job.device))
        self.active = not job.world.distributed and job.recipe.train.grad_accum > 1

    def begin(self) -> None:
        """A step starts: remember its RNG states (a stop between its micro-batches rewinds to them)."""
        if self.active:  # tens of microseconds a step; nothing to rewind with one micro-batch a step
            self.job.state.capture_rng(self.job.device)

    def __call__(self, done: int) -> bool:
        """Before micro-batch `done` (0: the step's data just fetched): answer queued requests
        (co-serving); pause here if asked; on a stop, undo the step."""
        if self.serving.gap():
            self.job.timer.wait("serve")
        if not self.active:
            return False
        held = self.pauses.check()
        self.record.pause(held, micro_batch=done)
        if held is not None:  # its seconds are the ledger's pause event: no part of the step's time or phases
            self.job.timer.skip(held.end - held.start)
        if not self.stop.requested:
            return False
        self.job.optimizer.zero_grad(set_to_none=True)  # the undone step's gradients
        self.job.state.restore_rng(self.job.device)     # as the step began: the save records these
        self.record.undone(done, self.stop.signal_name)
        return True


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the device (a soft pause keeps only
    what the model and optimizer hold), once the work queued there is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a sync point: the pause starts when the device is idle
        torch.cuda.empty_cache()
