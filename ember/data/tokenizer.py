"""Tokenizers: what the data pipeline needs of one (`Tokenizer`), the byte tokenizer of
builtin:tiny, a transformers tokenizer behind that interface, and `TextEncoder`, the part of a
fast one that plain text needs. Torch-free: a tokenization worker unpickles these, and
importing torch there cost each spawned worker about 2 CPU-seconds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

from ember.data.chat import tool_name
from ember.errors import EmberError
from ember.models import BYTE_EOS, BYTE_VOCAB

BYTE_TOKENIZER_FILE = "ember_tokenizer.json"


class Tokenizer(Protocol):
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...
    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                    ) -> tuple[str, list[tuple[int, int]]]: ...
    def chat_prompt(self, messages: list[dict[str, Any]]) -> str: ...
    def decode(self, ids: list[int]) -> str: ...
    def fingerprint(self, rendering: bool = False) -> str: ...
    def save(self, folder: Path) -> None: ...


class TextEncoder:
    """The part of a fast (Rust) tokenizer that plain text needs: ids of texts, and the EOS.
    Light to send to a worker process: unpickling it imports `tokenizers` alone, not
    transformers and torch (about 2.5 CPU-seconds a spawned worker saves)."""

    def __init__(self, backend: Any, eos_id: int, special_texts: tuple[str, ...]):
        self.backend, self.eos_id, self.special_texts = backend, eos_id, special_texts

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, without special tokens (the ids transformers' tokenizer call gives)."""
        # encode_batch_fast skips the character offsets (all zero) and nothing else: the same
        # ids, about a fifth less time than encode_batch, which transformers' call uses.
        fast = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=False)]


def special_texts_of(backend: Any) -> tuple[str, ...]:
    """The texts a fast tokenizer reads as one special token wherever they appear in a text
    (<|im_end|>, <|endoftext|>, ...), longest first."""
    added = backend.get_added_tokens_decoder().values() if hasattr(backend, "get_added_tokens_decoder") else []
    return tuple(sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True))


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; 256 ends a document."""

    eos_id = BYTE_EOS
    vocab_size = BYTE_VOCAB
    special_texts: tuple[str, ...] = ()  # its template's markers are plain bytes

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Each byte, with the character it belongs to."""
        ids, offsets = [], []
        for i, ch in enumerate(text):
            b = ch.encode("utf-8")
            ids += b
            offsets += [(i, i + 1)] * len(b)
        return ids, offsets

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
        """ember's own plain template for the byte model: the tools as a '<|tools|>' line of JSON;
        each turn a '<|role|>' line, its content and a newline, an assistant's tool calls as
        '<tool_call>{"name", "arguments"}</tool_call>' lines after its content; the spans of
        the assistant turns (content, tool calls and the newline). The turn has no end token:
        the end-of-sequence token appended to the record ends the last one."""
        text, spans = (f"<|tools|>\n{json.dumps(tools)}\n" if tools else ""), []
        for m in messages:
            text += f"<|{m['role']}|>\n"
            start = len(text)
            if m["content"] or not m.get("tool_calls"):
                text += m["content"] + "\n"
            for call in m.get("tool_calls") or []:
                text += f"<tool_call>{json.dumps(call['function'])}</tool_call>\n"
            if m["role"] == "assistant":
                spans.append((start, len(text)))
        return text, spans

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        """The conversation and the header of the assistant turn that answers it."""
        return self.render_chat(messages)[0] + "<|assistant|>\n"

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self, rendering: bool = False) -> str:
        """Its identity (its EOS and template are ember's own, versioned with the token store)."""
        return hashlib.sha256(b"ember-byte-tokenizer/1").hexdigest()

    def save(self, folder: Path) -> None:
        (folder / BYTE_TOKENIZER_FILE).write_text(json.dumps({"kind": "bytes", "eos_id": 256}))


