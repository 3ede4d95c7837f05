"""The OpenAI API's shapes without HTTP (ember.infer.openai): a request body to what the engine
generates, and a generation of the real builtin:tiny engine to the answer, whole or streamed."""

from __future__ import annotations

import pytest

from ember.infer.engine import BASE, Engine, RequestError, Sampling
from ember.infer.openai import chat_request, chunks, completion_request, whole

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    e = Engine("builtin:tiny", [], seed=7)
    e.load()
    return e


def test_a_request_body_becomes_the_engines_arguments_with_openais_defaults():
    asked = completion_request({"prompt": ["In the beginning"], "stop": "\n", "temperature": 0, "seed": 3})
    assert (asked.chat, asked.model, asked.prompt, asked.stream, asked.include_usage) == \
        (False, BASE, "In the beginning", False, False)
    assert asked.sampling == Sampling(max_tokens=16, temperature=0.0, top_p=1.0, stop=("\n",), seed=3)
    chat = chat_request({"messages": MESSAGES, "model": "a", "max_completion_tokens": 7, "stream": True,
                         "stream_options": {"include_usage": True}})
    assert (chat.chat, chat.model, chat.prompt, chat.stream, chat.include_usage) == (True, "a", MESSAGES, True, True)
    assert chat.sampling.max_tokens == 7
    assert chat_request({"messages": MESSAGES}).sampling.max_tokens is None  # chat: to the end of the context
    # Not streamed, stream_options is not read (OpenAI's clients send it with stream false too).
    assert not chat_request({"messages": MESSAGES, "stream_options": "x"}).include_usage
    head = chat.head()
    assert head["id"].startswith("chatcmpl-") and head["model"] == "a"
    assert asked.head()["id"].startswith("cmpl-") and asked.head()["id"] != asked.head()["id"]


@pytest.mark.parametrize("parse, body, says", [
    (completion_request, {}, "prompt"),
    (completion_request, {"prompt": ["a", "b"]}, "prompt"),
    (completion_request, {"prompt": "x", "echo": True}, "echo"),
    (completion_request, {"prompt": "x", "n": 2}, "n: only 1"),
    (completion_request, {"prompt": "x", "stop": [1]}, "stop"),
    (completion_request, {"prompt": "x", "max_tokens": True}, "max_tokens: expected an integer"),
    (completion_request, {"prompt": "x", "temperature": "hot"}, "temperature: expected a number"),
    (completion_request, {"prompt": "x", "model": 3}, "model"),
    (chat_request, {"messages": "hi"}, "messages"),
    (chat_request, {"messages": MESSAGES, "tools": [{}]}, "tools"),
    (chat_request, {"messages": MESSAGES, "stream": True, "stream_options": [True]}, "stream_options"),
])
def test_a_bad_request_names_the_field_at_fault(parse, body, says):
    with pytest.raises(RequestError, match=says) as e:
        parse(body)
    assert e.value.status == 400


@pytest.mark.parametrize("body", [{"prompt": "In the beginning"}, {"messages": MESSAGES}])
def test_the_stream_carries_the_same_text_as_the_whole_answer(engine: Engine, body):
    parse = chat_request if "messages" in body else completion_request
    asked = parse({**body, "max_tokens": 12, "temperature": 0})
    gen = engine.generate(asked.model, asked.prompt, asked.sampling)
    assert next(gen) == ""  # the model is active
    answer = whole(asked, asked.head(), gen.text(), gen.usage)
    finish = answer["choices"][0]["finish_reason"]
    used = answer["usage"]
    assert finish in ("stop", "length") and used["completion_tokens"] <= 12
    assert used["total_tokens"] == used["prompt_tokens"] + used["completion_tokens"] == len(gen.prompt_ids) \
        + gen.usage.completion_tokens

    streamed = parse({**body, "max_tokens": 12, "temperature": 0, "stream": True,
                      "stream_options": {"include_usage": True}})
    gen = engine.generate(streamed.model, streamed.prompt, streamed.sampling)
    next(gen)
    sent = list(chunks(streamed, streamed.head(), gen))
    assert sent[-1]["choices"] == [] and sent[-1]["usage"] == answer["usage"]
    assert sent[-2]["choices"][0]["finish_reason"] == finish
    if asked.chat:
        assert answer["object"] == "chat.completion" and {c["object"] for c in sent} == {"chat.completion.chunk"}
        assert sent[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in sent[:-1])
        assert text == answer["choices"][0]["message"]["content"]
    else:
        assert {c["object"] for c in [answer, *sent]} == {"text_completion"}
        assert "".join(c["choices"][0]["text"] for c in sent[:-1]) == answer["choices"][0]["text"]
