"""Co-serving: the training process answers inference requests for its own model between
micro-batches, with the one copy of the weights it trains (`[serve] coserve`; ember.web.coserve
puts the inference worker's OpenAI app in front of it).

Model names a request may ask for:

    live        the weights being trained, as they are at this gap (for LoRA: the base and the
                adapter being trained); the run folder's name means the same
    committed   LoRA: the base and the adapter of the newest committed checkpoint that verifies.
                For each forward of its batch the checkpoint's adapter tensors are copied into
                the live adapter's and the live ones copied back after, bit for bit (the
                adapter is small; its tensors are kept on the host per checkpoint). A full
                fine-tuning run answers 400: its checkpoint is a second copy of the whole model
    base        LoRA: the base with the adapter disabled (peft's disable_adapter). A full run
                answers 400: training has changed the base's own weights

The gap: the loop calls `Gaps.gap()` before every micro-batch (ember.train.between). With nothing
queued it returns at once (one look at the queue). Otherwise it runs turns of ember's decode
loop (ember.infer.batching: admit a request, prefill a chunk, one decode step of the batch)
while it has credit (`Credit`), and at least one turn. Training earns credit, `[serve]
gap_share` seconds of serving per second of training, saved up to `[serve] burst_seconds` while
nothing waits: a request that arrives at a quiet moment is answered whole in the next gap (it
waits only for the micro-batch under way), and under a steady stream of requests training
keeps about 1 / (1 + gap_share) of its speed (half by default), each request waiting at most
one micro-batch for its next turn. What serving takes over any stretch of training T is at most
gap_share x T + burst_seconds (and the one turn a gap takes without credit).

What serving leaves as it was, so training computes exactly what a run that served nothing
computes (tests/e2e/test_coserve.py): the model runs under torch.no_grad in eval mode, and
afterwards every module's training flag and every parameter's requires_grad are set back as
they were; the process's CPU (and CUDA) RNG states are saved before and restored after, and
sampling draws from each request's own torch.Generator; gradients, the optimizer, the data
loader and LoRA's keyed dropout (ember.train.dropout: off in eval mode) are never touched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.ckpt.store import committed_in
from ember.infer.adapters import BASE, RequestError, checkpoint_identity, verified_weights
from ember.infer.batching import Batcher
from ember.infer.engine import Engine, Generation, Sampling, eos_ids

LIVE, COMMITTED = "live", "committed"


class CoEngine(Engine):
    """ember's engine over a training job's live model: no second copy, no thread of its own.
    Engine's request checks, text handling and decode loop apply as they are; where the model
    comes from and what each name serves are this class's own (the methods below)."""

    default_model = LIVE

    def __init__(self, job: Any):  # an ember.train.job.Job
        # Not Engine.__init__: it resolves a model spec and picks a device, which the job has done;
        # these are the attributes Engine's request path and the decode loop read.
        b, r = job.bundle, job.recipe
        self.job, self.spec, self.seed, self.events, self.roots = job, r.model.path, r.train.seed, job.events, []
        self.device, self.model, self.tokenizer, self.source = job.device, b.model, b.tokenizer, b.source
        self.max_positions, self.eos_ids = b.max_positions, eos_ids(b.model, b.tokenizer)
        self.error, self.loaded_at = None, time.time()
        self.lock = threading.Lock()  # taken by each turn of the decode loop (uncontended here)
        self.lora = r.method.kind == "lora"
        self.checkpoints = job.run.path / "checkpoints"
        self.committed: tuple[tuple, int, dict[str, torch.Tensor]] | None = None  # (identity, step, adapter)
        self.requests = 0
        self._active = LIVE
        self.batcher = Batcher(self, threaded=False, grad_off=torch.no_grad)

    def load(self) -> None:
        """Nothing to load: the model is the one training."""

    def generate(self, model: str, prompt: str | list[dict[str, Any]], sampling: Sampling) -> Generation:
        """A generation, as Engine's; the run folder's name is `live`."""
        gen = super().generate(LIVE if model == self.job.run.path.name else model, prompt, sampling)
        self.requests += 1
        return gen

    def models(self) -> list[dict[str, Any]]:
        """What each name serves now: live, and for LoRA committed and base."""
        out = [{"id": LIVE, "created": int(self.loaded_at), "kind": "live", "path": str(self.job.run.path),
                "step": self.job.state.step}]
        if self.lora:
            newest = max((step for step, _ in committed_in(self.checkpoints)), default=None)
            out += [{"id": COMMITTED, "created": int(self.loaded_at), "kind": "lora", "checkpoint_step": newest},
                    {"id": BASE, "created": int(self.loaded_at), "kind": "base", "path": self.spec}]
        return out

    def _check_name(self, model: str) -> None:
        if model not in (LIVE, COMMITTED, BASE):
            raise RequestError(f"model {model!r}: no such model; this training run serves {LIVE!r} "
                               f"(or {self.job.run.path.name!r}), {COMMITTED!r} and {BASE!r}", 404)
        if model != LIVE and not self.lora:
            what = ("training has changed the base model's own weights" if model == BASE else
                    "swapping a checkpoint of the whole model in would need a second copy of it")
            raise RequestError(f"model {model!r}: this is a full fine-tuning run, and {what}; ask for "
                               f"{LIVE!r}, or serve a checkpoint's weights with `ember serve`", 400)

    def _activate(self, model: str) -> None:
        """Called as a batch for `model` starts: the committed adapter read, if it changed."""
        self._active = model
        if model == COMMITTED:
            self._read_committed()

    def _read_committed(self) -> None:
        for step, folder in reversed(committed_in(self.checkpoints)):
            try:
                key = checkpoint_identity(folder)
                if self.committed is not None and self.committed[0] == key:
                    return
                weights = verified_weights(folder)
            except (OSError, ValueError) as e:  # retired by the writer meanwhile, or damaged
                self.events.warn(f"{folder}: not served ({e}); trying the checkpoint before it")
                continue
            self.committed = (key, step, self._fitted(weights, folder))
            return
        raise RequestError(f"model {COMMITTED!r}: {self.checkpoints} has no committed checkpoint that "
                           f"verifies yet; retry after the run commits one, or ask for {LIVE!r}", 409)

    def _fitted(self, weights: dict[str, torch.Tensor], folder: Any) -> dict[str, torch.Tensor]:
        """The checkpoint's adapter tensors, each checked against the live one it replaces."""
        params = dict(self.model.named_parameters())
        wrong = sorted(n for n, t in weights.items() if n not in params or params[n].shape != t.shape)
        if wrong or not weights:
            raise RequestError(f"{folder}: its weights do not fit this run's adapter ({len(wrong)} tensors "
                               f"differ, e.g. {wrong[:1]}); ask for {LIVE!r}", 409)
        return {n: t.to(params[n].device, params[n].dtype) for n, t in weights.items()}

    @contextmanager
    def _serving(self, model: str) -> Iterator[None]:
        """`model`'s weights in place for one forward, and the live ones back after it."""
        if model == BASE:
            with self.model.disable_adapter():
                yield
        elif model == COMMITTED:
            with swapped(self.model, self.committed[2]):
                yield
        else:
            yield


