"""Records -> tokens (a cached store, ember.data.tokenize) -> rows -> micro-batches in a seeded order.

A row is a seq_len cut of the token stream (packing "mixed"), a pack of whole documents with
restarting positions (packing "documents"), or one document (packing "padded"); a micro-batch
carries the labels the loss learns (-100 elsewhere) and the positions.

The order is a pure function of (seed, epoch): row `offset` of epoch `e` is
`order(e)[offset]`. So the k-th micro-batch after a cursor is computable directly, resume
jumps straight to its position (O(1) in the position: no replaying or skipping batches), and
worker processes hold no RNG of their own that could drift.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ember import faults
from ember.ckpt.state import DataCursor
from ember.errors import EmberError
from ember.events import Events
from ember.paths import home
from ember.proc import born_blocking, die_with_parent, ended_only_by
from ember.recipe import DataConfig, DataFormat, EvalConfig
from ember.scratch import for_this_process
from ember.data.formats import _field, read_records
from ember.data.tokenizer import Tokenizer
from ember.data.sources import held_out, source_sha256  # noqa: F401  (held_out re-exported: the split rule)
from ember.data.tokenize import build, damaged
from ember.data.truncation import pieces

TOKEN_DTYPE = np.uint32
STORE_VERSION = 6  # the store's layout and encoding, in the cache key (3: one end of turn per chat turn;
#                   4: a .txt file's held-out share in blocks; 5: a .txt file's line ends as written, no BOM;
#                   6: a record holding a special token's text is refused: a store of one read it as the token)


def read_documents(path: Path, text_field: str) -> list[str]:
    """A .txt file is one document; a .jsonl file holds one document per line (plain text)."""
    return [_field(r, text_field, f"[data] files: {path}:{n}") for n, _, r in read_records(path, DataFormat.TEXT, text_field)]


def data_fingerprint(files: list[str], tokenizer: Tokenizer) -> str:
    """SHA-256 over every data file's name and content hash, and the tokenizer."""
    h = hashlib.sha256()
    for f in files:
        path = Path(f)
        if not path.exists():
            raise EmberError(f"[data] files: {path} does not exist")
        h.update(f"{path.name}\0{source_sha256(path)}\0".encode())
    h.update(tokenizer.fingerprint().encode())
    return h.hexdigest()


def tokenize(cfg: DataConfig, tokenizer: Tokenizer, fingerprint: str, events: Events | None = None,
             ev: EvalConfig | None = None) -> Path:
    """Encode every record (ember.data.formats) once into a cached token store; return the path
    of its training stream. The store is a folder: `train/` and, when [eval] holds documents out
    or names files, `eval/`, each with tokens.npy (the documents one after another, uint32),
    docs.npy (where each starts, and the end) and targets.npy (1 where the loss learns a token;
    absent when every token is learned), and `info.json` with the counts. Built streaming, by
    shards in [data] tokenize_workers processes, resumable (ember.data.tokenize)."""
    ev = ev or EvalConfig()
    held = {f: source_sha256(Path(f)) for f in ev.files if Path(f).exists()}
    trained_on(cfg.files, held)
    eval_ids = "\0".join(f"{f}:{h}" for f, h in held.items())
    key = hashlib.sha256(f"{fingerprint}\0{cfg.text_field}\0{cfg.format}\0{cfg.train_on}\0{STORE_VERSION}\0"
                         f"{ev.holdout}\0{ev.seed}\0{eval_ids}\0{tokenizer.fingerprint(rendering=True)}"
                         .encode()).hexdigest()[:32]
    store = home().token_cache(key)
    if (store / "info.json").is_file() and (problem := damaged(store)) is not None:
        # A cache: what was lost is tokenized again (the same tokens: the data's and the tokenizer's)
        (events or Events()).warn(f"token cache {store} is damaged ({problem}): tokenizing the data again")
        shutil.rmtree(store, ignore_errors=True)
    if not (store / "info.json").is_file():
        if events is not None:
            events.stage(f"tokenizing {len(cfg.files) + len(ev.files)} data file(s) once into {store.parent}",
                         files=len(cfg.files))
        workers = cfg.tokenize_workers or len(os.sched_getaffinity(0))
        build([(f, ev.holdout) for f in cfg.files] + [(f, 1.0) for f in ev.files], cfg, tokenizer, ev.seed,
              store, events or Events(), workers)
    if ev.holdout and not ev.files and not (store / "eval").is_dir():
        # Refused like a .txt file too short to share out (ember.data.sources): the run would
        # evaluate nothing, and [eval] patience and prompts would do nothing, without a word.
        n = json.loads((store / "info.json").read_text())["train"]["documents"]
        raise EmberError(f"[eval] holdout = {ev.holdout:g} held out none of the {n} records (each is held out by a "
                         f"seeded hash of its content: about {ev.holdout * n:.1f} expected), so there is nothing to "
                         f"evaluate on; add records, raise [eval] holdout, or name held-out files in [eval] files "
                         f"and set [eval] holdout = 0")
    return store / "train" / "tokens.npy"


