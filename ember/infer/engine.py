"""The inference engine: one base model in memory, the LoRA adapters of ember runs swapped onto it.

Model names: `base` is the base model as loaded. Every other name is a run folder's name
(`runs/a` -> `a`), found as `ember.infer.adapters` describes: registered run folders, and folders
of runs rescanned on every request.

A LoRA run serves the adapter weights of its newest committed checkpoint that verifies against
its manifest. The adapters live in one peft wrapper around the base: a run's adapter is added
once and switched to with `set_adapter`; when its newest checkpoint changes (the run trained
on), the next request adds the new weights and deletes the old ones. The base model is never
reloaded; `base` runs with the adapters disabled, and gives exactly what it gave before any
adapter was added. Full fine-tuning runs are refused (HTTP 400): serving one needs a second
copy of the model, which its `final/` folder is (`--model RUN/final`).

A run is served only on the base it was trained on: the same model files (by the hashes in its
run.json), and for builtin:tiny, a random init, the same seed (`Engine(seed=...)`).

Generations run in ember's own decode loop (ember.infer.batching): concurrent requests for the
same model name are decoded together, one batch step at a time; requests for different names
take turns, since peft has one active adapter. `Engine.lock` is held by each step of the loop
and by anything else that uses the model or swaps adapters.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember.ckpt.state import seed_all
from ember.ckpt.store import committed_in
from ember.data.chat import content_text
from ember.device import pick_device
from ember.errors import EmberError
from ember.events import Events
from ember.infer.batching import Batcher, Job
from ember.infer.adapters import (BASE, RequestError, check_roots, checkpoint_identity, copy_adapter_weights,
                                  find_runs, lora_method, servable_record, verified_weights)
from ember.models import BYTE_EOS, resolve_path
from ember.recipe import MethodConfig, ModelConfig
from ember.train.model import load_model, lora_config
from ember.data.tokenizer import ByteTokenizer

MAX_TOKENS = 4096
MAX_STOPS = 4


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else sampled with temperature and top_p.
    max_tokens None: up to the end of the model's context, at most MAX_TOKENS."""
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def check(self) -> None:
        """Raise RequestError naming the first value out of range."""
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_TOKENS:
            raise RequestError(f"max_tokens = {self.max_tokens}: must be from 1 to {MAX_TOKENS}")
        if not 0 <= self.temperature <= 2:
            raise RequestError(f"temperature = {self.temperature}: must be from 0 to 2 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p = {self.top_p}: must be above 0 and at most 1")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed = {self.seed}: must be from 0 to 2**63 - 1")
        if len(self.stop) > MAX_STOPS or not all(self.stop):
            raise RequestError(f"stop: at most {MAX_STOPS} strings, none of them empty")


@dataclass
class _Adapter:
    slot: str               # the peft adapter name
    checkpoint: tuple       # checkpoint_identity() of the checkpoint its weights came from
    step: int


