"""Continuous batching: ember's own decode loop over a Hugging Face causal LM and its KV cache.

One thread (`Batcher`) runs the model. Requests (`Job`s) queue; between two decode steps the
loop admits waiting ones and drops finished or cancelled ones, so a request joins the running
batch without waiting for the others to end, and leaves it without stopping them:

    waiting --(admitted: its model is active)--> prefilling --(last chunk)--> running
    running --(an end-of-text token, max_tokens, or cancel)--> done

The prompt is prefilled in chunks of PREFILL_CHUNK tokens, one chunk per turn of the loop
between decode steps: a long prompt delays the running requests by a chunk at a time. A
prefilled request's cache then joins the batch's: the shorter of the two is left-padded, its
attention mask 0 there, and each row's position ids count its own tokens only, so a request's
logits are its solo logits up to the float rounding of other shapes (greedy text is tested equal
to solo: tests/infer/test_batching.py).

Adapters: peft has one active adapter for the whole model, so one batch serves one model name
(`base`, or one run's adapter). Requests are admitted in arrival order: while the oldest waiting
one is for another name, the batch admits nothing more and drains, then that name goes next.
A run's newer checkpoint is picked up when a batch for it starts, not mid-batch.

Only this thread runs generations, and it holds `Engine.lock` for each step: the engine's other
users of the model (next_token_logits, adapter swaps) go between steps. A training process that
co-serves its model (ember.infer.coserve) starts no thread: its training thread calls `turn()`
itself in the gaps between micro-batches, under torch.no_grad (not inference_mode: nothing made
while serving may end up beside the training's autograd tensors). Once `close()`d, a request
submitted is refused (503).
"""

from __future__ import annotations

import atexit
import threading
from collections import deque
from collections.abc import Iterator
from queue import Queue
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ember import faults
from ember.infer.adapters import RequestError

PREFILL_CHUNK = 128  # prompt tokens per forward pass while others wait for their next token
MAX_BATCH = 8        # requests decoded together; more wait their turn
_START = object()