def trained_on(files: list[str], held: dict[str, str]) -> None:
    """Refuse an [eval] file (`held`: each with its SHA-256) that is a [data] file, or a copy of
    one: its held-out loss would be over what the model trains on, and early stopping and
    keep_best would follow it."""
    by_path = {os.path.realpath(f): f for f in files}
    by_content = {source_sha256(Path(f)): f for f in files if Path(f).exists()}
    for f, digest in held.items():
        same, how = by_path.get(os.path.realpath(f)), "the same file as"
        if same is None:
            same, how = by_content.get(digest), "a copy of"
        if same is not None:
            raise EmberError(f"[eval] files: {f} is {how} [data] files' {same}: a held-out loss over the data the "
                             f"model trains on says nothing of what it learned. Name a file kept out of [data] "
                             f"files, or set [eval] holdout to hold out a share of each [data] file's records")


def store_info(tokens_path: Path) -> dict[str, Any]:
    """The token store's info.json (an empty dict for a bare stream)."""
    info = tokens_path.parent.parent / "info.json"
    return json.loads(info.read_text()) if info.is_file() else {}


def eval_tokens(tokens_path: Path) -> Path | None:
    """The held-out stream beside a training stream, if the store has one."""
    path = tokens_path.parent.parent / "eval" / "tokens.npy"
    return path if path.is_file() else None


def resolve_packing(cfg: DataConfig, tokens_path: Path) -> tuple[str, str]:
    """(packing, rule for a document longer than seq_len) for this recipe and store."""
    fmt = store_info(tokens_path).get("format", DataFormat.TEXT)
    packing = cfg.packing if cfg.packing != "auto" else ("mixed" if fmt == DataFormat.TEXT else "documents")
    return packing, ("split" if fmt == DataFormat.TEXT else cfg.long_records)


