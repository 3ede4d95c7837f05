"""The causal-LM loss, plain or memory-efficient.

The plain loss (transformers') materialises batch x seq x vocab logits and keeps the fp32
log-softmax for backward; with a two-gradient backward on top, those tensors are the peak of
most small-model steps. `loss_chunk > 0` computes the same mean cross-entropy over chunks of
that many tokens, each under activation checkpointing: only one chunk's logits exist at a
time, in forward and in backward (recomputed there), at the cost of running the output layer
twice. The mean is summed in a different order, so it differs from the plain loss in the last
bits: changing `train.loss_chunk` changes the run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def causal_lm_loss(model: nn.Module, batch: Any, loss_chunk: int = 0, normalizer: float | None = None) -> torch.Tensor:
    """Next-token cross-entropy of a micro-batch (ember.data.loader.MicroBatch, or a LongTensor of
    ids): summed over the positions whose next token is learned, divided by `normalizer` (the
    step's learned positions, so a step's micro-batches add up to its token-weighted mean; None:
    this micro-batch's own count, its mean)."""
    ids = batch if isinstance(batch, torch.Tensor) else batch.ids
    labels = ids if isinstance(batch, torch.Tensor) or batch.labels is None else batch.labels
    positions = None if isinstance(batch, torch.Tensor) else batch.positions
    extra = {} if positions is None else {"position_ids": positions}
    if loss_chunk <= 0:
        return model(input_ids=ids, labels=labels, num_items_in_batch=normalizer, **extra).loss
    hidden = model.get_decoder()(input_ids=ids, **extra).last_hidden_state
    head = model.get_output_embeddings()
    flat = hidden.reshape(-1, hidden.shape[-1])  # a view: no copy of the hidden states
    targets = F.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)  # the last position predicts nothing
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], loss_chunk):
        end = start + loss_chunk
        total = total + checkpoint(_chunk_loss, head, flat[start:end], targets[start:end], use_reentrant=False)
    return total / (normalizer if normalizer is not None else (targets != -100).sum())


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=-100, reduction="sum")
