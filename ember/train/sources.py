"""Data files -> shards -> records, read a piece at a time (never a whole corpus in memory).

A shard is a piece of one input that a process reads alone:

    jsonl     a byte range of a .jsonl file, starting at a line start (about SHARD_BYTES)
    text      a whole small .txt file: one document, read at once (as it always was)
    textpart  a byte range of a .txt file above LARGE_TEXT_BYTES, cut at a newline; the file
              is still one document, tokenized in blocks of about TEXT_BLOCK_BYTES cut at newlines
    parquet   one row group of a .parquet file
    arrow     a run of record batches of one .arrow file of a `datasets` folder (save_to_disk)

The plan (the list of shards) depends on the files and these constants alone, never on the
number of worker processes, so the token store is byte-identical for any worker count.
Records keep the semantics of ember.train.formats: a JSONL line, a Parquet or Arrow row (the
same fields: `text` / `messages` / `prompt` + `completion`); rows are numbered from 0, as
`dataset[N]` and pandas number them; JSONL lines from 1, as editors do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.train.formats import detect, read_records

SHARD_BYTES = 4 << 20         # a jsonl / textpart shard (a 1 GB file: 256 shards to share out)
SHARD_ROWS = 100_000          # arrow: record batches are grouped into shards of about this many rows
LARGE_TEXT_BYTES = 64 << 20   # a .txt file above this is read in blocks; a smaller one whole
TEXT_BLOCK_BYTES = 1 << 20    # the blocks a large .txt file is tokenized in
ROWS_PER_READ = 1024          # Parquet / Arrow rows turned into Python records at a time


@dataclass(frozen=True)
class Shard:
    """One piece of one input file, with everything a worker needs to read it alone."""
    file: str           # as the recipe names it
    kind: str           # jsonl, text, textpart, parquet, arrow (see the module docstring)
    start: int          # byte offset; row group; first batch (arrow: of `part`)
    stop: int           # end byte; row group + 1; batch after the last
    first: int          # number of the first line or row (messages)
    fmt: str            # the file's record format
    split: str          # "eval" or "train" for the whole shard, "" when decided per record
    part: str = ""      # arrow: the .arrow file inside the folder
    block: int = 0      # textpart: the block size (in the plan, so every process cuts alike)

    @property
    def where(self) -> str:
        """The prefix of a message about one of this shard's records."""
        return f"{'[eval]' if self.split == 'eval' else '[data]'} files: {self.file}:"

    @property
    def size(self) -> int:
        """Roughly how much work: bytes, or rows x 256."""
        return self.stop - self.start if self.kind in ("jsonl", "textpart", "text") else (self.stop - self.start) * 256


def held_out(record: Any, seed: int, share: float) -> bool:
    """Whether a record is in the held-out share: a seeded hash of its content alone, so no
    other record (and no appended file) moves it between the splits."""
    digest = hashlib.sha256(f"{seed}\0{json.dumps(record, sort_keys=True, default=str)}".encode()).digest()
    return _share(digest) < share


def _share(digest: bytes) -> float:
    return int.from_bytes(digest[:8], "big") / 2**64


