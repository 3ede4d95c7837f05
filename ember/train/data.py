"""Documents -> tokens -> packed fixed-length sequences -> micro-batches in a seeded order.

The order is a pure function of (seed, epoch): sequence `offset` of epoch `e` is
`permutation(seed, e)[offset]`. So the k-th micro-batch after a cursor is computable
directly, resume jumps straight to its position (O(1) in the position: no replaying or
skipping batches), and worker processes hold no RNG of their own that could drift.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ember import faults
from ember.ckpt.state import DataCursor
from ember.errors import EmberError
from ember.paths import cached_sha256, ember_home
from ember.recipe import DataConfig
from ember.train.model import Tokenizer

TOKEN_DTYPE = np.uint32


def read_documents(path: Path, text_field: str) -> list[str]:
    """A .txt file is one document; a .jsonl file holds one document per line."""
    if not path.is_file():
        raise EmberError(f"[data] files: {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EmberError(f"[data] files: {path} is not UTF-8 text ({e})") from None
    if path.suffix == ".txt":
        return [text] if text.strip() else []
    if path.suffix != ".jsonl":
        raise EmberError(f"[data] files: {path}: unsupported type '{path.suffix}'; use .txt or .jsonl")
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise EmberError(f"[data] files: {path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise EmberError(f"[data] files: {path}:{lineno}: no string field '{text_field}' "
                             f"(set [data] text_field to the field that holds the text)")
        docs.append(record[text_field])
    return docs


def data_fingerprint(files: list[str], tokenizer: Tokenizer) -> str:
    """SHA-256 over every data file's name and content hash, and the tokenizer."""
    h = hashlib.sha256()
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise EmberError(f"[data] files: {path} does not exist")
        h.update(f"{path.name}\0{cached_sha256(path)}\0".encode())
    h.update(tokenizer.fingerprint().encode())
    return h.hexdigest()


def tokenize(cfg: DataConfig, tokenizer: Tokenizer, fingerprint: str) -> Path:
    """Tokenize all documents, each followed by EOS, into one cached .npy stream; return its path."""
    key = hashlib.sha256(f"{fingerprint}\0{cfg.text_field}".encode()).hexdigest()[:32]
    cache = ember_home() / "cache" / "tokens" / f"{key}.npy"
    if cache.is_file():
        return cache
    parts = []
    for f in cfg.files:
        docs = read_documents(Path(f), cfg.text_field)
        for i in range(0, len(docs), 1024):
            for ids in tokenizer.encode_batch(docs[i:i + 1024]):
                parts.append(np.asarray(ids + [tokenizer.eos_id], dtype=TOKEN_DTYPE))
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=TOKEN_DTYPE)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.stem}.{os.getpid()}.npy")
    np.save(tmp, stream)
    os.replace(tmp, cache)  # a cache: atomic, rebuilt if lost, so no fsync
    return cache


class PackedBatches(Dataset):
    """Item k is the k-th micro-batch after `start`: (its ordinal in the whole stream, a
    [micro_batch, seq_len] LongTensor)."""

    def __init__(self, tokens_path: Path, seq_len: int, micro_batch: int, seed: int, start: DataCursor):
        self.tokens = np.load(tokens_path, mmap_mode="r")
        self.seq_len, self.micro_batch, self.seed = seq_len, micro_batch, seed
        self.num_sequences = len(self.tokens) // seq_len  # the ragged tail is dropped
        if self.num_sequences == 0:
            raise EmberError(f"[data] the files hold {len(self.tokens)} tokens, fewer than one "
                             f"sequence of seq_len = {seq_len}; add data or lower [data] seq_len")
        self.start = start.epoch * self.num_sequences + start.offset
        self.first_ordinal = self.start // micro_batch  # cursors always sit between micro-batches

    def __len__(self) -> int:
        return 1 << 62  # endless: epochs follow one another; the sampler bounds it

    def __getitem__(self, k: int) -> tuple[int, torch.Tensor]:
        return self.first_ordinal + k, self.batch(k)

    def batch(self, k: int) -> torch.Tensor:
        faults.data_delay()
        first = self.start + k * self.micro_batch
        rows = []
        for g in range(first, first + self.micro_batch):
            epoch, offset = divmod(g, self.num_sequences)
            i = int(self.permutation(epoch)[offset]) * self.seq_len
            rows.append(self.tokens[i:i + self.seq_len])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    @lru_cache(maxsize=2)
    def permutation(self, epoch: int) -> np.ndarray:
        """The order of sequences in an epoch, from (seed, epoch) alone (PCG64: same everywhere)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)

    def cursor_after(self, micro_batches: int) -> DataCursor:
        """The cursor once `micro_batches` more micro-batches have been consumed from `start`."""
        epoch, offset = divmod(self.start + micro_batches * self.micro_batch, self.num_sequences)
        return DataCursor(epoch, offset)


def _ignore_sigint(_worker_id: int) -> None:
    # Ctrl-C reaches the whole process group; the training process decides what to do with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class SkippingSampler:
    """The next `count` micro-batch indices k, leaving out those whose ordinal is in `skip`."""

    def __init__(self, first_ordinal: int, count: int, skip: set[int]):
        self.first, self.count, self.skip = first_ordinal, count, skip

    def __iter__(self):
        k, given = 0, 0
        while given < self.count:
            if self.first + k not in self.skip:
                yield k
                given += 1
            k += 1

    def __len__(self) -> int:
        return self.count


def make_loader(batches: PackedBatches, count: int, workers: int, pin: bool,
                skip: set[int] = frozenset()) -> DataLoader:
    """Iterate the next `count` micro-batches (not counting skipped ones), in workers if asked."""
    return DataLoader(
        batches, batch_size=None, sampler=SkippingSampler(batches.first_ordinal, count, set(skip)),
        num_workers=workers, pin_memory=pin,
        worker_init_fn=_ignore_sigint if workers else None,
        # Its own generator: otherwise creating the iterator draws from the global torch RNG,
        # and a resumed run's dropout stream would diverge from the uninterrupted run's.
        generator=torch.Generator().manual_seed(0),
        prefetch_factor=4 if workers else None)