class Job:
    """One request in the loop: `started()` waits for its turn, `tokens()` yields its new token
    ids as they are made, `cancel()` ends it before the next step."""

    def __init__(self, model: str, ids: list[int], sampling: Any):  # an ember.infer.engine.Sampling
        self.model, self.ids, self.sampling = model, ids, sampling
        self.out: Queue = Queue()  # _START (or what refused it), token ids, None at the end
        self.cancelled = threading.Event()
        self.generator: torch.Generator | None = None
        if sampling.temperature > 0:  # its own random stream: a seed gives the same text in any batch
            self.generator = torch.Generator()
            if sampling.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(sampling.seed)
        self.cache: DynamicCache | None = None  # its own while prefilling; then rows of the batch's
        self.prefilled = 0   # prompt tokens in its cache
        self.made = 0        # tokens generated
        self.last = -1       # the newest token: the next step's input
        self.finished = False

    def started(self) -> None:
        """Wait until the loop admits the job (its model is active); raise what refused it."""
        item = self.out.get()
        if isinstance(item, BaseException):
            raise item

    def tokens(self) -> Iterator[int]:
        """The generated token ids, as they come; raises what failed the generation."""
        while (item := self.out.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        """Stop generating (the loop drops the job before its next step)."""
        self.cancelled.set()


class Batcher:
    """The decode loop of one engine: a thread started at the first request."""

    def __init__(self, engine: Any, threaded: bool = True, grad_off: Any = torch.inference_mode):
        self.engine = engine  # the ember.infer.engine.Engine it runs (imported there: no cycle)
        self.threaded, self.grad_off = threaded, grad_off  # threaded: its own thread runs `turn()`
        self.wake = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.prefilling: Job | None = None
        self.rows: list[Job] = []              # the running batch, one row each
        self.cache: DynamicCache | None = None  # the running batch's keys and values
        self.mask: torch.Tensor | None = None   # [rows, cached positions]: 0 at left padding
        self.model = ""                         # the model name the running batch serves
        self.widest = 0                         # the most rows one decode step has run
        self.thread: threading.Thread | None = None
        self.closed = False

    def submit(self, job: Job) -> None:
        """Queue a job; the loop admits it between two steps. Refused once the loop is closed."""
        with self.wake:
            if self.closed:  # the thread has ended, or the training process that served is finishing
                job.out.put(RequestError("the model is no longer served here (its process is ending)", 503))
                return
            self.waiting.append(job)
            if self.threaded and self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="ember-batcher", daemon=True)
                self.thread.start()
                atexit.register(self.close)
            self.wake.notify()

    def close(self) -> None:
        """End the loop after its current step (at exit: a loop thread left alive makes the C++
        runtime print "terminate called without an active exception")."""
        with self.wake:
            self.closed = True
            self.wake.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)

    def pending(self) -> bool:
        """Whether a job waits, prefills or decodes (a lock-free look: a job may arrive just after)."""
        return bool(self.waiting or self.prefilling or self.rows)

    def _loop(self) -> None:
        while True:
            with self.wake:
                self.wake.wait_for(lambda: self.closed or self.pending())
                if self.closed:
                    return
            self.turn()

    def turn(self) -> None:
        """One turn of the loop: admit a waiting job, prefill one chunk, decode one step."""
        try:
            with self.engine.lock, self.grad_off():
                self._admit()
                if self.prefilling is not None:
                    self._prefill_chunk()
                if self.rows:
                    self._decode()
        except BaseException as e:  # a defect: every job in the loop reports it, the loop goes on
            self.fail(e)

    def fail(self, error: BaseException, waiting: bool = False) -> None:
        """End every job being generated, and with `waiting` the waiting ones, with `error` as its answer."""
        with self.wake:
            queued, self.waiting = (list(self.waiting), deque()) if waiting else ([], self.waiting)
        for job in [*self.rows, *filter(None, [self.prefilling]), *queued]:
            job.out.put(error)
        self.rows, self.prefilling, self.cache, self.mask = [], None, None, None

    def _admit(self) -> None:
        """Start prefilling the oldest waiting job, if the running batch can take it."""
        with self.wake:
            self.waiting = deque(j for j in self.waiting if not j.cancelled.is_set())
            if self.prefilling is not None or not self.waiting or len(self.rows) >= MAX_BATCH:
                return
            job = self.waiting[0]
            if self.rows and (job.model != self.model or not _joinable(self.cache)):
                return  # the batch drains first: one adapter per step
            self.waiting.popleft()
        try:
            if not self.rows:
                self.engine._activate(job.model)  # rescans its run: a newer checkpoint goes in here
        except BaseException as e:  # refused (no checkpoint yet, damaged): that request's answer
            job.out.put(e)
            return
        self.model = job.model
        job.out.put(_START)
        self.prefilling = job

    def _prefill_chunk(self) -> None:
        """One chunk of the prefilling job's prompt; after its last, its first token, and it joins."""
        job = self.prefilling
        if job.cancelled.is_set():
            self.prefilling = None
            return
        model = self.engine.model
        if job.cache is None:
            job.cache = DynamicCache(config=model.config)
        chunk = job.ids[job.prefilled:job.prefilled + PREFILL_CHUNK]
        with self.engine._serving(job.model):
            logits = model(input_ids=torch.tensor([chunk], device=self.engine.device), cache=job.cache,
                           use_cache=True, logits_to_keep=1).logits[:, -1]
        job.prefilled += len(chunk)
        if job.prefilled < len(job.ids):
            return
        self.prefilling = None
        self._join(job)
        self._emit(job, pick(logits, [job])[0])
        self._keep([i for i, j in enumerate(self.rows) if not j.finished])

    def _join(self, job: Job) -> None:
        """Add a prefilled job's cache to the batch's as a new row, left-padding the shorter."""
        length = job.cache.get_seq_length()
        ones = torch.ones(1, length, dtype=torch.long, device=self.engine.device)
        if not self.rows:
            self.cache, self.mask = job.cache, ones
        else:
            width = max(self.mask.shape[1], length)
            mine, theirs = width - self.mask.shape[1], width - length
            for ours, its in zip(self.cache.layers, job.cache.layers):
                ours.keys = torch.cat([_pad(ours.keys, mine), _pad(its.keys, theirs)])
                ours.values = torch.cat([_pad(ours.values, mine), _pad(its.values, theirs)])
            self.mask = torch.cat([F.pad(self.mask, (mine, 0)), F.pad(ones, (theirs, 0))])
        job.cache = None
        self.rows.append(job)

    def _decode(self) -> None:
        """One decode step of the running batch: every row's next token."""
        self._keep([i for i, j in enumerate(self.rows) if not j.cancelled.is_set()])
        if not self.rows:
            return
        faults.point("infer.token")  # EMBER_FAULT_HANG here: a generation that takes that long
        device = self.engine.device
        self.mask = F.pad(self.mask, (0, 1), value=1)
        positions = self.mask.sum(1, keepdim=True) - 1  # each row's own count: padding is not a position
        tokens = torch.tensor([[j.last] for j in self.rows], device=device)
        self.widest = max(self.widest, len(self.rows))
        with self.engine._serving(self.model):
            logits = self.engine.model(input_ids=tokens, attention_mask=self.mask, position_ids=positions,
                                       cache=self.cache, use_cache=True).logits[:, -1]
        for job, token in zip(self.rows, pick(logits, self.rows)):
            self._emit(job, token)
        self._keep([i for i, j in enumerate(self.rows) if not j.finished])

    def _emit(self, job: Job, token: int) -> None:
        job.last, job.made = token, job.made + 1
        job.out.put(token)
        if token in self.engine.eos_ids or job.made >= job.sampling.max_tokens:
            job.finished = True
            job.out.put(None)

    def _keep(self, rows: list[int]) -> None:
        """Keep only these rows of the batch, and drop the padding columns no row needs any more."""
        if len(rows) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in rows]
        if not self.rows:
            self.cache = self.mask = None
            return
        index = torch.tensor(rows, device=self.mask.device)
        self.mask = self.mask[index]
        start = int(self.mask.any(0).int().argmax())  # the first column some row attends to
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, start:], layer.values[index, :, start:]


