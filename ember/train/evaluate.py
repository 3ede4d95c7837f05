"""Held-out evaluation: the token-weighted loss and perplexity of the model on the eval split,
and greedy completions of the recipe's prompts (kept in OUT/eval/step-N.json with the figures,
and in OUT/eval/generations.jsonl).

The eval split is made when the data is tokenized (ember.data.loader: a seeded hash of each
document's content, or separate files), so no held-out document is ever in the training
stream. Every row of the split is read once, in storage order, packed as training packs. The
loss is the sum over all learned tokens divided by their count, so a row with more learned
tokens weighs more, as in training. Per-row sums and counts are kept (OUT/eval/step-N.json) so
`ember compare` can tell a difference between two runs from the noise of the eval set.

Evaluation draws no random numbers (dropout is off in eval mode; greedy decoding), so a resumed
run evaluates exactly as the uninterrupted one. With several ranks, the data-parallel ranks share
the split's micro-batches (the ones a single process evaluates, so each row's figures are the
same) and gather the results; the generations are made by rank 0 alone.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ember.ckpt.state import DataCursor
from ember.device import autocast
from ember.durable import write_durable
from ember.jsonl import read_jsonl
from ember.metrics.heldout import EVAL_DIR, GENERATIONS
from ember.data.loader import PackedBatches, eval_tokens, resolve_packing, store_info
from ember.data.formats import prompt_tokens
from ember.recipe import DataFormat


@dataclass
class EvalResult:
    step: int
    loss: float | None         # token-weighted mean over the split (None: no learned token in it)
    perplexity: float | None
    tokens: int                # learned tokens evaluated
    rows: int
    seconds: float
    row_loss: list[float]      # per row: summed loss over its learned tokens
    row_tokens: list[int]      # per row: its learned tokens


class Evaluator:
    """The eval split of a job, ready to evaluate at any step."""

    def __init__(self, job: Any):
        self.job = job
        r = job.recipe
        path = eval_tokens(job.tokens_path)
        self.batches = None
        if path is not None:
            self.batches = PackedBatches(path, r.data.seq_len, r.train.micro_batch, 0, DataCursor(),
                                         *resolve_packing(r.data, job.tokens_path))
        self.folder = job.run.path / EVAL_DIR

    @property
    def enabled(self) -> bool:
        return self.batches is not None

    def due(self, step: int, last: bool) -> bool:
        """Whether the loop evaluates after `step` (the recipe's interval, and the end)."""
        ev = self.job.recipe.eval
        return self.enabled and ((ev.every_steps and step % ev.every_steps == 0) or (last and ev.at_end))

    def run(self, step: int) -> EvalResult:
        """Evaluate the live model on the whole split (or [eval] max_batches micro-batches);
        inside `evaluating(model)`."""
        r = self.job.recipe
        t0 = time.perf_counter()
        rows = list(range(self.batches.num_sequences))
        mb = r.train.micro_batch
        groups = [rows[i:i + mb] for i in range(0, len(rows), mb)]
        if r.eval.max_batches:
            groups = groups[:r.eval.max_batches]
        row_loss, row_tokens = self._shared(groups)
        tokens = sum(row_tokens)
        loss = sum(row_loss) / tokens if tokens else None  # over no token there is no loss (not 0.0)
        return EvalResult(step, loss, None if loss is None else math.exp(min(loss, 700.0)), tokens, len(row_tokens),
                          time.perf_counter() - t0, row_loss, row_tokens)

    def _shared(self, groups: list[list[int]]) -> tuple[list[float], list[int]]:
        """split_loss over `groups`, each data-parallel rank taking every dp_size-th micro-batch
        (the same micro-batches a single process evaluates, so the same figures); the results
        gathered in order and handed to every rank. Each rank runs as many forwards as the
        others (FSDP and TP collect inside each): one short of micro-batches repeats its last
        and discards it."""
        job, world = self.job, self.job.world
        if world.dp_size == 1:
            return split_loss(job.model, self.batches, groups, job.device, job.recipe.precision.mode)
        mine: dict[int, tuple[list[float], list[int]]] = {}
        for i in range(-(-len(groups) // world.dp_size)):
            g = world.dp_rank + i * world.dp_size
            group = groups[g] if g < len(groups) else groups[max(0, min(g - world.dp_size, len(groups) - 1))]
            result = split_loss(job.model, self.batches, [group], job.device, job.recipe.precision.mode)
            if g < len(groups):
                mine[g] = result
        everyone = world.gather(mine)  # sync point: the slowest rank's share of the split
        merged: dict[int, tuple[list[float], list[int]]] = {}
        for part in everyone or []:
            merged.update(part)
        ordered = world.broadcast([merged[g] for g in range(len(groups))] if world.main else None)
        return [x for rl, _ in ordered for x in rl], [x for _, rt in ordered for x in rt]

    def save(self, result: EvalResult, generated: list[dict[str, Any]]) -> None:
        """Keep the per-row figures (for `ember compare`) and the generations, durably: one small
        file per evaluation, replaced whole when a resumed run evaluates that step again; the
        generations also in OUT/eval/generations.jsonl, whose lines from this step on (written
        by an attempt that died after them) are replaced, so a resumed run's file is the
        uninterrupted one's."""
        self.folder.mkdir(exist_ok=True)
        figures = {"loss": result.loss, "perplexity": result.perplexity} if result.loss is not None else {}
        write_durable(self.folder / f"step-{result.step:09d}.json", json.dumps(
            {"step": result.step, **figures, "tokens": result.tokens,
             "rows": result.rows, "seconds": round(result.seconds, 6), "generations": generated,
             "row_loss": result.row_loss, "row_tokens": result.row_tokens}))
        if generated:
            path = self.folder / GENERATIONS
            kept = [g for g in read_jsonl(path) if g["step"] < result.step]
            write_durable(path, "".join(json.dumps(g) + "\n" for g in kept + generated))

    def generate(self, step: int) -> list[dict[str, Any]]:
        """Greedy completions of [eval] prompts by the live model (no sampling: reproducible),
        each prompt rendered as the training records were (a chat run's through the chat
        template, with its generation prompt: ember.data.formats.prompt_tokens); the
        unwrapped model, so one rank can generate alone (DDP replicas are whole)."""
        job, ev = self.job, self.job.recipe.eval
        if not ev.prompts:
            return []
        tok, model = job.bundle.tokenizer, job.bundle.model
        fmt = store_info(job.tokens_path).get("format", DataFormat.TEXT)
        out = []
        for prompt in ev.prompts:
            text, prompt_ids = prompt_tokens(prompt, fmt, tok)
            ids = torch.tensor([prompt_ids], device=job.device)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=ev.max_new_tokens, eos_token_id=tok.eos_id,
                                 pad_token_id=tok.eos_id, use_cache=True)
            new = gen[0, ids.shape[1]:].tolist()
            out.append({"step": step, "prompt": prompt, "rendered": text, "completion": tok.decode(new),
                        "tokens": len(new)})
        return out


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout: evaluation draws no random numbers) without autograd, then back
    to training mode whatever happens."""
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train()


def split_loss(model: torch.nn.Module, batches: PackedBatches, groups: list[list[int]], device: torch.device,
               precision: str) -> tuple[list[float], list[int]]:
    """Per row of `groups` (micro-batches of row indices): summed loss over its learned tokens
    and their count; inside `evaluating(model)`."""
    row_loss: list[float] = []
    row_tokens: list[int] = []
    for group in groups:
        b = batches.take(group).to(device)
        with autocast(device, precision):
            extra = {} if b.positions is None else {"position_ids": b.positions}
            logits = model(input_ids=b.ids, use_cache=False, **extra).logits  # no cache: the document mask applies
        labels = b.ids if b.labels is None else b.labels
        per_token = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:],
                                    ignore_index=-100, reduction="none")
        row_loss += per_token.sum(dim=1).tolist()
        row_tokens += (labels[:, 1:] != -100).sum(dim=1).tolist()
    return row_loss, row_tokens
