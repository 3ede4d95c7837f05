"""JSON-lines files written by appending: a crash can tear the last line, nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

from ember.errors import EmberError

TOO_DEEP = "nested too deeply to read"  # a value json's parser gives up on (RecursionError)


def loads(line: bytes | str) -> Any:
    """One JSON value: orjson (3-4x faster: a 100,000-step metrics.jsonl is read for every report
    and chart), or the standard library where orjson refuses what Python's json writes (NaN and
    Infinity for a loss that overflowed, integers beyond 64 bits). Raises ValueError."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            return json.loads(line)
        except RecursionError:  # nested deeper than the interpreter's stack (orjson stops at 1024)
            raise ValueError(TOO_DEEP) from None


Shape = dict[str, tuple[type, ...]]  # field -> the types its value may have (NoneType for null)


def misfit(record: dict[str, Any], shape: Shape) -> str | None:
    """What keeps `record` from having `shape` (a field missing, or of another type), or None."""
    for name, types in shape.items():
        if name not in record:
            return f'no "{name}"'
        value = record[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f'"{name}" is {json.dumps(value)[:40]}, not {" or ".join(t.__name__ for t in types)}'
    return None


def read_jsonl(path: Path, notes: list[str] | None = None, shape: Shape | None = None) -> list[dict[str, Any]]:
    """The records of `path` ([] if absent). A torn last line is skipped (with a note); a bad
    line anywhere else is corruption, reported, and nothing is rewritten. With `shape`, a
    whole line without the fields it names is such corruption too (it was damaged or written
    by another program), wherever it is."""
    if not path.exists():
        return []
    lines = path.read_bytes().splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        try:
            record = loads(line)
            if not isinstance(record, dict):  # every line ember appends is an object
                raise ValueError("not a JSON object")
        except ValueError:
            if i == len(lines):
                if notes is not None:
                    notes.append(f"{path.name}: skipped a torn last line (expected after a crash)")
                continue
            raise EmberError(f"{path}:{i}: corrupted (not a JSON object) in the middle of the file; "
                             f"nothing was rewritten") from None
        if shape is not None and (why := misfit(record, shape)) is not None:
            raise EmberError(f"{path}:{i}: not one of ember's lines ({why}); it was damaged or written by "
                             f"another program: restore the file, or remove that line; nothing was rewritten")
        out.append(record)
    return out