def plan(files: list[tuple[str, float]], fmt: str, text_field: str, seed: int) -> tuple[list[Shard], dict[str, str]]:
    """The shards of every (file, held-out share) in order, and each file's record format
    (detected from its first record under `fmt` "auto"); files without records have none."""
    shards: list[Shard] = []
    formats: dict[str, str] = {}
    for f, share in files:
        path = Path(f)
        split = "eval" if share >= 1.0 else ("train" if share <= 0 else "")
        if path.is_dir():
            kind, found = "arrow", _first_row(_arrow_rows(path, _arrow_parts(path)), fmt, text_field, f)
        elif path.suffix == ".parquet":
            kind, found = "parquet", _first_row(_parquet_rows(path, 0, list(range(len(_parquet_groups(path))))), fmt, text_field, f)
        else:  # .txt / .jsonl, and the messages for anything else, from formats.read_records
            large = path.suffix == ".txt" and path.is_file() and path.stat().st_size > LARGE_TEXT_BYTES
            kind = "textpart" if large else ("text" if path.suffix == ".txt" else "jsonl")
            if large and fmt not in ("auto", "text"):
                raise EmberError(f"[data] files: {path}: a .txt file is plain text, not [data] format = {fmt!r}")
            found = "text" if large else next((r[1] for r in read_records(path, fmt, text_field)), None)
        if found is None:
            continue
        formats[f] = found
        if kind == "text":
            shards.append(Shard(f, kind, 0, path.stat().st_size, 1, found, split))
        elif kind in ("jsonl", "textpart"):
            if kind == "textpart" and not split:
                split = "eval" if _text_held_out(path, text_field, seed, share) else "train"
            block = TEXT_BLOCK_BYTES if kind == "textpart" else 0
            shards += [Shard(f, kind, a, b, line, found, split, block=block) for a, b, line in line_ranges(path)]
        elif kind == "parquet":
            row = 0
            for g, rows in enumerate(_parquet_groups(path)):
                shards.append(Shard(f, kind, g, g + 1, row, found, split))
                row += rows
        else:
            shards += _arrow_shards(path, f, found, split)
    return shards, formats


def line_ranges(path: Path) -> list[tuple[int, int, int]]:
    """(start, stop, number of the first line) of byte ranges of about SHARD_BYTES, each
    starting at a line start; one pass over the file, counting newlines."""
    size = path.stat().st_size
    ranges, start, line = [], 0, 1
    with open(path, "rb") as fh:
        while start < size:
            fh.seek(max(start, min(size, start + SHARD_BYTES) - 1))
            stop = min(size, fh.tell() + len(fh.readline()))  # the first line start at or past the target
            fh.seek(start)
            lines, left = 0, stop - start
            while left > 0:
                block = fh.read(min(16 << 20, left))
                lines, left = lines + block.count(b"\n"), left - len(block)
            ranges.append((start, stop, line))
            start, line = stop, line + lines
    return ranges


def records(shard: Shard, text_field: str) -> Iterator[tuple[int, Any]]:
    """(line or row number, record) of each record of a shard, in order; a textpart shard
    gives its blocks of text instead ({text_field: block})."""
    path = Path(shard.file)
    if shard.kind == "text":
        yield from ((n, r) for n, _, r in read_records(path, shard.fmt, text_field))
    elif shard.kind == "textpart":
        yield from ((1, {text_field: b}) for b in text_blocks(path, shard.start, shard.stop, shard.block))
    elif shard.kind == "jsonl":
        yield from _jsonl(path, shard)
    elif shard.kind == "parquet":
        yield from _parquet_rows(path, shard.first, [shard.start])
    else:
        yield from _arrow_rows(path, [shard.part], shard.start, shard.stop, shard.first)


def _jsonl(path: Path, shard: Shard) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as fh:
        fh.seek(shard.start)
        at, lineno = shard.start, shard.first
        for raw in fh:
            if at >= shard.stop:
                return
            at += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise EmberError(f"{shard.where}{lineno}: not UTF-8 text ({e})") from None
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise EmberError(f"{shard.where}{lineno}: not valid JSON ({e.msg})") from None
            lineno += 1


def text_blocks(path: Path, start: int, stop: int, block: int) -> Iterator[str]:
    """The text of bytes [start, stop) of a file in blocks of about `block` bytes, each
    ending at a newline (where there is one), so no block cuts a word or a character."""
    with open(path, "rb") as fh:
        fh.seek(start)
        left, carry = stop - start, b""
        while left > 0 or carry:
            chunk = fh.read(min(block, left))
            left -= len(chunk)
            buf = carry + chunk
            cut = buf.rfind(b"\n") + 1 if left > 0 else len(buf)
            if cut == 0:  # no newline yet: read on (a file of one enormous line is held whole)
                carry = buf
                continue
            try:
                yield buf[:cut].decode("utf-8")
            except UnicodeDecodeError as e:
                raise EmberError(f"[data] files: {path} is not UTF-8 text ({e})") from None
            carry = buf[cut:]


