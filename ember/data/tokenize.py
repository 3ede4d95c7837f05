"""The sharded, streaming, resumable writer of a token store (layout: ember.data.loader).

    plan (ember.data.sources) -> shards tokenized by a process pool into WORK/ -> assemble -> rename

WORK is `.<key>.work/` beside the store. Its states, changed only by this module:

    absent --build--> WORK/plan.json (the shard list; a different plan empties WORK first)
    shard i missing --worker--> WORK/i.tmp<pid>/ --rename--> WORK/i/ (committed: never rewritten)
    every shard committed --assemble--> .<key>.<pid>/ --rename--> <key>/ (the store), WORK removed
    a failure (a bad record, a worker that died, any exception) --> WORK and .<key>.<pid>/ removed

The store is complete when its info.json is there: written last, inside the temporary folder,
before the rename (a folder at <key>/ without it, left by an older build, is replaced). A
tokenization killed at any point (the process that runs it: SIGKILL, a power cut) leaves
committed shards and at most some .tmp folders (removed when seen); run again, only the missing
shards are tokenized. Every bad record is listed in one error: once one is found, the shards not
yet begun are only checked (formats.check, no tokenizer) and nothing more is committed.

A shard holds raw little-endian files per split: `tokens` (uint32), `targets` (uint8, absent
when all are learned), `lengths` (int64 per document) and `info.json` with their counts. The store's .npy
files are one header followed by the shards' raw bytes in order: nothing is held whole in
memory, and the bytes do not depend on how many processes tokenized them. A cache, like the
store: renames for atomicity, no fsync (a power cut costs a re-tokenization, not a wrong
store: a shard whose files do not match its counts is redone).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from array import array
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ember import faults
from ember.durable import fsync_dir, fsync_file
from ember.errors import EmberError
from ember.events import Events
from ember.lock import acquire
from ember.proc import born_blocking, die_with_parent, ended_only_by
from ember.data.formats import _field, check, encode, run_format
from ember.recipe import DataFormat
from ember.data.progress import Progress
from ember.data.sources import MAX_LISTED, Shard, bad_records, forget_readers, held_out, plan, records

SPLITS = ("train", "eval")
TEXT_BATCH = 256            # plain-text records per tokenizer call (the fast tokenizers' batch path)
FLUSH_TOKENS = 1 << 20      # tokens buffered per split before they are appended to the shard's files
POOL_MIN_BYTES = 8 << 20    # below this much input, a process pool costs more than it saves
U32 = next(c for c in "IL" if array(c).itemsize == 4)  # the array typecode of the store's uint32 tokens


def build(files: list[tuple[str, float]], cfg: Any, tokenizer: Any, seed: int, store: Path,
          events: Events, workers: int) -> None:
    """Tokenize (file, held-out share) pairs into the token store `store`, resuming the
    shards a previous, interrupted build committed. One process builds a store at a time: a
    second one waits (a lock per store, dropped by the kernel however the holder ends), then
    uses the store the first built, or resumes its work folder if it died."""
    locks = store.parent.parent / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = acquire(locks / f"tokens-{store.name}", f"the token store {store}", wait=lambda pid: events.info(
        f"another process (PID {pid}) is tokenizing the same data into {store}; waiting for it"))
    try:
        if not (store / "info.json").is_file():  # else: built while this process waited
            _build(files, cfg, tokenizer, seed, store, events, workers)
    finally:
        lock.release()


def _build(files: list[tuple[str, float]], cfg: Any, tokenizer: Any, seed: int, store: Path,
           events: Events, workers: int) -> None:
    shards, formats = plan(files, cfg.format, cfg.text_field, seed)
    fmt = run_format(formats)  # chat and completion files mixed: every record a conversation
    shards = [s if s.fmt == fmt else replace(s, fmt=fmt) for s in shards]
    work = store.with_name(f".{store.name}.work")
    for stale in store.parent.glob(f".{store.name}.*"):  # a killed assemble's (this process holds the lock)
        if stale != work:
            shutil.rmtree(stale, ignore_errors=True)
    plan_json = json.dumps([asdict(s) for s in shards], indent=0)
    if not (work / "plan.json").is_file() or (work / "plan.json").read_text() != plan_json:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        (work / "plan.json").write_text(plan_json)
    todo = [i for i in range(len(shards)) if shard_info(work / f"{i:06d}") is None]
    big = sum(shards[i].nbytes for i in todo) >= POOL_MIN_BYTES
    procs = max(1, min(workers, len(todo))) if big else 1
    events.stage(f"tokenizing {len(todo)} of {len(shards)} shard(s) with {procs} process(es)",
                 shards=len(shards), todo=len(todo), done=len(shards) - len(todo), workers=procs)
    if fmt == DataFormat.TEXT and hasattr(tokenizer, "text_encoder"):
        tokenizer = tokenizer.text_encoder()  # plain text needs the ids and the EOS alone
    # The held-out share of each file whose records are split one by one (a file may also be in
    # [eval] files, read whole there: its share there is not this one).
    args = (tokenizer, cfg.text_field, cfg.train_on, seed, {f: s for f, s in files if 0 < s < 1})
    progress = Progress(events, sum(shards[i].nbytes for i in todo))
    try:
        found = _run(shards, todo, work, args, procs, progress)
        count = sum(f.bad_count for f in found.values())
        if count:
            raise bad_records([m for i in sorted(found) for m in found[i].bad][:MAX_LISTED], count)
        assemble(shards, work, store, fmt, formats)
    except Exception:
        # A failure leaves nothing behind. A killed build (no exception here) leaves its committed
        # shards, which the next build of the same data resumes from.
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store.with_name(f".{store.name}.{os.getpid()}"), ignore_errors=True)  # assemble's
        raise
    shutil.rmtree(work, ignore_errors=True)
    progress.finish(procs)


def _run(shards: list[Shard], todo: list[int], work: Path, args: tuple, procs: int,
         progress: Progress) -> dict[int, Found]:
    """The missing shards, in this process or a pool of `procs`: what each found. Once a bad
    record is found, the shards not yet begun are only checked (their bad records listed too);
    a failure raises the first in input order once the shards begun have ended."""
    found: dict[int, Found] = {}
    if procs == 1:
        for i in todo:
            checking = any(f.bad_count for f in found.values())
            found[i] = tokenize_shard(shards[i], None if checking else work / f"{i:06d}", *args)
            progress.shard(found[i].records, shards[i].nbytes)
        forget_readers()
        return found
    failed = _in_pool(shards, todo, work, args, procs, progress, found)
    if any(isinstance(e, BrokenProcessPool) for e in failed.values()):
        raise EmberError("a tokenization worker process died (killed, or out of memory); its work is removed: "
                         "run again (with fewer [data] tokenize_workers if memory ran out)")
    if failed:
        raise failed[min(failed)]
    return found


def _in_pool(shards: list[Shard], todo: list[int], work: Path, args: tuple, procs: int, progress: Progress,
             found: dict[int, Found]) -> dict[int, BaseException]:
    """_run's pool of `procs`: fills `found`; the shards that failed, with why."""
    # spawn, not fork: the parent may hold torch's and the tokenizer's threads, which a fork
    # would copy mid-flight; each worker imports what it needs once.
    # The tokenizer goes to each worker once, with the initializer: pickled with every shard, it
    # cost ~0.35 s a shard to rebuild (a tenth of a 4 MB shard's tokenization).
    pool = ProcessPoolExecutor(procs, mp_context=get_context("spawn"), initializer=_worker_init,
                               initargs=(os.getpid(), *args))
    failed: dict[int, BaseException] = {}
    # The pool spawns its workers as shards are submitted: born with SIGTERM blocked (ember.proc),
    # they take in hand a group SIGTERM sent during their start-up. This process acts on a stop
    # only once the data is tokenized (ember.train.signals): its own SIGTERM may wait as long.
    with born_blocking(signal.SIGTERM):
        try:
            running = {pool.submit(_tokenize_in_worker, shards[i], work / f"{i:06d}"): i for i in todo}
            checking = False
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    i = running.pop(fut)
                    if fut.cancelled():
                        continue
                    if fut.exception() is not None:
                        failed[i] = fut.exception()
                        for other in running:  # those not begun never begin
                            other.cancel()
                        continue
                    found[i] = fut.result()
                    progress.shard(found[i].records, shards[i].nbytes)
                    if found[i].bad_count and not checking:  # the rest: only checked
                        checking = True
                        for other, j in list(running.items()):
                            if other.cancel():
                                del running[other]
                                running[pool.submit(_tokenize_in_worker, shards[j], None)] = j
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return failed