@dataclass
class MicroBatch:
    """Rows of token ids, with what the loss learns and where each document starts."""
    ids: torch.Tensor                       # [rows, width]
    labels: torch.Tensor | None = None      # -100 where nothing is learned; None: every token (labels = ids)
    positions: torch.Tensor | None = None   # restart at 0 for each document; None: 0..width-1
    first: int = 0                          # the stream position of its first row (keys LoRA's dropout)

    def to(self, device: torch.device, non_blocking: bool = False) -> MicroBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)
        return MicroBatch(move(self.ids), move(self.labels), move(self.positions), self.first)

    def pin_memory(self) -> MicroBatch:
        pin = lambda t: None if t is None else t.pin_memory()
        return MicroBatch(pin(self.ids), pin(self.labels), pin(self.positions), self.first)

    def targets(self) -> int:
        """Positions whose next token the loss learns (every one but the last of a row)."""
        if self.labels is None:
            return self.ids.shape[0] * (self.ids.shape[1] - 1)
        return int((self.labels[:, 1:] != -100).sum())

    def part(self, i: int, parts: int) -> MicroBatch:
        """Its i-th of `parts` equal slices of rows (a rank's share of a micro-batch: RankShare)."""
        n = self.ids.shape[0] // parts
        take = lambda t: None if t is None else t[i * n:(i + 1) * n]
        return MicroBatch(take(self.ids), take(self.labels), take(self.positions), self.first + i * n)

    def rows(self, n: int) -> MicroBatch:
        """`n` rows: these, repeated as often as needed (the doctor's larger micro-batches)."""
        take = lambda t: None if t is None else torch.cat([t] * -(-n // t.shape[0]))[:n]
        return MicroBatch(take(self.ids), take(self.labels), take(self.positions))


class PackedBatches(Dataset):
    """Item k is the k-th micro-batch after `start`: (its ordinal in the whole stream, a
    MicroBatch of [micro_batch, seq_len] rows; padded packing: as wide as its longest row).

    A "sequence" is a row: a seq_len cut of the stream (mixed), a pack of whole documents
    (documents), or one document (padded). The cursor counts rows."""

    def __init__(self, tokens_path: Path, seq_len: int, micro_batch: int, seed: int, start: DataCursor,
                 packing: str = "mixed", long_rule: str = "split"):
        self.tokens = np.load(tokens_path, mmap_mode="r")
        self.folder = folder = Path(tokens_path).parent
        self.targets = np.load(folder / "targets.npy", mmap_mode="r") if (folder / "targets.npy").is_file() else None
        self.seq_len, self.micro_batch, self.seed, self.packing = seq_len, micro_batch, seed, packing
        self.notes: dict[str, int] = {}
        if packing == "mixed":
            self.num_sequences = len(self.tokens) // seq_len  # the ragged tail is dropped
        else:
            self.piece_start, self.piece_len, self.piece_record, self.pack_start, notes = rows_of(
                str(tokens_path), seq_len, packing, long_rule)
            self.notes = dict(notes)
            self.num_sequences = len(self.pack_start) - 1
        if self.num_sequences == 0:
            if folder.name == "eval":  # the store's held-out split (ember.data.loader.tokenize)
                raise EmberError(f"[eval] the held-out documents hold {len(self.tokens)} tokens, fewer than one "
                                 f"sequence of seq_len = {seq_len}; hold out more ([eval] holdout), add [eval] "
                                 f"files, or lower [data] seq_len")
            held = " for training (the others are held out for evaluation)" if (folder.parent / "eval").is_dir() else ""
            raise EmberError(f"[data] the files hold {len(self.tokens)} tokens{held}, fewer than one "
                             f"sequence of seq_len = {seq_len}; add data or lower [data] seq_len")
        self.start = start.epoch * self.num_sequences + start.offset
        self.first_ordinal = self.start // micro_batch  # cursors always sit between micro-batches

    def __len__(self) -> int:
        return 1 << 62  # endless: epochs follow one another; the sampler bounds it

    def __getitem__(self, item: int | tuple[int, int, int]) -> tuple[int, MicroBatch]:
        """Micro-batch k, or (k, i, parts): its i-th of `parts` slices of rows (RankShare)."""
        k, i, parts = item if isinstance(item, tuple) else (item, 0, 1)
        batch = self.batch(k)
        return self.first_ordinal + k, batch if parts == 1 else batch.part(i, parts)

    def batch(self, k: int) -> MicroBatch:
        faults.data_delay()
        rows = self.rows_at(self.first_ordinal + k)
        return dataclasses.replace(self.take(rows), first=self.start + k * self.micro_batch)

    def rows_at(self, ordinal: int) -> list[int]:
        """The rows (sequence indices, in storage order) of micro-batch `ordinal` of the stream."""
        first = self.start + (ordinal - self.first_ordinal) * self.micro_batch
        return [int(self.order(g // self.num_sequences)[g % self.num_sequences])
                for g in range(first, first + self.micro_batch)]

    def records_in(self, rows: list[int]) -> list[int]:
        """The records (documents of the split, numbered from 0) these rows hold parts of."""
        if self.packing == "mixed":
            docs = self.folder / "docs.npy"
            starts = np.load(docs, mmap_mode="r") if docs.is_file() else np.array([0, len(self.tokens)])
            return sorted({int(d) for r in rows for d in range(
                int(np.searchsorted(starts, r * self.seq_len, side="right")) - 1,
                int(np.searchsorted(starts, (r + 1) * self.seq_len, side="left")))})
        return sorted({int(self.piece_record[p]) for r in rows
                       for p in range(self.pack_start[r], self.pack_start[r + 1])})

    def take(self, rows: list[int]) -> MicroBatch:
        """The micro-batch of these rows (sequence indices, in storage order)."""
        if self.packing == "mixed":
            ids = np.stack([self.tokens[i * self.seq_len:(i + 1) * self.seq_len] for i in rows]).astype(np.int64)
            if self.targets is None:
                return MicroBatch(torch.from_numpy(ids))
            learned = np.stack([self.targets[i * self.seq_len:(i + 1) * self.seq_len] for i in rows])
            return MicroBatch(torch.from_numpy(ids), torch.from_numpy(np.where(learned == 1, ids, -100)))
        return self._packed(rows)

    def _packed(self, rows: list[int]) -> MicroBatch:
        """Whole documents per row: positions restart at each (and at the padding, its own
        segment), so the model's attention is block-diagonal; no label crosses a document."""
        width = self.seq_len
        if self.packing == "padded":
            width = max(int(self.piece_len[self.pack_start[r]]) for r in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        labels = np.full((len(rows), width), -100, dtype=np.int64)
        positions = np.zeros((len(rows), width), dtype=np.int64)
        for row, r in enumerate(rows):
            at = 0
            for p in range(self.pack_start[r], self.pack_start[r + 1]):
                s, n = int(self.piece_start[p]), int(self.piece_len[p])
                chunk = np.asarray(self.tokens[s:s + n], dtype=np.int64)
                ids[row, at:at + n] = chunk
                learned = chunk if self.targets is None else np.where(self.targets[s:s + n] == 1, chunk, -100)
                labels[row, at:at + n] = learned
                labels[row, at] = -100  # the previous document's last token predicts nothing here
                positions[row, at:at + n] = np.arange(n)
                at += n
            positions[row, at:] = np.arange(width - at)
        return MicroBatch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(positions))

    @lru_cache(maxsize=2)
    def order(self, epoch: int) -> np.ndarray:
        """The rows of an epoch in order, from (seed, epoch) alone (PCG64: same everywhere)."""
        perm = self.permutation(epoch)
        if self.packing != "padded":
            return perm
        # Length-sorted buckets of 64 micro-batches, then the micro-batches in a seeded order.
        lengths = self.piece_len[perm]
        bucket = self.micro_batch * 64
        sorted_rows = np.concatenate([perm[i:i + bucket][np.argsort(-lengths[i:i + bucket], kind="stable")]
                                      for i in range(0, len(perm), bucket)])
        batches = [sorted_rows[i:i + self.micro_batch] for i in range(0, len(sorted_rows), self.micro_batch)]
        shuffle = np.random.default_rng([self.seed, epoch, 1]).permutation(len(batches))
        return np.concatenate([batches[i] for i in shuffle])

    @lru_cache(maxsize=2)
    def permutation(self, epoch: int) -> np.ndarray:
        """The order of sequences in an epoch, from (seed, epoch) alone (PCG64: same everywhere)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)

    def cursor_after(self, micro_batches: int) -> DataCursor:
        """The cursor once `micro_batches` more micro-batches have been consumed from `start`."""
        epoch, offset = divmod(self.start + micro_batches * self.micro_batch, self.num_sequences)
        return DataCursor(epoch, offset)


@lru_cache(maxsize=4)
def rows_of(tokens_path: str, seq_len: int, packing: str, long_rule: str) -> tuple[np.ndarray, ...]:
    """(piece starts, piece lengths, the record of each piece, where each row's first piece is,
    notes) of a store packed by whole documents, long ones cut by `long_rule`
    (ember.data.truncation): O(documents) work, done once per process (the run's notes, the
    loop's batches and the evaluator all read the same layout)."""
    folder = Path(tokens_path).parent
    docs = np.load(folder / "docs.npy") if (folder / "docs.npy").is_file() else \
        np.array([0, len(np.load(tokens_path, mmap_mode="r"))])
    targets = np.load(folder / "targets.npy", mmap_mode="r") if (folder / "targets.npy").is_file() else None
    notes: dict[str, int] = {}
    start, length, record = pieces(docs, seq_len, long_rule, notes, targets)
    packs = greedy_packs(length, seq_len) if packing == "documents" else np.arange(len(length) + 1)
    for a in (start, length, record, packs):
        a.flags.writeable = False  # shared by every PackedBatches of this process
    return start, length, record, packs, notes


def greedy_packs(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Consecutive documents into rows of at most seq_len tokens, in order; where each row's
    first document is, and the end."""
    bounds, fill = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if fill + n > seq_len:
            bounds.append(i)
            fill = 0
        fill += n
    bounds.append(len(lengths))
    return np.asarray(sorted(set(bounds)), dtype=np.int64)


# An AF_UNIX socket's path holds at most 107 bytes, and multiprocessing puts a worker's at
# FOLDER/pymp-XXXXXXXX/listener-XXXXXXXX: 32 more.
SOCKET_FOLDER_MAX = 107 - 32


def _workers_tmp() -> str | None:
    """The folder the loader workers' multiprocessing folders go in (`_worker_start`): this
    process's scratch folder, unless its path is too long for the socket a worker binds in it
    (then None: tempfile's own, as before)."""
    folder = str(for_this_process("loader-"))
    return folder if len(os.fsencode(folder)) <= SOCKET_FOLDER_MAX else None


def _worker_start(parent: int, tmp: str | None, _worker_id: int) -> None:
    # Ctrl-C (and a terminal's hang-up) reaches the whole process group; the training process
    # decides what to do with it. So does a SIGTERM to the group (a service manager's stop), but
    # the training process's shutdown ends a straggler with SIGTERM too: ember.proc says why
    # this tells the two apart.
    ended_only_by(parent, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # A SIGKILLed training process takes its workers along at once, not at torch's next
    # watchdog check (up to 5 s later). (The run folder's lock is not theirs: ember.lock.)
    die_with_parent(signal.SIGKILL, parent)
    # multiprocessing makes this worker a folder for the socket its batches' file descriptors
    # are handed over by (pymp-*), under tempfile's folder, and removes it at the worker's exit;
    # a worker killed with its training process cannot. Here it sits in the training process's
    # scratch folder, which the next one made under $EMBER_HOME removes with it (ember.scratch).
    if tmp is not None:
        tempfile.tempdir = tmp


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


def row_parts(grad_accum: int, ranks: int) -> int:
    """Into how many equal slices of rows each micro-batch is cut so that one step's grad_accum
    micro-batches share out evenly over `ranks` data-parallel ranks: 1 (whole micro-batches)
    when grad_accum is a multiple of ranks. The recipe's batch is global either way: a step
    trains the same rows at any world size (micro_batch x grad_accum must be a multiple of
    ranks, which makes micro_batch a multiple of the parts: ember.train.sharding checks it)."""
    return ranks // math.gcd(grad_accum, ranks)


class RankShare:
    """Rank `rank`'s part of a sampler's stream: the items at positions rank, rank + ranks, ...
    Every rank reads a disjoint part of the one global order, and the step's micro-batches
    (grad_accum of them) are shared out the same way at any world size. With `parts` > 1 the
    items are the micro-batches' slices of rows, (k, i, parts), micro-batch by micro-batch."""

    def __init__(self, sampler: SkippingSampler, rank: int, ranks: int, parts: int = 1):
        self.sampler, self.rank, self.ranks, self.parts = sampler, rank, ranks, parts

    def __iter__(self):
        for j, k in enumerate(self.sampler):
            for i in range(self.parts):
                if (j * self.parts + i) % self.ranks == self.rank:
                    yield k if self.parts == 1 else (k, i, self.parts)

    def __len__(self) -> int:
        return len(self.sampler) * self.parts // self.ranks


class _Loader(DataLoader):
    """A DataLoader whose workers are born with SIGTERM blocked (they are forked when an iterator
    starts): one sent to the group before a worker set itself up (`_worker_start`) waits for it,
    where it would kill it (or run the training process's stop handler, copied by the fork)."""

    def __iter__(self):
        with born_blocking(signal.SIGTERM):
            return super().__iter__()


def make_loader(batches: PackedBatches, count: int, workers: int, pin: bool,
                skip: set[int] = frozenset(), rank: int = 0, ranks: int = 1, parts: int = 1) -> DataLoader:
    """Iterate this rank's share of the next `count` micro-batches (not counting skipped ones),
    in workers if asked; `parts`: row_parts() of the run."""
    sampler = SkippingSampler(batches.first_ordinal, count, set(skip))
    return _Loader(
        batches, batch_size=None, sampler=RankShare(sampler, rank, ranks, parts) if ranks > 1 else sampler,
        num_workers=workers, pin_memory=pin,
        worker_init_fn=partial(_worker_start, os.getpid(), _workers_tmp()) if workers else None,
        # Its own generator: otherwise creating the iterator draws from the global torch RNG,
        # and a resumed run's dropout stream would diverge from the uninterrupted run's.
        generator=torch.Generator().manual_seed(0),
        prefetch_factor=4 if workers else None)