class HFTokenizer:
    """A transformers tokenizer behind the small interface ember needs."""

    def __init__(self, tok: Any):
        self.tok = tok
        if tok.eos_token_id is None:
            raise EmberError(f"tokenizer of {tok.name_or_path} has no end-of-sequence token; "
                             f"ember needs one to separate packed documents")
        self.eos_id = tok.eos_token_id
        backend = getattr(tok, "backend_tokenizer", None)
        self.special_texts = special_texts_of(backend) if backend is not None else \
            tuple(sorted(set(tok.all_special_tokens), key=len, reverse=True))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        fast = self.text_encoder()
        if fast is not self:
            # The fast tokenizer's own batch call: the ids transformers would return, without
            # its per-text conversion to a BatchEncoding (a few % of tokenizing a corpus).
            return fast.encode_batch(texts)
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def text_encoder(self) -> TextEncoder | HFTokenizer:
        """What encoding plain text needs (ember.data.tokenizer.TextEncoder, light to send to a
        worker process), or this tokenizer when its backend truncates or pads."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            return TextEncoder(backend, self.eos_id, self.special_texts)
        return self

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        out = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return out["input_ids"], [tuple(o) for o in out["offset_mapping"]]

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation through the tokenizer's own chat template (with `tools`), and the
        character spans of the assistant turns: from the end of the prompt the template renders
        before a turn (with its generation prompt) to the end of the rendering that includes it.
        Refused when the template drops the tools or a turn's tool calls (nothing of them
        rendered: training would teach an empty turn)."""
        render = lambda msgs, gen: self._render(msgs, gen, tools)
        text, spans = render(messages, False), []
        name = self.tok.name_or_path
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(messages[:i], True) if i else ""
            upto = render(messages[: i + 1], False)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise EmberError(f"the chat template of {name} does not render a conversation "
                                 f"as a prefix of its continuation, so the assistant turns cannot be located; "
                                 f"use [data] format = 'completion' (prompt/completion records)")
            for call in m.get("tool_calls") or []:
                if call["function"]["name"] not in upto[len(before):]:
                    raise EmberError(f"the chat template of {name} does not render tool calls (the call of "
                                     f"{call['function']['name']!r} is not in its rendering of the turn); "
                                     f"use a model whose chat template renders tool_calls, or leave these turns out")
            spans.append((len(before), len(upto)))
        for tool in tools or []:
            if tool_name(tool) not in text:
                raise EmberError(f"the chat template of {name} does not render the record's tools ({tool_name(tool)!r} "
                                 f"is not in its rendering); use a model whose chat template takes tools")
        return text, spans

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        """The conversation through the chat template, with the generation prompt that opens
        the assistant's answer."""
        return self._render(messages, True, None)

    def _render(self, messages: list[dict[str, Any]], generation: bool, tools: list[dict[str, Any]] | None) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise EmberError(f"the tokenizer of {self.tok.name_or_path} has no chat template; use "
                             f"[data] format = 'completion' (prompt/completion records) or a model that has one")
        from jinja2 import TemplateError
        try:
            return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)
        except (TemplateError, TypeError) as e:  # the template's own raise_exception, or a field it cannot join
            raise EmberError(f"the chat template of {self.tok.name_or_path} refuses this conversation: {e}") from None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def fingerprint(self, rendering: bool = False) -> str:
        """The identity of its vocabulary and rules; with `rendering`, also of what else makes a
        record's tokens (the end-of-sequence id, the chat template), which a model folder's
        tokenizer_config.json may change over the same tokenizer.json: the token store's key.
        (Without it: the data fingerprint a run records, as runs begun before recorded it.)"""
        backend = getattr(self.tok, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else json.dumps(self.tok.get_vocab(), sort_keys=True)
        if rendering:
            text += f"\0{self.eos_id}\0{getattr(self.tok, 'chat_template', None) or ''}"
        return hashlib.sha256(text.encode()).hexdigest()

    def save(self, folder: Path) -> None:
        self.tok.save_pretrained(folder)


def load_tokenizer(folder: Path) -> Tokenizer:
    if (folder / BYTE_TOKENIZER_FILE).is_file():
        return ByteTokenizer()
    from transformers import AutoTokenizer
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(folder))
    except (OSError, ValueError) as e:
        raise EmberError(f"{folder}: no usable tokenizer in the model folder: {e}") from None