_WORKER_ARGS: tuple = ()  # in a worker process: the arguments of tokenize_shard after the shard's


def _worker_init(parent: int, *args: Any) -> None:
    global _WORKER_ARGS
    die_with_parent(signal.SIGKILL, parent)  # a run killed mid-tokenization takes its workers along
    # Ctrl-C (and a terminal's hang-up) reaches the whole process group; the parent decides (it
    # stops the pool). So does a SIGTERM to the group, but the pool's shutdown ends a straggler
    # with SIGTERM too: ember.proc says why this tells the two apart.
    ended_only_by(parent, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # One thread per worker process: the pool is the parallelism (and a fork-safe tokenizer).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ARGS = args


def _tokenize_in_worker(shard: Shard, out: Path | None) -> Found:
    return tokenize_shard(shard, out, *_WORKER_ARGS)


class SplitWriter:
    """One split of one shard: token ids, targets and document lengths appended to raw files
    as they come, FLUSH_TOKENS at a time. Buffered in C arrays, not lists of Python ints, and
    the targets only once a token is not learned (plain text: never)."""

    def __init__(self, folder: Path):
        self.folder, self.files = folder, {}
        self.ids = array(U32)
        self.targets: bytearray | None = None  # 1 per buffered token the loss learns; None: all are
        self.lengths = array("q")
        self.open = 0  # tokens of the document being written
        self.counts = {"documents": 0, "tokens": 0, "targets": 0, "joins": 0}

    def add(self, ids: list[int], targets: list[bool] | None) -> None:
        if self.targets is None and targets is not None and not all(targets):
            self.targets = bytearray(b"\1") * len(self.ids)
        if self.targets is not None:
            self.targets += bytes(targets) if targets is not None else b"\1" * len(ids)
        self.ids.extend(ids)
        self.open += len(ids)
        if len(self.ids) >= FLUSH_TOKENS:
            self.flush()

    def end_document(self) -> None:
        self.lengths.append(self.open)
        self.open = 0

    def flush(self) -> None:
        if not (self.ids or self.lengths):
            return
        n = len(self.ids)
        learned = n if self.targets is None else self.targets.count(1)
        if learned < n and "targets" not in self.files:
            # The first unlearned token: the tokens before it were all learned.
            self._file("targets").write(b"\1" * self.counts["tokens"])
        self._file("tokens").write(_little(self.ids))
        if "targets" in self.files:
            self.files["targets"].write(self.targets if self.targets is not None else b"\1" * n)
        self._file("lengths").write(_little(self.lengths))
        self.counts["tokens"] += n
        self.counts["targets"] += learned
        self.counts["documents"] += len(self.lengths)
        self.ids, self.targets, self.lengths = array(U32), None, array("q")

    def _file(self, name: str) -> BinaryIO:
        if name not in self.files:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.files[name] = open(self.folder / name, "wb")
        return self.files[name]

    def close(self) -> dict[str, int]:
        self.flush()
        for fh in self.files.values():
            fh.close()
        return self.counts


@dataclass
class Found:
    """What tokenizing (or checking) one shard found."""
    records: int = 0
    bad: list[str] = field(default_factory=list)   # the first MAX_LISTED bad records: file:line: what
    bad_count: int = 0

    def add(self, message: str) -> None:
        self.bad_count += 1
        if len(self.bad) < MAX_LISTED:
            self.bad.append(message)


def tokenize_shard(shard: Shard, out: Path | None, tokenizer: Any, text_field: str, train_on: str,
                   seed: int, shares: dict[str, float]) -> Found:
    """Tokenize one shard into `out` (written under a temporary name, then renamed): what it
    found. With `out` None, or from its first bad record on, its records are only checked
    (formats.check) and nothing is committed, so that every bad record is listed at once."""
    found = Found()
    if out is None and shard.kind == "textpart":
        return found  # plain text: nothing to check
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}") if out is not None else None
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    writers = {name: SplitWriter(tmp / name) for name in SPLITS} if tmp is not None else {}
    share = shares.get(shard.file, 0.0)  # (used where the shard's split is decided per record)
    if shard.kind == "textpart":  # a piece of a document: joined to the one before, its EOS if it is the last
        w = writers[shard.split]
        for _, block in records(shard, text_field):
            w.add(tokenizer.encode_batch([block[text_field]])[0], None)
        if shard.stop == shard.end:
            w.add([tokenizer.eos_id], None)
            found.records = 1
        w.end_document()
        w.counts["joins"] = int(shard.start > shard.first)
    else:
        texts: list[tuple[str, str]] = []  # plain-text records waiting for one batched tokenizer call
        for n, record in records(shard, text_field):
            where = f"{shard.where}{'row ' if shard.kind in ('parquet', 'arrow') else ''}{n}"
            found.records += 1
            try:
                if isinstance(record, EmberError):  # a line that is not a record
                    raise record
                if tmp is None or found.bad_count:
                    check(record, shard.fmt, text_field, where)
                    continue
                split = shard.split or ("eval" if share > 0 and held_out(record, seed, share) else "train")
                if shard.fmt == DataFormat.TEXT:  # encode() for text, batched: the same ids, one call per TEXT_BATCH
                    texts.append((split, _field(record, text_field, where)))
                    if len(texts) >= TEXT_BATCH:
                        _encode_texts(texts, tokenizer, writers)
                    continue
                enc = encode(record, shard.fmt, tokenizer, text_field, train_on, where)
                writers[split].add(enc.ids, enc.targets)
                writers[split].end_document()
            except EmberError as e:
                found.add(str(e))
        if not found.bad_count:
            _encode_texts(texts, tokenizer, writers)
    info = {name: w.close() for name, w in writers.items()}
    if tmp is None or found.bad_count:  # nothing to commit
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return found
    (tmp / "info.json").write_text(json.dumps(info))
    faults.point("tokenize.shard")  # killed here: this shard is redone, the committed ones are kept
    try:
        os.rename(tmp, out)
    except OSError:  # another build committed it first (the same bytes)
        shutil.rmtree(tmp, ignore_errors=True)
    return found