def pick(logits: torch.Tensor, jobs: list[Job]) -> list[int]:
    """Each row's next token: the argmax at temperature 0, else sampled (temperature, top_p)
    from the job's own random stream."""
    greedy = logits.argmax(-1).tolist()
    out = []
    for row, job, best in zip(logits, jobs, greedy):
        s = job.sampling
        if s.temperature == 0:
            out.append(best)
            continue
        # Less the row's maximum and in float64, so that no temperature above 0 overflows: in
        # float32, logits / 1e-300 are inf, softmax made nan of them and multinomial raised, which
        # failed every request in the batch. Near 0 this is the argmax, as temperature 0 is.
        row = row.double().cpu()  # the generator is on the CPU
        probs = torch.softmax((row - row.max()) / s.temperature, -1)
        if s.top_p < 1:  # keep the most likely tokens whose mass reaches top_p
            ranked, order = probs.sort(descending=True)
            ranked[ranked.cumsum(0) - ranked > s.top_p] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, ranked)
        out.append(int(torch.multinomial(probs, 1, generator=job.generator)))
    return out


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [batch, heads, positions, dim] with n zero positions on the left."""
    return F.pad(x, (0, 0, n, 0)) if n else x


def _joinable(cache: Any) -> bool:
    # Plain growing layers only: a sliding-window layer's positions cannot be padded like this,
    # so a model with one decodes one request at a time.
    return cache is not None and all(type(layer) is DynamicLayer for layer in cache.layers)