class Engine:
    """A base model and the LoRA adapters of registered runs, generating in batches."""

    default_model = BASE  # what a request that names no model gets

    def __init__(self, spec: str, runs: list[Path] = (), device: str = "cpu", seed: int = 0,
                 events: Events | None = None):
        if spec.startswith("builtin:") and spec != "builtin:tiny":
            raise EmberError(f"--model {spec!r}: the only builtin model is 'builtin:tiny'")
        if not spec.startswith("builtin:") and not resolve_path(spec).exists():
            raise EmberError(f"--model {spec!r}: no such file or folder; give a Hugging Face model "
                             f"folder, a .gguf file, 'package:DIST:FILE' or 'builtin:tiny'")
        try:
            self.device = pick_device(device)
        except EmberError as e:
            raise EmberError(f"--device {device!r}: {e}") from None
        self.spec, self.seed, self.events = spec, seed, events or Events()
        self.roots = [Path(p) for p in runs]
        check_roots(self.roots, self.events)
        self.lock = threading.Lock()  # held by each decode step (or adapter swap) in progress
        self.model: Any = None        # the base transformers model; set last by load()
        self.tokenizer: Any = None
        self.source: dict[str, Any] = {}
        self.max_positions = 0
        self.eos_ids: set[int] = set()
        self.error: str | None = None  # why load() failed
        self.loaded_at = time.time()
        self._load_lock = threading.Lock()
        self._peft: Any = None  # the peft wrapper around self.model, once an adapter was added
        self._adapters: dict[str, _Adapter] = {}
        self._slots = itertools.count()
        self._active = BASE  # the model name whose adapter is active now
        self.batcher = Batcher(self)

    @property
    def status(self) -> str:
        """'loading', 'ok' or 'failed' (see `error`)."""
        return "ok" if self.model is not None else "failed" if self.error else "loading"

    def load(self) -> None:
        """Load the base model and its tokenizer (seconds, or minutes for a large model)."""
        with self._load_lock:
            if self.model is not None:
                return
            try:
                seed_all(self.seed)  # builtin:tiny is a random init: its runs trained on seed's init
                bundle = load_model(ModelConfig(self.spec), MethodConfig(), False, self.events)
                model = bundle.model.to(self.device).eval()
                model.config.use_cache = True  # training turns the KV cache off; generating wants it
                self.tokenizer, self.source = bundle.tokenizer, bundle.source
                self.max_positions = bundle.max_positions
                self.eos_ids = eos_ids(model, bundle.tokenizer)
                self.loaded_at = time.time()
                self.model = model  # last: status 'ok' means everything above is set
            except Exception as e:  # recorded for /health, and raised on
                self.error = str(e) if isinstance(e, EmberError) else f"{type(e).__name__}: {e}"
                raise

    def runs(self) -> dict[str, Path]:
        """Model name -> run folder, for every run registered now."""
        return find_runs(self.roots)

    def models(self) -> list[dict[str, Any]]:
        """What each servable name is: base, then every LoRA run trained on this base."""
        out = [{"id": BASE, "created": int(self.loaded_at), "kind": "base", "path": self.spec}]
        for name, path in self.runs().items():
            try:
                record = self._servable(name, path)
            except EmberError:  # a full run, or another base's: not servable here, so not listed
                continue
            newest = max((step for step, _ in committed_in(path / "checkpoints")), default=None)
            out.append({"id": name, "created": int(record.get("created", 0)), "kind": "lora",
                        "path": str(path), "checkpoint_step": newest})
        return out

    def loaded_adapters(self) -> dict[str, int]:
        """Model name -> checkpoint step of each adapter in memory."""
        return {name: a.step for name, a in self._adapters.items()}

    def generate(self, model: str, prompt: str | list[dict[str, Any]], sampling: Sampling) -> Generation:
        """A generation from a prompt (text, or chat messages); it runs as it is iterated.
        Everything about the request is checked here, before any output."""
        ids, sampling = self._checked(model, prompt, sampling)
        return Generation(self, model, ids, sampling)

    def next_token_logits(self, model: str, prompt: str) -> torch.Tensor:
        """The model's logits for the token after `prompt`, on the CPU."""
        ids, _ = self._checked(model, prompt, Sampling(max_tokens=1))
        with self.lock:
            self._activate(model)
            with self._adapters_off(model), torch.inference_mode():
                return self.model(torch.tensor([ids], device=self.device)).logits[0, -1].float().cpu()

    # -- requests to tokens -----------------------------------------------------------------

    def _checked(self, model: str, prompt: str | list[dict[str, Any]],
                 sampling: Sampling) -> tuple[list[int], Sampling]:
        """The prompt's tokens and the sampling with max_tokens set, once the request is valid."""
        if self.model is None:
            raise RequestError(f"the model is {self.status}" + (f": {self.error}" if self.error else
                               "; retry when GET /health answers ok"), 503)
        sampling.check()
        self._check_name(model)
        ids = self._encode(prompt)
        room = self.max_positions - len(ids)
        wanted = sampling.max_tokens or min(MAX_TOKENS, room)
        if room < 1:  # with max_tokens unset (a chat's default), `wanted` is no number to show
            raise RequestError(f"the prompt's {len(ids)} tokens leave no room in the model's context of "
                               f"{self.max_positions} tokens for one more; shorten the prompt")
        if wanted > room:
            raise RequestError(f"the prompt's {len(ids)} tokens plus max_tokens = {wanted} are beyond "
                               f"the model's context of {self.max_positions} tokens; shorten the "
                               f"prompt or lower max_tokens")
        return ids, dataclasses.replace(sampling, max_tokens=wanted)

    def _encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        hf = getattr(self.tokenizer, "tok", None)  # None: the byte tokenizer
        templated = isinstance(prompt, list) and hf is not None and bool(hf.chat_template)
        text = chat_text(prompt, self.tokenizer) if isinstance(prompt, list) else prompt
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800" escape decodes to a string no tokenizer can take
            raise RequestError(f"{'messages' if isinstance(prompt, list) else 'prompt'}: holds "
                               f"{text[e.start]!r}, half of a UTF-16 surrogate pair, which is not text; send "
                               f"the character whole (or both halves of its escape)") from None
        if hf is None:
            return [BYTE_EOS, *data]  # the end of a document starts the next
        ids = hf(text, add_special_tokens=not templated)["input_ids"]  # a template has its own
        if not ids:
            raise RequestError("the prompt is empty and the tokenizer adds no start token; give a prompt")
        return ids

    def _decode(self, ids: list[int]) -> str:
        if isinstance(self.tokenizer, ByteTokenizer):
            return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
        return self.tokenizer.tok.decode(ids, skip_special_tokens=True)

    # -- runs and adapters ------------------------------------------------------------------

    def _servable(self, name: str, path: Path) -> dict[str, Any]:
        """The run's record, if its adapter can be served on this base; else RequestError."""
        return servable_record(name, path, self.spec, self.seed, self.source.get("files"))

    def _check_name(self, model: str) -> None:
        """Raise RequestError unless `model` names something this engine serves."""
        if model != BASE:
            self._lora_run(model)

    def _lora_run(self, name: str) -> tuple[Path, MethodConfig]:
        path = self.runs().get(name)
        if path is None:
            raise RequestError(f"model {name!r}: no such model; ask for {BASE!r} or a run folder's "
                               f"name ({', '.join(self.runs()) or 'no runs registered'})", 404)
        return path, lora_method(self._servable(name, path))

    def _activate(self, model: str) -> None:
        """Make `model`'s adapter the active one, loading its newest checkpoint if it changed."""
        self._active = model
        if model == BASE:
            return
        path, method = self._lora_run(model)
        loaded = self._adapters.get(model)
        for step, folder in reversed(committed_in(path / "checkpoints")):
            try:
                key = checkpoint_identity(folder)
                if loaded is not None and loaded.checkpoint == key:
                    self._peft.set_adapter(loaded.slot)
                    return
                weights = verified_weights(folder)
            except (OSError, ValueError) as e:  # retired by the trainer meanwhile, or damaged
                self.events.warn(f"{folder}: not served ({e}); trying the checkpoint before it")
                continue
            self._install(model, method, weights, key, step, folder)
            return
        raise RequestError(f"model {model!r}: {path} has no committed checkpoint that verifies yet; "
                           f"retry after the run commits one", 409)

    def _install(self, model: str, method: MethodConfig, weights: dict[str, torch.Tensor],
                 key: tuple, step: int, folder: Path) -> None:
        from peft import get_peft_model
        slot = f"adapter{next(self._slots)}"
        config = lora_config(method)  # the run's adapter, as training built it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers/peft deprecation chatter
            if self._peft is None:
                self._peft = get_peft_model(self.model, config, adapter_name=slot)  # wraps self.model in place
            else:
                self._peft.add_adapter(slot, config)
        try:
            copy_adapter_weights(self._peft, slot, weights, folder)
        except RequestError:
            self._peft.delete_adapter(slot)
            raise
        self._peft.set_adapter(slot)
        self._peft.eval()
        old = self._adapters.get(model)
        self._adapters[model] = _Adapter(slot, key, step)
        if old is not None:
            self._peft.delete_adapter(old.slot)

    def _serving(self, model: str) -> Any:
        """A context with `model` active as the loop last activated it (no rescan of its run)."""
        if model != self._active:  # next_token_logits activated another one between two steps
            self._activate(model)
        return self._adapters_off(model)

    def _adapters_off(self, model: str) -> Any:
        # With no adapter loaded (the first one failed to), the LoRA layers hold none: that is the base.
        return self._peft.disable_adapter() if model == BASE and self._adapters else nullcontext()

    # -- generating -------------------------------------------------------------------------

    def _run(self, usage: Usage, model: str, ids: list[int], s: Sampling) -> Iterator[str]:
        job = Job(model, ids, s)
        self.batcher.submit(job)
        try:
            job.started()  # its turn came and its model is active (or it was refused)
            yield ""  # what fails from here on is not the request's fault
            yield from self._pieces(usage, job.tokens(), s.stop)
        finally:
            job.cancel()  # a stop string, or the client left: the loop drops it before its next step

    def _pieces(self, usage: Usage, tokens: Iterator[int], stops: tuple[str, ...]) -> Iterator[str]:
        """Text as tokens arrive: a character split across tokens waits for its last byte, and
        text that may begin a stop string is held back until it is known not to."""
        ids: list[int] = []
        sent = 0
        for token in tokens:
            usage.completion_tokens += 1
            if token in self.eos_ids:
                usage.finish_reason = "stop"
                break
            ids.append(token)
            text = self._decode(ids)
            if text.endswith("\ufffd"):
                continue
            cut = _find_stop(text, stops, sent)
            if cut is not None:
                usage.finish_reason = "stop"
                if cut > sent:
                    yield text[sent:cut]
                return
            safe = len(text) - _held_back(text, stops, len(text) - sent)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        else:
            usage.finish_reason = "length"
        text = self._decode(ids)
        cut = _find_stop(text, stops, sent)
        if cut is not None:
            usage.finish_reason = "stop"
        if (cut if cut is not None else len(text)) > sent:
            yield text[sent:cut]