def _text_held_out(path: Path, text_field: str, seed: int, share: float) -> bool:
    """held_out({text_field: the whole file}) without holding the file: json.dumps escapes
    character by character, so the escaped blocks, joined, are the escaped whole."""
    h = hashlib.sha256(f"{seed}\0{{{json.dumps(text_field)}: \"".encode())
    for text in text_blocks(path, 0, path.stat().st_size, TEXT_BLOCK_BYTES):
        h.update(json.dumps(text)[1:-1].encode())
    h.update(b"\"}")
    return _share(h.digest()) < share


def _first_row(rows: Iterator[tuple[int, Any]], fmt: str, text_field: str, f: str) -> str | None:
    for n, record in rows:
        found = fmt if fmt != "auto" else detect(record, text_field)
        if found is None:
            raise EmberError(f"[data] files: {f}:row {n}: no 'messages' (chat), 'prompt' and 'completion', "
                             f"or '{text_field}' (text) column; set [data] format and [data] text_field to match")
        return found
    return None


def _parquet_groups(path: Path) -> list[int]:
    """Rows in each row group of a Parquet file."""
    import pyarrow.parquet as pq
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError...: all mean "not a readable Parquet file"
        raise EmberError(f"[data] files: {path}: not a readable Parquet file ({e})") from None
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def _parquet_rows(path: Path, first: int, groups: list[int]) -> Iterator[tuple[int, Any]]:
    """(row number, record) of the given row groups, ROWS_PER_READ at a time."""
    import pyarrow.parquet as pq
    if not groups:
        return
    n = first
    for batch in pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_READ, row_groups=groups):
        for record in batch.to_pylist():
            yield n, record
            n += 1


def _arrow_parts(folder: Path) -> list[str]:
    """The .arrow files of a `datasets` save_to_disk folder, in order (from its state.json)."""
    state = folder / "state.json"
    if not state.is_file():
        raise EmberError(f"[data] files: {folder}: a folder, but not a Hugging Face dataset saved with "
                         f"save_to_disk (no state.json); give .jsonl, .txt or .parquet files, or such a folder")
    try:
        parts = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise EmberError(f"[data] files: {state}: not a datasets state.json ({e})") from None
    if json.loads(state.read_text()).get("_indices_data_files"):
        raise EmberError(f"[data] files: {folder}: a dataset with an indices mapping; save it with "
                         f"save_to_disk after flatten_indices()")
    return parts


def _open_stream(path: Path) -> Any:
    import pyarrow as pa
    # Memory-mapped: a batch is read from the page cache when it is used, not copied in first.
    return pa.ipc.open_stream(pa.memory_map(str(path)))


def _arrow_shards(folder: Path, f: str, fmt: str, split: str) -> list[Shard]:
    shards, row = [], 0
    for part in _arrow_parts(folder):
        reader, first_batch, rows, b = _open_stream(folder / part), 0, 0, 0
        for b, batch in enumerate(reader):
            rows += batch.num_rows
            if rows >= SHARD_ROWS:
                shards.append(Shard(f, "arrow", first_batch, b + 1, row, fmt, split, part))
                row, rows, first_batch = row + rows, 0, b + 1
        if rows:
            shards.append(Shard(f, "arrow", first_batch, b + 1, row, fmt, split, part))
            row += rows
    return shards


def _arrow_rows(folder: Path, parts: list[str], start: int = 0, stop: int | None = None,
                first: int = 0) -> Iterator[tuple[int, Any]]:
    """(row number, record) of batches [start, stop) of each part, ROWS_PER_READ at a time."""
    n = first
    for part in parts:
        for b, batch in enumerate(_open_stream(folder / part)):
            if b < start:
                continue
            if stop is not None and b >= stop:
                break
            for at in range(0, batch.num_rows, ROWS_PER_READ):
                for record in batch.slice(at, ROWS_PER_READ).to_pylist():
                    yield n, record
                    n += 1
