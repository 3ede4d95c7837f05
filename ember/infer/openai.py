"""The OpenAI API's requests and answers over ember's engine, without HTTP (ember.web.infer_worker
serves them):

    completion_request(body), chat_request(body)    a request's JSON object -> `OpenAIRequest`:
                                                    the prompt or the messages, the model, the
                                                    `Sampling`, and how to answer (whole or streamed)
    whole(request, head, text, usage)               the answer, once the generation is complete
    chunks(request, head, generation)               the answer as stream chunks, as it is made

    POST /v1/completions        prompt, model, max_tokens, temperature, top_p, stop, seed, stream
    POST /v1/chat/completions   the same with messages instead of prompt

A missing `model` means `default` (`base`; a co-serving training run's: `live`). A request the
engine cannot serve raises RequestError (its `status` is the HTTP status), naming the field at
fault, before anything runs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ember.infer.engine import BASE, Generation, RequestError, Sampling, Usage


@dataclass(frozen=True)
class OpenAIRequest:
    """One request, checked: what the engine generates, and how the answer is shaped."""
    chat: bool                                # /v1/chat/completions (messages), else /v1/completions
    model: str
    prompt: str | list[dict[str, Any]]        # the text, or the chat messages (the engine checks them)
    sampling: Sampling
    stream: bool                              # answer as server-sent chunks
    include_usage: bool                       # streamed: a last chunk with the usage (stream_options)

    def head(self) -> dict[str, Any]:
        """The fields every body and chunk of one answer share: its id, when, which model."""
        return {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "created": int(time.time()), "model": self.model}

    def chunk(self, head: dict[str, Any], text: str, finish: str | None, whole: bool = False,
              first: bool = False) -> dict[str, Any]:
        """A body (`whole`) or a stream chunk of this request's kind."""
        return (chat_chunk if self.chat else completion_chunk)(head, text, finish, whole, first)


def completion_request(body: dict[str, Any], default: str = BASE) -> OpenAIRequest:
    """POST /v1/completions's body, checked."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt: required, a string")
    if body.get("echo") or body.get("logprobs") or body.get("suffix"):
        raise RequestError("echo, logprobs and suffix are not supported by ember's engine")
    return _request(body, False, prompt, sampling(body, 16), default)


def chat_request(body: dict[str, Any], default: str = BASE) -> OpenAIRequest:
    """POST /v1/chat/completions's body, checked (the engine checks each message)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError("messages: required, a list of {\"role\": str, \"content\": str}")
    if body.get("logprobs") or body.get("tools"):
        raise RequestError("logprobs and tools are not supported by ember's engine")
    return _request(body, True, messages, sampling(body, None), default)


def _request(body: dict[str, Any], chat: bool, prompt: Any, how: Sampling, default: str) -> OpenAIRequest:
    model = body.get("model") or default
    if not isinstance(model, str):
        raise RequestError("model: a string")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):  # "false" is truthy: it would stream
        raise RequestError(f"stream: true or false, got {stream!r:.40}")
    stream = bool(stream)
    options = (body.get("stream_options") or {}) if stream else {}
    if not isinstance(options, dict):
        raise RequestError(f"stream_options: an object such as {{\"include_usage\": true}}, got {options!r:.40}")
    return OpenAIRequest(chat, model, prompt, how, stream, bool(options.get("include_usage")))


def sampling(body: dict[str, Any], default_max: int | None) -> Sampling:
    """The sampling settings of an OpenAI request, type-checked (Sampling.check does ranges)."""
    def number(key: str, kind: type, default: Any) -> Any:
        value = body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            what = "a number" if kind is float else "an integer"
            raise RequestError(f"{key}: expected {what}, got {value!r:.40}")
        try:
            return kind(value)
        except OverflowError:  # an integer of hundreds of digits: valid JSON, and no float holds it
            raise RequestError(f"{key}: {value!r:.40}... is too large for a number") from None
    if number("n", int, 1) != 1:
        raise RequestError("n: only 1 is supported")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop: a string or a list of strings")
    max_tokens = number("max_tokens", int, None)
    if max_tokens is None:  # the chat API's newer name for it
        max_tokens = number("max_completion_tokens", int, default_max)
    return Sampling(max_tokens=max_tokens, temperature=number("temperature", float, 1.0),
                    top_p=number("top_p", float, 1.0), stop=tuple(stop), seed=number("seed", int, None))


def whole(request: OpenAIRequest, head: dict[str, Any], text: str, used: Usage) -> dict[str, Any]:
    """The answer to a request not streamed: all of the text, why it ended, the usage."""
    return {**request.chunk(head, text, used.finish_reason, whole=True), "usage": usage(used)}


def chunks(request: OpenAIRequest, head: dict[str, Any], gen: Generation) -> Iterator[dict[str, Any]]:
    """The stream's chunks, generating as they are taken: a first one (the chat's role), one per
    piece of text, one with the finish reason, and with `include_usage` one with the usage."""
    yield request.chunk(head, "", None, first=True)
    for piece in gen:
        if piece:
            yield request.chunk(head, piece, None)
    yield request.chunk(head, "", gen.usage.finish_reason)
    if request.include_usage:
        yield {**request.chunk(head, "", None), "choices": [], "usage": usage(gen.usage)}


def completion_chunk(head: dict[str, Any], text: str, finish: str | None, whole: bool = False,
                     first: bool = False) -> dict[str, Any]:
    """/v1/completions's body or stream chunk (the same shape)."""
    return {**head, "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(head: dict[str, Any], text: str, finish: str | None, whole: bool = False,
               first: bool = False) -> dict[str, Any]:
    """/v1/chat/completions's body (`whole`: the message), or a stream chunk (a delta; the
    `first` says the role)."""
    if whole:
        return {**head, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
    delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
    return {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage(u: Usage) -> dict[str, int]:
    """A generation's token counts in OpenAI's names."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}
