"""Training records -> token ids and the tokens the loss learns.

Three formats, chosen by `[data] format` or detected from a file's first record (and said):

    text        {"text": ...} per JSONL line, or a whole .txt file: every token is learned
    chat        {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]} (OpenAI's
                format, tool calls included: ember.data.chat): rendered through the
                tokenizer's own chat template; the assistant turns (weight 1) are learned
    completion  {"prompt": ..., "completion": ...}: the completion is learned

Chat and completion files in one run make a chat run: a completion record is rendered as the
conversation of one user and one assistant turn. Plain text does not mix with either (refused,
with what to do).

`[data] train_on = "all"` learns every token of chat and completion records too (but the
assistant turns of weight 0). One end of turn per assistant turn: when the chat template ends a
turn with the tokenizer's end-of-sequence token (SmolLM2's `<|im_end|>`), the turn is learned up
to and including it (not the newline after it) and nothing is appended; otherwise (a template
without it, a text or completion record) the record gets the end-of-sequence token, learned
when the text before it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.jsonl import TOO_DEEP
from ember.data.chat import conversation
from ember.recipe import DataFormat

FORMATS = (DataFormat.TEXT, DataFormat.CHAT, DataFormat.COMPLETION)  # AUTO is a recipe's choice, not a format
BOM = b"\xef\xbb\xbf"  # a byte order mark, as Windows editors begin a UTF-8 file: not part of its text
BLANK = object()  # a blank JSONL line: skipped, but counted
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate: text only in pairs


@dataclass
class Encoded:
    ids: list[int]
    targets: list[bool]     # per token: does the loss learn it


def detect(record: Any, text_field: str) -> DataFormat | None:
    """The format a record looks like, or None."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return DataFormat.CHAT
    if "prompt" in record and "completion" in record:
        return DataFormat.COMPLETION
    if text_field in record:
        return DataFormat.TEXT
    return None


def read_records(path: Path, fmt: DataFormat, text_field: str) -> Iterator[tuple[int, DataFormat, Any]]:
    """(line number, format, record) for each record of a .txt or .jsonl file, read line by
    line; `fmt` "auto" detects the format from the first record and keeps it for the file."""
    if not path.is_file():
        raise EmberError(f"[data] files: {path} does not exist")
    if path.suffix == ".txt":
        if fmt not in (DataFormat.AUTO, DataFormat.TEXT):
            raise EmberError(f"[data] files: {path}: a .txt file is plain text, not [data] format = '{fmt}'")
        try:
            # Its bytes as written (no newline translation: a file read in blocks keeps its CRLF
            # too, ember.data.sources.text_blocks); a byte order mark is not text.
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise EmberError(f"[data] files: {path} is not UTF-8 text ({e})") from None
        if text.strip():
            yield 1, DataFormat.TEXT, {text_field: text}
        return
    if path.suffix != ".jsonl":
        raise EmberError(f"[data] files: {path}: unsupported type '{path.suffix}'; use .txt or .jsonl")
    chosen = None if fmt == DataFormat.AUTO else fmt
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            record = parse_line(raw.removeprefix(BOM) if lineno == 1 else raw, f"[data] files: {path}:{lineno}")
            if record is BLANK:
                continue
            if chosen is None:
                chosen = detect(record, text_field)
                if chosen is None:
                    raise EmberError(f"[data] files: {path}:{lineno}: no 'messages' (chat), 'prompt' and "
                                     f"'completion', or '{text_field}' (text) field; set [data] format and "
                                     f"[data] text_field to match the records")
            yield lineno, chosen, record


def parse_line(raw: bytes, where: str) -> Any:
    """The record of one JSONL line, or BLANK; an EmberError naming `where` (file:line) when
    the line is not one: not UTF-8, not JSON, or holding half of a character (an unpaired
    surrogate escape, which Python's json reads but no tokenizer can encode)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EmberError(f"{where}: not UTF-8 text ({e})") from None
    if not text.strip():
        return BLANK
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise EmberError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:  # json's parser recurses once per nesting level
        raise EmberError(f"{where}: not valid JSON ({TOO_DEEP})") from None
    except ValueError as e:  # beyond json's limits: an integer of more than 4,300 digits
        raise EmberError(f"{where}: not valid JSON ({str(e).split(':')[0]})") from None
    if _SURROGATE.search(text):  # rare: only such lines pay for the check
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            half = e.object[e.start:e.end].encode("unicode_escape").decode()
            raise EmberError(f"{where}: holds an unpaired surrogate ({half}: half of a character, as a string "
                             f"cut inside an emoji leaves it), which is not text; fix or remove the line") from None
    return record


def _field(record: Any, name: str, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(name), str):
        raise EmberError(f"{where}: no string field '{name}'"
                         + (" (set [data] text_field to the field that holds the text)" if name not in
                            ("prompt", "completion") else ""))
    return record[name]


def check(record: Any, fmt: DataFormat, text_field: str, where: str) -> None:
    """Raise what encode() would about a record's fields, without tokenizing it (to list them all)."""
    if fmt == DataFormat.TEXT:
        _field(record, text_field, where)
    elif fmt == DataFormat.COMPLETION:
        _field(record, "prompt", where)
        _field(record, "completion", where)
    elif fmt == DataFormat.CHAT:
        conversation(record, where)


