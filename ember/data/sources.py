"""Data files -> shards -> records, read a piece at a time (never a whole corpus in memory).

A shard is a piece of one input, about SHARD_BYTES of it, that a process reads alone:

    jsonl     a byte range of a .jsonl file, starting at a line start
    text      a whole .txt file up to LARGE_TEXT_BYTES: one document, read at once
    textpart  a byte range of a .txt file cut at a newline: a piece of one document (a larger
              file, or a run of blocks of one split, below), tokenized in blocks of about
              TEXT_BLOCK_BYTES cut at newlines
    parquet   a range of rows of a .parquet file (within a row group or across several)
    arrow     a range of rows of one .arrow file of a `datasets` folder (save_to_disk)

Rows are cut by bytes too: a Parquet row group's (uncompressed) bytes, or an Arrow record
batch's, are shared equally among its rows, so a 95 MB file of one row group is ~24 shards.
The plan (the list of shards) depends on the files and these constants alone, never on the
number of worker processes, so the token store is byte-identical for any worker count.

A held-out share between 0 and 1 holds out each record by a seeded hash of its content
(held_out). A .txt file is one document, too few to share out, so the .txt files of a share are
cut at line ends into about HOLDOUT_BLOCKS blocks, and exactly round(share x blocks) of them,
those with the smallest seeded content hashes, are held out; each held-out block, and each run
of training blocks between them, is a document. Text too short to give both splits a block is
refused with the reason, never held out at 0% or 100%.

Records keep the semantics of ember.data.formats: a JSONL line, a Parquet or Arrow row (the
same fields: `text` / `messages` / `prompt` + `completion`); rows are numbered from 0, as
`dataset[N]` and pandas number them; JSONL lines from 1, as editors do. A JSONL line that is not
a record (not UTF-8, not JSON) comes as an EmberError in place of the record, so that a reader
can list every bad line, not only the first.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.paths import cached_sha256
from ember.data.formats import BLANK, BOM, detect, parse_line, read_records
from ember.recipe import DataFormat

SHARD_BYTES = 4 << 20         # a shard (a 1 GB file: 256 shards to share out)
LARGE_TEXT_BYTES = 64 << 20   # a .txt file above this is read in blocks; a smaller one whole
TEXT_BLOCK_BYTES = 1 << 20    # the blocks a textpart shard is tokenized in
HOLDOUT_BLOCKS = 200          # a held-out share of .txt files: blocks to choose from (0.5% each)...
HOLDOUT_BLOCK_MIN = 1 << 10   # ...of at least this many bytes, and at most TEXT_BLOCK_BYTES
ROWS_PER_READ = 1024          # Parquet / Arrow rows turned into Python records at a time
MAX_LISTED = 20               # bad records listed in one error (every one is counted)


@dataclass(frozen=True)
class Shard:
    """One piece of one input file, with everything a worker needs to read it alone. A record
    of the plan (its plan.json), not a call site: each kind uses the fields its comment names."""
    file: str           # as the recipe names it
    kind: str           # jsonl, text, textpart, parquet, arrow (see the module docstring)
    start: int          # byte offset; parquet: first row of the file; arrow: first row of `part`
    stop: int           # end byte; the row after the last
    first: int          # number of the first line or row (messages); textpart: its document's start
    fmt: DataFormat     # the file's record format
    split: str          # "eval" or "train" for the whole shard, "" when decided per record
    nbytes: int         # about how many bytes of input: progress, and whether a pool pays
    part: str = ""      # arrow: the .arrow file inside the folder
    block: int = 0      # textpart: the block size (in the plan, so every process cuts alike)
    end: int = 0        # textpart: its document's end (the EOS follows)

    @property
    def where(self) -> str:
        """The prefix of a message about one of this shard's records."""
        return f"{'[eval]' if self.split == 'eval' else '[data]'} files: {self.file}:"


