"""Training records -> token ids and the tokens the loss learns.

Three formats, chosen by `[data] format` or detected from a file's first record (and said):

    text        {"text": ...} per JSONL line, or a whole .txt file: every token is learned
    chat        {"messages": [{"role": ..., "content": ...}, ...]}: rendered through the
                tokenizer's own chat template; the assistant turns are learned
    completion  {"prompt": ..., "completion": ...}: the completion is learned

`[data] train_on = "all"` learns every token of chat and completion records too. Each encoded
record ends with the tokenizer's end-of-sequence token (a chat template that already ends with
it gets no second one); that token is learned where the text before it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import EmberError

FORMATS = ("text", "chat", "completion")
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Encoded:
    ids: list[int]
    targets: list[bool]     # per token: does the loss learn it


def detect(record: Any, text_field: str) -> str | None:
    """The format a record looks like, or None."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "completion"
    if text_field in record:
        return "text"
    return None


def read_records(path: Path, fmt: str, text_field: str) -> Iterator[tuple[int, str, Any]]:
    """(line number, format, record) for each record of a .txt or .jsonl file, read line by
    line; `fmt` "auto" detects the format from the first record and keeps it for the file."""
    if not path.is_file():
        raise EmberError(f"[data] files: {path} does not exist")
    if path.suffix == ".txt":
        if fmt not in ("auto", "text"):
            raise EmberError(f"[data] files: {path}: a .txt file is plain text, not [data] format = {fmt!r}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise EmberError(f"[data] files: {path} is not UTF-8 text ({e})") from None
        if text.strip():
            yield 1, "text", {text_field: text}
        return
    if path.suffix != ".jsonl":
        raise EmberError(f"[data] files: {path}: unsupported type '{path.suffix}'; use .txt or .jsonl")
    chosen = None if fmt == "auto" else fmt
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise EmberError(f"[data] files: {path}:{lineno}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise EmberError(f"[data] files: {path}:{lineno}: not valid JSON ({e.msg})") from None
            if chosen is None:
                chosen = detect(record, text_field)
                if chosen is None:
                    raise EmberError(f"[data] files: {path}:{lineno}: no 'messages' (chat), 'prompt' and "
                                     f"'completion', or '{text_field}' (text) field; set [data] format and "
                                     f"[data] text_field to match the records")
            yield lineno, chosen, record


def _field(record: Any, name: str, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(name), str):
        raise EmberError(f"{where}: no string field '{name}'"
                         + (" (set [data] text_field to the field that holds the text)" if name not in
                            ("prompt", "completion") else ""))
    return record[name]


def check_messages(record: Any, where: str) -> list[dict[str, str]]:
    """The record's messages, each {role, content} with a known role and string content."""
    msgs = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise EmberError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise EmberError(f"{where}: messages[{i}] is not an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise EmberError(f"{where}: messages[{i}].role = {m.get('role')!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise EmberError(f"{where}: messages[{i}].content must be a string")
    if not any(m["role"] == "assistant" for m in msgs):
        raise EmberError(f"{where}: no assistant message: nothing to learn from this conversation")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def encode(record: Any, fmt: str, tokenizer: Any, text_field: str, train_on: str, where: str) -> Encoded:
    """One record's tokens and the ones the loss learns (see the module docstring)."""
    eos = tokenizer.eos_id
    if fmt == "text":
        ids = tokenizer.encode_batch([_field(record, text_field, where)])[0] + [eos]
        return Encoded(ids, [True] * len(ids))
    if fmt == "completion":
        prompt, completion = _field(record, "prompt", where), _field(record, "completion", where)
        p, c = tokenizer.encode_batch([prompt, completion])
        return Encoded(p + c + [eos], [train_on == "all"] * len(p) + [True] * (len(c) + 1))
    if fmt != "chat":
        raise EmberError(f"[data] format = {fmt!r}: use one of auto, {', '.join(FORMATS)}")
    messages = check_messages(record, where)
    try:
        text, spans = tokenizer.render_chat(messages)
    except EmberError as e:
        raise EmberError(f"{where}: {e}") from None
    ids, offsets = tokenizer.encode_offsets(text)
    # A token is learned when it starts inside an assistant turn (as rendered by the template).
    starts = sorted(spans)
    targets, j = [], 0
    for start, _ in offsets:
        while j < len(starts) and starts[j][1] <= start:
            j += 1
        inside = j < len(starts) and starts[j][0] <= start < starts[j][1]
        targets.append(train_on == "all" or inside)
    if not ids or ids[-1] != eos:
        last_learned = train_on == "all" or messages[-1]["role"] == "assistant"
        ids, targets = ids + [eos], targets + [last_learned]
    return Encoded(ids, targets)