@dataclass
class Usage:
    """Token counts of one generation, and why it ended ('stop' or 'length'; None until it has)."""
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None


class Generation:
    """One request's output as it is made: iterate for pieces of text; `usage` is complete after
    the last one. The first piece is "" once the model is active (or raises if it cannot be);
    `close()` ends the generation early and releases the engine."""

    def __init__(self, engine: Engine, model: str, ids: list[int], sampling: Sampling):
        self.prompt_ids = ids
        self.usage = Usage(len(ids))  # not the Generation itself: its generator must not refer back to it
        self._it = engine._run(self.usage, model, ids, sampling)

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> str:
        return next(self._it)

    def close(self) -> None:
        """Stop generating and release the engine (safe to call more than once)."""
        self._it.close()

    def text(self) -> str:
        """All of the output, once it is complete."""
        return "".join(self)


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The token ids that end a generation: the tokenizer's end of text, and the model's own
    (a list for chat models with an end-of-turn token)."""
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return {tokenizer.eos_id, *eos}


def chat_text(messages: list[dict[str, Any]], tokenizer: Any) -> str:
    """The prompt for chat messages as training and evaluation render a chat (the tokenizer's
    `chat_prompt`: its chat template, the byte model's being ember's own); 'role: content' lines
    for a Hugging Face tokenizer without a template."""
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise RequestError("messages: a non-empty list of {\"role\": str, \"content\": str or text parts}")
    try:  # role and content only: the rest (tool calls, names) is the request's, unchecked
        turns = [{"role": m["role"], "content": content_text(m.get("content"), f"messages[{i}].content")}
                 for i, m in enumerate(messages)]
    except EmberError as e:
        raise RequestError(str(e)) from None
    hf = getattr(tokenizer, "tok", None)
    if hf is not None and not hf.chat_template:
        return "".join(f"{m['role']}: {m['content']}\n" for m in turns) + "assistant:"
    try:
        return tokenizer.chat_prompt(turns)
    except EmberError as e:  # the template's own raise_exception: roles that must alternate, no system turn
        raise RequestError(f"messages: {e}") from None


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Where the first stop string begins in text[start:], or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...], unsent: int) -> int:
    """The length of the longest end of `text`, at most `unsent` characters long, that begins a
    stop string. Bounded by what is unsent, not by the stop's length: a stop string of 250,000
    characters cost 250,000 slices of it for every token (minutes of CPU a request)."""
    return max((k for s in stops for k in range(1, min(len(s), unsent + 1)) if text.endswith(s[:k])), default=0)