def held_out(record: Any, seed: int, share: float) -> bool:
    """Whether a record is in the held-out share: a seeded hash of its content alone, so no
    other record (and no appended file) moves it between the splits."""
    digest = hashlib.sha256(f"{seed}\0{json.dumps(record, sort_keys=True, default=str)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def bad_records(listed: list[str], count: int) -> EmberError:
    """One error for `count` bad records: the first ones' messages (`file:line: what`), and the count."""
    if count == 1:
        return EmberError(listed[0])
    more = f"\n  ... and {count - len(listed)} more" if count > len(listed) else ""
    return EmberError(f"{count} bad records in the data files; fix or remove them and run again:\n  "
                      + "\n  ".join(listed) + more)


def plan(files: list[tuple[str, float]], fmt: DataFormat, text_field: str, seed: int) -> tuple[list[Shard], dict[str, DataFormat]]:
    """The shards of every (file, held-out share) in order, and each file's record format
    (detected from its first record under `fmt` "auto"); a file with no record is refused."""
    shards: list[Shard] = []
    formats: dict[str, str] = {}
    texts = _held_out_texts(files, fmt, seed)
    for f, share in files:
        path = Path(f)
        split = "eval" if share >= 1.0 else ("train" if share <= 0 else "")
        section = "[eval]" if share >= 1.0 else "[data]"
        if not path.exists():
            raise EmberError(f"{section} files: {path} does not exist")
        if path.suffix == ".txt" and fmt not in (DataFormat.AUTO, DataFormat.TEXT):
            raise EmberError(f"{section} files: {path}: a .txt file is plain text, not [data] format = '{fmt}'")
        if f in texts and 0 < share < 1:  # (the same file in [eval] files is read whole there)
            found, new = DataFormat.TEXT, texts[f]
        elif path.is_dir():
            found, new = _arrow_plan(path, f, fmt, text_field, split)
        elif path.suffix == ".parquet":
            found, new = _parquet_plan(path, f, fmt, text_field, split)
        elif path.suffix == ".txt":
            found, new = DataFormat.TEXT, _text_plan(path, f, split)
        else:
            found, new = _jsonl_plan(path, f, fmt, text_field, split, f"{section} files: {f}:")
        if not new:
            raise EmberError(f"{section} files: {f} holds no records (it is empty, or blank); "
                             f"fill it, or take it out of {section} files")
        formats[f] = found
        shards += new
    return shards, formats


def _cuts(path: Path, size: int, start: int, stop: int) -> list[tuple[int, int]]:
    """Byte ranges covering [start, stop), each of about `size` bytes, cut after a newline."""
    out = []
    with open(path, "rb") as fh:
        while start < stop:
            fh.seek(max(start, min(stop, start + size) - 1))
            end = min(stop, fh.tell() + len(fh.readline()))  # the first line start at or past the target
            out.append((start, end))
            start = end
    return out


def line_ranges(path: Path) -> list[tuple[int, int, int]]:
    """(start, stop, number of the first line) of byte ranges of about SHARD_BYTES, each
    starting at a line start; one pass over the file, counting newlines."""
    ranges, line = [], 1
    with open(path, "rb") as fh:
        for start, stop in _cuts(path, SHARD_BYTES, 0, path.stat().st_size):
            fh.seek(start)
            lines, left = 0, stop - start
            while left > 0:
                block = fh.read(min(16 << 20, left))
                lines, left = lines + block.count(b"\n"), left - len(block)
            ranges.append((start, stop, line))
            line += lines
    return ranges


def _jsonl_plan(path: Path, f: str, fmt: DataFormat, text_field: str, split: str,
                where: str) -> tuple[DataFormat | None, list[Shard]]:
    if path.suffix != ".jsonl":
        raise EmberError(f"{where} unsupported type '{path.suffix}'; use .txt, .jsonl, .parquet or a "
                         f"`datasets` folder")
    bad, unknown = [], None  # lines that are not records; the first record of no known format
    for n, record in _jsonl(path, 0, path.stat().st_size, 1, where):
        if isinstance(record, EmberError):  # listed with the others when the shards are read
            bad.append(str(record))
            continue
        found = fmt if fmt != DataFormat.AUTO else detect(record, text_field)
        if found is None:  # the records before the first of a known format are listed as bad ones
            unknown = unknown or n
            continue
        return found, [Shard(f, "jsonl", a, b, line, found, split, b - a) for a, b, line in line_ranges(path)]
    if unknown is not None:
        raise EmberError(f"{where}{unknown}: no 'messages' (chat), 'prompt' and 'completion', or "
                         f"'{text_field}' (text) field in any record; set [data] format and [data] "
                         f"text_field to match the records")
    if bad:  # not one good line
        raise bad_records(bad[:MAX_LISTED], len(bad))
    return None, []


def _text_plan(path: Path, f: str, split: str) -> list[Shard]:
    size = path.stat().st_size
    if size > LARGE_TEXT_BYTES:
        return [Shard(f, "textpart", a, b, 0, DataFormat.TEXT, split, b - a, block=TEXT_BLOCK_BYTES, end=size)
                for a, b in _cuts(path, SHARD_BYTES, 0, size)]
    if next(read_records(path, DataFormat.TEXT, "text"), None) is None:  # blank
        return []
    return [Shard(f, "text", 0, size, 1, DataFormat.TEXT, split, size)]


def _held_out_texts(files: list[tuple[str, float]], fmt: DataFormat, seed: int) -> dict[str, list[Shard]]:
    """The shards of the .txt files of each held-out share between 0 and 1 (module docstring)."""
    out: dict[str, list[Shard]] = {}
    for share in sorted({s for _, s in files if 0 < s < 1}):
        # A file listed twice is cut once (each listing then reads the same blocks), not as two copies in a row.
        texts = list(dict.fromkeys(f for f, s in files if s == share and f.endswith(".txt") and Path(f).is_file()))
        if not texts or fmt not in (DataFormat.AUTO, DataFormat.TEXT):
            continue  # (plan refuses a .txt file under another format)
        out.update({f: [] for f in texts})
        texts = [f for f in texts if Path(f).stat().st_size > LARGE_TEXT_BYTES  # a blank file holds no record
                 or next(read_records(Path(f), DataFormat.TEXT, "text"), None)]
        total = sum(Path(f).stat().st_size for f in texts)
        size = max(HOLDOUT_BLOCK_MIN, min(TEXT_BLOCK_BYTES, total // HOLDOUT_BLOCKS))
        blocks = [(f, a, b) for f in texts for a, b in _cuts(Path(f), size, 0, Path(f).stat().st_size)]
        k = round(share * len(blocks))
        if blocks and not 0 < k < len(blocks):
            raise EmberError(f"[eval] holdout = {share:g}: {', '.join(texts)} cut at line ends into blocks of "
                             f"about {size:,} bytes gives {len(blocks)} block(s), too few to hold out {share:.1%} "
                             f"of the text (a split would get all or nothing); add text, or name held-out "
                             f"files in [eval] files and set [eval] holdout = 0")
        keys = [_block_key(Path(f), a, b, seed) for f, a, b in blocks]
        held = set(sorted(range(len(blocks)), key=lambda i: (keys[i], i))[:k])
        i = 0
        while i < len(blocks):  # a run: blocks of one file and one split in a row, one document
            f, a, _ = blocks[i]
            j = i
            while j + 1 < len(blocks) and blocks[j + 1][0] == f and ((j + 1) in held) == (i in held):
                j += 1
            split, b = "eval" if i in held else "train", blocks[j][2]
            out[f] += [Shard(f, "textpart", s, e, a, DataFormat.TEXT, split, e - s, block=TEXT_BLOCK_BYTES, end=b)
                       for s, e in _cuts(Path(f), SHARD_BYTES, a, b)]
            i = j + 1
    return out


def _block_key(path: Path, start: int, stop: int, seed: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(start)
        return hashlib.sha256(f"{seed}\0".encode() + fh.read(stop - start)).digest()


def records(shard: Shard, text_field: str) -> Iterator[tuple[int, Any]]:
    """(line or row number, record) of each record of a shard, in order; a textpart shard
    gives its blocks of text instead ({text_field: block}); a bad JSONL line, an EmberError."""
    path = Path(shard.file)
    if shard.kind == "text":
        yield from ((n, r) for n, _, r in read_records(path, shard.fmt, text_field))
    elif shard.kind == "textpart":
        yield from ((1, {text_field: b}) for b in text_blocks(path, shard.start, shard.stop, shard.block))
    elif shard.kind == "jsonl":
        yield from _jsonl(path, shard.start, shard.stop, shard.first, shard.where)
    elif shard.kind == "parquet":
        yield from _parquet_rows(path, shard.start, shard.stop)
    else:
        yield from _rows(_open_stream(path / shard.part), 0, shard.start, shard.stop, shard.first)


def _jsonl(path: Path, start: int, stop: int, lineno: int, where: str) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as fh:
        fh.seek(start)
        at = start
        for raw in fh:
            if at >= stop:
                return
            try:
                record = parse_line(raw.removeprefix(BOM) if at == 0 else raw, f"{where}{lineno}")
            except EmberError as e:
                record = e
            at += len(raw)
            if record is not BLANK:
                yield lineno, record
            lineno += 1


def text_blocks(path: Path, start: int, stop: int, block: int) -> Iterator[str]:
    """The text of bytes [start, stop) of a file in blocks of about `block` bytes, each
    ending at a newline (where there is one), so no block cuts a word or a character."""
    with open(path, "rb") as fh:
        fh.seek(start)
        left, carry = stop - start, b""
        if start == 0 and fh.read(len(BOM)) != BOM:  # a byte order mark is not text
            fh.seek(0)
        left -= fh.tell() - start
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


def _first_row(rows: Iterator[tuple[int, Any]], fmt: DataFormat, text_field: str, f: str) -> DataFormat | None:
    for n, record in rows:
        found = fmt if fmt != DataFormat.AUTO else detect(record, text_field)
        if found is None:
            raise EmberError(f"[data] files: {f}:row {n}: no 'messages' (chat), 'prompt' and 'completion', "
                             f"or '{text_field}' (text) column; set [data] format and [data] text_field to match")
        return found
    return None


def _cut(units: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first row, row after the last, bytes) of runs of about SHARD_BYTES, from consecutive
    units of (rows, bytes) (row groups, record batches) whose rows count as equally large."""
    out, start, row, acc = [], 0, 0, 0
    for rows, nbytes in units:
        at = 0
        while at < rows:
            take = min(rows - at, max(1, -(-(SHARD_BYTES - acc) * rows // max(nbytes, 1))))
            at, row, acc = at + take, row + take, acc + take * nbytes // rows
            if acc >= SHARD_BYTES:
                out.append((start, row, acc))
                start, acc = row, 0
    if row > start:
        out.append((start, row, acc))
    return out


def _parquet_plan(path: Path, f: str, fmt: DataFormat, text_field: str, split: str) -> tuple[DataFormat | None, list[Shard]]:
    import pyarrow.parquet as pq
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError...: all mean "not a readable Parquet file"
        raise EmberError(f"[data] files: {path}: not a readable Parquet file ({e})") from None
    groups = [(meta.row_group(g).num_rows, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
    found = _first_row(_parquet_rows(path, 0, sys.maxsize), fmt, text_field, f)
    return found, ([Shard(f, "parquet", a, b, a, found, split, n) for a, b, n in _cut(groups)] if found else [])


_READER: dict[tuple[str, int, int], list] = {}  # in a process: a Parquet file's rows where its last shard stopped


def _parquet_rows(path: Path, start: int, stop: int) -> Iterator[tuple[int, Any]]:
    """(row number, record) of rows [start, stop) of a Parquet file, ROWS_PER_READ rows at a time."""
    # A row group cannot be sought: its rows before `start` are decoded to be skipped. So the
    # reader a shard leaves is kept for the next this process reads: shards taken in order decode
    # a row group once, not once each (a 1 GB row group, 256 shards: 128 times on average).
    import pyarrow.parquet as pq
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    held = _READER.pop(key, None)  # [batches, the row of the next, a batch begun] or None
    if held is None or held[1] > start:
        pf = pq.ParquetFile(path)
        first, at = 0, 0  # the row group holding `start`, and its first row
        while first < pf.metadata.num_row_groups and at + pf.metadata.row_group(first).num_rows <= start:
            at, first = at + pf.metadata.row_group(first).num_rows, first + 1
        groups = range(first, pf.metadata.num_row_groups)
        held = [pf.iter_batches(batch_size=ROWS_PER_READ, row_groups=groups) if groups else iter(()), at, None]
    batches, at, batch = held
    while at < stop:
        batch = batch if batch is not None else next(batches, None)
        if batch is None:
            break
        lo, hi = max(start - at, 0), min(batch.num_rows, stop - at)
        for i in range(lo, hi, ROWS_PER_READ):
            for j, record in enumerate(batch.slice(i, min(ROWS_PER_READ, hi - i)).to_pylist()):
                yield at + i + j, record
        if at + batch.num_rows > stop:  # its rows from `stop` on: the next shard's
            break
        at, batch = at + batch.num_rows, None
    _READER.clear()  # one file's reader at a time (it holds the file open)
    _READER[key] = [batches, at, batch]


def forget_readers() -> None:
    """Close the Parquet reader a process keeps between shards (_parquet_rows)."""
    _READER.clear()


def _rows(batches: Any, at: int, start: int, stop: int, first: int) -> Iterator[tuple[int, Any]]:
    """(number, record) of rows [start, stop) of record batches whose first is row `at`; row
    `start` is numbered `first`. Only those rows become Python records, ROWS_PER_READ at a time."""
    for batch in batches:
        if at >= stop:
            return
        lo, hi = max(start - at, 0), min(batch.num_rows, stop - at)
        for i in range(lo, hi, ROWS_PER_READ):
            for j, record in enumerate(batch.slice(i, min(ROWS_PER_READ, hi - i)).to_pylist()):
                yield first + at + i + j - start, record
        at += batch.num_rows


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


def _arrow_plan(folder: Path, f: str, fmt: DataFormat, text_field: str, split: str) -> tuple[DataFormat | None, list[Shard]]:
    parts = _arrow_parts(folder)
    # The first row of the first part that has one is row 0 of the dataset.
    found = _first_row((r for p in parts for r in _rows(_open_stream(folder / p), 0, 0, sys.maxsize, 0)),
                       fmt, text_field, f)
    shards: list[Shard] = []
    row = 0
    for part in parts if found else []:
        batches = [(b.num_rows, b.nbytes) for b in _open_stream(folder / part)]
        shards += [Shard(f, "arrow", a, b, row + a, found, split, n, part) for a, b, n in _cut(batches)]
        row += sum(rows for rows, _ in batches)
    return found, shards


def data_file_hashes(files: list[str]) -> dict[str, str]:
    """SHA-256 of each data file that exists (cached by path, size and mtime)."""
    return {f: source_sha256(Path(f)) for f in files if Path(f).exists()}


def source_sha256(path: Path) -> str:
    """A file's SHA-256; a `datasets` folder's: over its files' names and hashes."""
    if not path.is_dir():
        return cached_sha256(path)
    _arrow_parts(path)  # a folder that is not a saved dataset is refused before its files are read
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}\0{cached_sha256(f)}\0".encode())
    return h.hexdigest()