def _little(a: array) -> bytes:
    """An array's bytes little-endian, as the store keeps them."""
    if sys.byteorder == "big":
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _encode_texts(texts: list[tuple[str, str]], tokenizer: Any, writers: dict[str, SplitWriter]) -> None:
    for (split, _), ids in zip(texts, tokenizer.encode_batch([t for _, t in texts]) if texts else []):
        writers[split].add(ids + [tokenizer.eos_id], None)
        writers[split].end_document()
    texts.clear()


def shard_info(folder: Path) -> dict[str, Any] | None:
    """A committed shard's counts, or None if it is missing or its files do not match them."""
    if not (folder / "info.json").is_file():
        return None
    info = json.loads((folder / "info.json").read_text())
    for name, c in info.items():
        sizes = {"tokens": 4 * c["tokens"], "lengths": 8 * c["documents"],
                 "targets": c["tokens"] if c["targets"] < c["tokens"] else 0}
        for f, size in sizes.items():
            path = folder / name / f
            if (path.stat().st_size if path.is_file() else 0) != size:
                return None
    return info


def assemble(shards: list[Shard], work: Path, store: Path, fmt: DataFormat, formats: dict[str, DataFormat]) -> None:
    """The store from the committed shards: each .npy one header, then the shards' bytes; `fmt`
    the run's format, `formats` each file's."""
    tmp = store.with_name(f".{store.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    parts = [work / f"{i:06d}" for i in range(len(shards))]
    infos = [shard_info(p) for p in parts]
    info: dict[str, Any] = {"format": fmt, "files": formats}
    for name in SPLITS:
        counts = [i[name] for i in infos]
        docs = sum(c["documents"] - c["joins"] for c in counts)
        tokens, learned = sum(c["tokens"] for c in counts), sum(c["targets"] for c in counts)
        if name != "train" and docs == 0:
            continue
        folder = tmp / name
        folder.mkdir(parents=True)
        with _npy(folder / "tokens.npy", "<u4", tokens) as fh:
            for p in parts:
                _append(fh, p / name / "tokens")
        if learned < tokens:
            with _npy(folder / "targets.npy", "|u1", tokens) as fh:
                for p, c in zip(parts, counts):
                    if c["targets"] < c["tokens"]:
                        _append(fh, p / name / "targets")
                    else:
                        fh.write(np.ones(c["tokens"], dtype=np.uint8).tobytes())
        with _npy(folder / "docs.npy", "<i8", docs + 1) as fh:
            at = 0
            for p, c in zip(parts, counts):
                lengths = np.fromfile(p / name / "lengths", dtype="<i8") if c["documents"] else np.zeros(0, "<i8")
                starts = at + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") if len(lengths) else lengths
                fh.write(starts[c["joins"]:].tobytes())
                at += int(lengths.sum())
            fh.write(np.asarray([at], dtype="<i8").tobytes())
        info[name] = {"documents": docs, "tokens": tokens, "targets": learned}
    (tmp / "info.json").write_text(json.dumps(info, indent=1))  # the store is complete when it is there
    # Its bytes on disk before the name that says it is complete: renamed first, a power cut could
    # leave a store whose files are short or zeros (a run then failed on it, or trained on zeros).
    for f in sorted(tmp.rglob("*")):
        (fsync_dir if f.is_dir() else fsync_file)(f)
    fsync_dir(tmp)
    try:
        os.rename(tmp, store)
    except OSError:
        if (store / "info.json").is_file():  # another process finished it first
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # a folder without the marker (an older build's): not a store, replaced
            shutil.rmtree(store)
            os.rename(tmp, store)
    fsync_dir(store.parent)


def damaged(store: Path) -> str | None:
    """What is wrong with a complete token store (its files against the counts in info.json), or
    None: a store cut short, or files lost or put there by hand, is found before a run reads it.
    (Every byte is not read: a store of the right sizes with other bytes is not found.)"""
    try:
        info = json.loads((store / "info.json").read_text())
        for name in SPLITS:
            if name not in info:
                continue
            c, folder = info[name], store / name
            tokens = np.load(folder / "tokens.npy", mmap_mode="r")
            if len(tokens) != c["tokens"]:
                return f"{name}/tokens.npy holds {len(tokens)} tokens, info.json {c['tokens']}"
            docs = np.load(folder / "docs.npy", mmap_mode="r")
            if len(docs) != c["documents"] + 1 or int(docs[0]) != 0 or int(docs[-1]) != c["tokens"] \
                    or bool(np.any(np.diff(docs) < 0)):
                return f"{name}/docs.npy does not mark {c['documents']} documents over {c['tokens']} tokens"
            if c["targets"] < c["tokens"]:
                targets = np.load(folder / "targets.npy", mmap_mode="r")
                if len(targets) != c["tokens"]:
                    return f"{name}/targets.npy holds {len(targets)} marks for {c['tokens']} tokens"
    except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _npy(path: Path, descr: str, n: int) -> BinaryIO:
    """A 1-d .npy file of n items, its header written (the same header np.save writes)."""
    fh = open(path, "wb")
    np.lib.format.write_array_header_1_0(fh, {"descr": descr, "fortran_order": False, "shape": (n,)})
    return fh


def _append(fh: BinaryIO, path: Path) -> None:
    if path.is_file():
        with open(path, "rb") as src:
            shutil.copyfileobj(src, fh, 16 << 20)
