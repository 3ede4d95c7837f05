"""LoRA's dropout with masks that do not depend on which rank computes a row.

peft's LoRA layers apply `lora_dropout[adapter]` (an nn.Dropout, drawing from the process's
torch RNG) to their input: one process and N ranks (each its own stream) drop different units,
so a distributed run left the cross-world tolerance. `install` puts a KeyedDropout in each one's
place: the mask of a row is drawn from a generator seeded by (seed, step, the row's global
sample index, the layer's number), so whichever rank computes a row, and however the step's rows
are shared out, the same units are dropped; a resumed run draws what the uninterrupted one drew
with no RNG state to save. Same p and expectation as nn.Dropout (kept units scaled by 1/(1-p)).

The loop says which rows the next forward computes (`DropoutKeys.at`) before each micro-batch;
activation checkpointing's recomputation, inside that micro-batch's backward, draws the same.
Under tensor parallelism a row-wise layer's input is this rank's slice of the last dimension
(`split` = (index, parts), set by ember.parallel.tp): the whole row's mask is drawn and the
slice kept, so every rank drops what one process drops there.
"""

from __future__ import annotations

import hashlib
import struct

import torch
from torch import nn


class DropoutKeys:
    """The step and the global index of the first row of the micro-batch being computed."""

    def __init__(self, seed: int = 0):
        self.seed, self.step, self.first = seed, 0, 0

    def at(self, step: int, first: int) -> None:
        """The next forward computes rows first, first + 1, ... of the stream, in `step`."""
        self.step, self.first = step, first


def row_seed(seed: int, step: int, sample: int, layer: int) -> int:
    """A 63-bit generator seed from the key: the same on every machine and world size."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, step, sample, layer), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class KeyedDropout(nn.Module):
    """Dropout whose mask for row r of its input is a function of (keys, r, layer) alone."""

    def __init__(self, p: float, keys: DropoutKeys, layer: int):
        super().__init__()
        self.p, self.keys, self.layer = p, keys, layer
        self.split = (0, 1)  # (index, parts) of the last dimension this rank's input holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        k = self.keys
        index, parts = self.split
        width = x.shape[-1]
        masks = []
        for row in range(x.shape[0]):
            g = torch.Generator(device=x.device)
            g.manual_seed(row_seed(k.seed, k.step, k.first + row, self.layer))
            whole = torch.rand((*x.shape[1:-1], width * parts), generator=g, device=x.device)
            masks.append(whole[..., index * width:(index + 1) * width] >= self.p)
        return x * torch.stack(masks).to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}" + (f", split={self.split}" if self.split[1] > 1 else "")


def eager_when_compiled() -> None:
    """Keep KeyedDropout's forward out of torch.compile's graphs (its keys change every step: a
    recompile each step otherwise). Called when a compiled step is set up (ember.train.compiled):
    marking it at import would import torch._dynamo, 0.75 s, into every run that never compiles."""
    global _EAGER
    if not _EAGER:
        KeyedDropout.forward = torch.compiler.disable(KeyedDropout.forward)
        _EAGER = True


_EAGER = False


def install(model: nn.Module, seed: int) -> DropoutKeys:
    """Replace every LoRA layer's nn.Dropout with a KeyedDropout sharing one DropoutKeys (numbered
    in module order, the same in every process); a model without LoRA dropout is left as is."""
    keys = DropoutKeys(seed)
    number = 0
    for module in model.modules():
        table = getattr(module, "lora_dropout", None)
        if not isinstance(table, nn.ModuleDict):
            continue
        for name, dropout in list(table.items()):
            if isinstance(dropout, nn.Dropout):
                table[name] = KeyedDropout(dropout.p, keys, number)
                number += 1
    return keys
