"""`[train] compile`: the step's forward and loss through torch.compile (inductor), and what
compiling cost.

What is compiled: `causal_lm_loss` (ember.train.loss) with the model inside it, so the model's
forward, the loss and, through AOTAutograd, their backward are inductor kernels. The module the
run keeps is never wrapped: its state-dict names, and so the checkpoint format, stay those of
the eager model (torch.compile's OptimizedModule would prefix `_orig_mod.`); evaluation and
generation run it eagerly (their shapes vary; they run rarely). The optimizer step, gradient
clipping and the loss scaler stay eager: on 2 CPU cores the fused AdamW step is a few % of a
LoRA step, and compiling it costs tens of seconds more.

The rule for "auto" (`wanted`): eager on every device, until a measurement shows compiling pays.
On an H200 (bench/gpu.sh, 2026-12-04: bf16, Qwen2.5-0.5B's shape, 8 x 2048 tokens, deterministic
on) the compiled step was slower for full fine-tuning (314 ms against 253 eager) and 11% faster
for LoRA (315 ms against 354) after a compile of 74-104 s, which a LoRA run repays only after
~2,700 steps; on a CPU compiling takes tens of seconds on a few cores. What it does buy is
memory: the compiled step's peak was half the eager one's (28.8 against 58.8 GiB allocated),
the loss's fp32 logits fused away. Ask for it with `compile = true`.

Inductor's caches (FX graphs, AOTAutograd, the generated C++/Triton) live in
$EMBER_HOME/cache/inductor (`Home.inductor_cache`), so a resumed or repeated run loads the
kernels instead of compiling them again; a TORCHINDUCTOR_CACHE_DIR set by the user wins.

The seconds spent compiling (dynamo's start/end callbacks, lazy backward compiles included)
are ledger events of kind `compile`: the goodput bucket `compile`, taken out of the step that
paid them. Graph breaks (torch._dynamo.utils.counters) are counted and said, never hidden.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import torch

from ember.paths import home
from ember.train.dropout import eager_when_compiled
from ember.train.loss import causal_lm_loss

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def wanted(setting: bool | str) -> bool:
    """Whether `[train] compile` compiles the step: `true` only ("auto" is eager on every device,
    as measured: see the module's docstring)."""
    return setting is True


class Eager:
    """Stands in for a Compiler when the step runs eagerly: the plain loss, nothing to report."""
    loss = staticmethod(causal_lm_loss)

    def drain(self) -> list[tuple[float, float]]:
        return []

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class Compiler:
    """The compiled loss and a record of the compiles it did (their spans; `summary`). Its
    callbacks are process-wide: a run's Compiler lives as long as its process; `close` ends it."""

    def __init__(self, backend: str = "inductor") -> None:
        use_cache_dir()
        import torch._dynamo
        eager_when_compiled()  # LoRA's keyed dropout stays eager
        from torch._dynamo.utils import counters
        self.counters = counters
        self.before = snapshot(counters)  # the counters are per process: this run's are the difference
        self.spans: list[tuple[float, float]] = []
        self.seconds = 0.0
        self._began = 0.0
        handler = torch._dynamo.callback_handler
        self._start, self._end = handler.register_start_callback(self._on_start), handler.register_end_callback(self._on_end)
        self._compiled = torch.compile(causal_lm_loss, backend=backend)

    def loss(self, model: torch.nn.Module, batch: Any, loss_chunk: int = 0, normalizer: float | None = None) -> torch.Tensor:
        """causal_lm_loss, compiled; the normalizer travels as a tensor (a float that changes
        every step would otherwise be a guard, and a recompile)."""
        if normalizer is not None:
            ids = batch if isinstance(batch, torch.Tensor) else batch.ids
            normalizer = torch.tensor(float(normalizer), dtype=torch.float32, device=ids.device)
        return self._compiled(model, batch, loss_chunk, normalizer)

    def _on_start(self, args: Any) -> None:
        self._began = time.time()

    def _on_end(self, args: Any) -> None:
        end = time.time()
        self.spans.append((self._began, end))
        self.seconds += end - self._began

    def drain(self) -> list[tuple[float, float]]:
        """The compile spans since the last call (each a ledger event)."""
        spans, self.spans = self.spans, []
        return spans

    def summary(self) -> dict[str, Any]:
        """This process's compile figures: seconds, graphs, graph breaks and their reasons,
        inductor's and AOTAutograd's cache hits and misses."""
        now = snapshot(self.counters)
        d = {k: now[k] - self.before.get(k, 0) for k in now}
        breaks = {k[len("graph_break/"):]: v for k, v in d.items() if k.startswith("graph_break/") and v}
        return {"seconds": round(self.seconds, 3), "graphs": d.get("stats/unique_graphs", 0),
                "graph_breaks": sum(breaks.values()), "break_reasons": breaks,
                "fx_cache_hits": d.get("inductor/fxgraph_cache_hit", 0),
                "fx_cache_misses": d.get("inductor/fxgraph_cache_miss", 0),
                "aot_cache_hits": d.get("aot_autograd/autograd_cache_hit", 0),
                "aot_cache_misses": d.get("aot_autograd/autograd_cache_miss", 0),
                "cache_dir": os.environ.get(CACHE_VARIABLE)}

    def close(self) -> None:
        """Stop timing compiles (the callbacks are process-wide)."""
        import torch._dynamo
        handler = torch._dynamo.callback_handler
        for registered, fn in ((handler.start_callbacks, self._start), (handler.end_callbacks, self._end)):
            if fn in registered:
                registered.remove(fn)


def snapshot(counters: Any) -> Counter[str]:
    """torch._dynamo's counters flattened to 'group/name' -> count."""
    return Counter({f"{group}/{name}": n for group, c in counters.items() for name, n in c.items()})


def use_cache_dir() -> str:
    """Point inductor's caches at $EMBER_HOME/cache/inductor, unless the user chose a folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    current = os.environ.get(CACHE_VARIABLE)
    if current is None or current == default_cache_dir():  # unset, or torch's own default
        folder = home().inductor_cache
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_VARIABLE] = str(folder)
    return os.environ[CACHE_VARIABLE]


def build(setting: bool | str) -> Compiler | Eager:
    """A Compiler when the recipe wants one (`wanted`), else Eager."""
    return Compiler() if wanted(setting) else Eager()


def described(summary: dict[str, Any]) -> str:
    """One line of what compiling the step did."""
    hits, misses = summary["fx_cache_hits"] + summary["aot_cache_hits"], summary["fx_cache_misses"] + summary["aot_cache_misses"]
    return (f"compiled the step (torch.compile, inductor) in {summary['seconds']:.1f} s: {summary['graphs']} "
            f"graph(s), {summary['graph_breaks']} graph break(s); compile cache {summary['cache_dir']}: "
            f"{hits} hit(s), {misses} miss(es)")


def break_warning(summary: dict[str, Any]) -> str | None:
    """The warning for graph breaks (each runs eagerly between compiled graphs), or None."""
    if not summary["graph_breaks"]:
        return None
    reasons = sorted(summary["break_reasons"].items(), key=lambda kv: -kv[1])[:3]
    return (f"the compiled step has {summary['graph_breaks']} graph break(s), which run eagerly between "
            f"compiled graphs: " + "; ".join(f"{n}x {why.strip().splitlines()[0]}" for why, n in reasons)
            + " (all reasons: run.json's compile.ATTEMPT.break_reasons)")