def encode(record: Any, fmt: DataFormat, tokenizer: Any, text_field: str, train_on: str, where: str) -> Encoded:
    """One record's tokens and the ones the loss learns (see the module docstring)."""
    eos = tokenizer.eos_id
    specials = getattr(tokenizer, "special_texts", ())
    if fmt == DataFormat.TEXT:
        text = _field(record, text_field, where)
        no_special_text(text, specials, where, text_field)
        ids = tokenizer.encode_batch([text])[0] + [eos]
        return Encoded(ids, [True] * len(ids))
    if fmt == DataFormat.COMPLETION:
        prompt, completion = _field(record, "prompt", where), _field(record, "completion", where)
        no_special_text(prompt, specials, where, "prompt")
        no_special_text(completion, specials, where, "completion")
        p, c = tokenizer.encode_batch([prompt, completion])
        return Encoded(p + c + [eos], [train_on == "all"] * len(p) + [True] * (len(c) + 1))
    if fmt != DataFormat.CHAT:
        raise EmberError(f"[data] format = '{fmt}': use one of auto, {', '.join(FORMATS)}")
    conv = conversation(record, where)
    for i, m in enumerate(conv.messages):
        no_special_text(m.get("content") or "", specials, where, f"messages[{i}].content")
        for call in m.get("tool_calls") or []:
            no_special_text(json.dumps(call.get("function", {})), specials, where, f"messages[{i}].tool_calls")
    try:
        text, spans = tokenizer.render_chat(conv.messages, conv.tools)
    except EmberError as e:
        raise EmberError(f"{where}: {e}") from None
    ids, offsets = tokenizer.encode_offsets(text)
    # Per token: the assistant turn (index into spans) it starts inside, as rendered by the template.
    turn, j = [], 0
    for start, _ in offsets:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        turn.append(j if j < len(spans) and spans[j][0] <= start else -1)
    ended: set[int] = set()  # turns whose end-of-turn token is passed: the rest of their span is not theirs
    for k, t in enumerate(ids):
        if turn[k] in ended:
            turn[k] = -1
        elif turn[k] >= 0 and t == eos:
            ended.add(turn[k])
    targets = [conv.learned[s] if s >= 0 else train_on == "all" for s in turn]
    if eos not in ids:  # the template does not end turns with it: the record's end does
        last = conv.messages[-1]["role"] == "assistant" and conv.learned[-1]
        ids, targets = ids + [eos], targets + [train_on == "all" or last]
    return Encoded(ids, targets)


def no_special_text(text: str, specials: tuple[str, ...], where: str, field: str) -> None:
    """Refuse a record whose text holds a special token's text: the tokenizer reads it as that
    token wherever it stands (an end of turn in the middle of an answer: the rest of it never
    learned, and the model taught to stop there), and no warning would say so."""
    found = next((s for s in specials if s in text), None)
    if found is not None:
        raise EmberError(f"{where}: {field} holds {found!r}, a special token of the tokenizer: it would be "
                         f"read as that token, not as text (an end of turn or of document ends the learned "
                         f"text there); remove it or write it otherwise")


def run_format(formats: dict[str, DataFormat]) -> DataFormat:
    """The one format of a run whose files hold `formats` (file -> detected format): chat when
    chat and completion files are mixed; refused, with what to do, when plain text is mixed in."""
    found = set(formats.values())
    if len(found) <= 1:
        return next(iter(found), DataFormat.TEXT)
    if found == {DataFormat.CHAT, DataFormat.COMPLETION}:
        return DataFormat.CHAT
    listed = ", ".join(f"{Path(f).name}: {fmt}" for f, fmt in formats.items())
    other = " and ".join(sorted(found - {DataFormat.TEXT}))
    raise EmberError(
        f"[data] files: plain text mixed with {other} records ({listed}); text learns every token and "
        f"is split when long, {other} records learn their answers: write each text record as "
        f'{{"prompt": "", "completion": <the text>}} to learn all of its tokens in this run, or train on '
        f"the text in a run of its own and start this one from its weights ([model] path = its OUT/final; "
        f"after LoRA, OUT/final/merged with [method] export_merged = true)")


def prompt_tokens(prompt: str, fmt: DataFormat, tokenizer: Any) -> tuple[str, list[int]]:
    """The text and tokens a model is given to answer `prompt`, rendered as the records of a
    `fmt` run were in training: in a chat run, a user turn through the chat template and its
    generation prompt; otherwise the prompt as it is (a completion's prompt)."""
    if fmt != DataFormat.CHAT:
        return prompt, tokenizer.encode_batch([prompt])[0]
    text = tokenizer.chat_prompt([{"role": "user", "content": prompt}])
    return text, tokenizer.encode_offsets(text)[0]