@contextmanager
def swapped(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """The parameters named in `weights` hold them; then their own values again, bit for bit."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        kept = {n: params[n].detach().clone() for n in weights}
        for n, t in weights.items():
            params[n].copy_(t)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, t in kept.items():
                params[n].copy_(t)


@contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode for serving; then every module's training flag, every parameter's requires_grad
    (peft's disable_adapter changes them) and the process's RNG states as they were."""
    modes = [(m, m.training) for m in model.modules()]
    wanted = [(p, p.requires_grad) for p in model.parameters()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training  # exactly as it was: model.train() would set every module alike
        for p, requires in wanted:
            p.requires_grad_(requires)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@dataclass
class Credit:
    """The serving time a gap may take, in seconds (arithmetic only): `share` seconds earned per
    second of training, saved up to `burst` (or one gap's earnings, if more); spent by serving.
    It starts full. A gap that serves past its credit (the one turn it always takes) leaves a
    debt, which training pays back first."""
    share: float
    burst: float
    balance: float = field(init=False)

    def __post_init__(self) -> None:
        self.balance = self.burst

    def trained(self, seconds: float) -> float:
        """Training ran `seconds` since the previous gap: the balance now, this gap's budget."""
        earned = self.share * seconds
        self.balance = min(self.balance + earned, max(self.burst, earned))
        return self.balance

    def served(self, seconds: float) -> None:
        self.balance -= seconds


class Gaps:
    """The training loop's side (ember.train.between.Serving): `gap()` before each micro-batch,
    `close(drain)` as the loop ends."""

    def __init__(self, engine: CoEngine, share: float, burst: float):
        self.engine, self.credit = engine, Credit(share, burst)
        self.last = time.perf_counter()  # when the previous gap ended: training has run since
        self.turns, self.seconds = 0, 0.0

    def gap(self) -> float:
        """Answer queued requests while the credit lasts (one turn at least); the seconds it
        took, 0.0 when nothing waited (the training time since the last gap is credited either way)."""
        batcher, start = self.engine.batcher, time.perf_counter()
        budget = self.credit.trained(start - self.last)
        if not batcher.pending():
            self.last = start
            return 0.0
        with preserved(self.engine.model):
            batcher.turn()
            self.turns += 1
            while batcher.pending() and time.perf_counter() - start < budget:
                batcher.turn()
                self.turns += 1
        self.last = time.perf_counter()
        self.credit.served(self.last - start)
        self.seconds += self.last - start
        return self.last - start

    def close(self, drain: bool) -> None:
        """Refuse new requests (503); finish the ones under way (`drain`: the run completed), or
        answer them 503 (a stop or a crash: the process must go now)."""
        batcher = self.engine.batcher
        batcher.close()
        if not drain:
            batcher.fail(RequestError("the training run stopped before this answer was complete", 503),
                         waiting=True)
            return
        with preserved(self.engine.model):
            while batcher.pending():
                batcher.turn()
                self.turns += 1
