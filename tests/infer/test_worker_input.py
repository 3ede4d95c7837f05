"""Odd values in the inference worker's OpenAI requests (what `ember serve` forwards to it as they
are, and answers with the worker's status): each is a 400 that names the field at fault, never
a 500, and changes nothing (the next request is answered as before)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ember.infer.engine import Engine
from ember.web.infer_worker import create_app

HI = b'[{"role": "user", "content": "hi"}]'


@pytest.fixture(scope="module")
def client():
    engine = Engine("builtin:tiny", [], seed=7)
    engine.load()
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def greedy(client: TestClient) -> str:
    r = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# Raw bodies: a JSON escape of an unpaired surrogate (\ud800) is valid JSON that Python decodes to
# a string UTF-8 cannot encode; an integer of 400 digits is valid JSON no float can hold.
@pytest.mark.parametrize("path, body, says", [
    ("/v1/completions", b'{"prompt": "In the \\ud800 beginning", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "hi"}], "max_tokens": 2}', "messages"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}", "temperature"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "top_p": 1' + b"0" * 400 + b"}", "top_p"),
    ("/v1/completions", b"[" * 100_000, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "stream": "false"}', "stream"),
    ("/v1/chat/completions", b'{"messages": ' + HI + b', "max_tokens": 2, "stream": 1}', "stream"),
], ids=["surrogate-prompt", "surrogate-content", "surrogate-role", "huge-temperature", "huge-top_p", "deep-nesting",
        "stream-string", "stream-number"])
def test_an_odd_value_is_a_400_naming_its_field_and_changes_nothing(client, path, body, says):
    """Before: an unpaired surrogate was a 500 (UnicodeEncodeError), a 400-digit temperature a 500
    (OverflowError), a deeply nested body a 500 (RecursionError), and "stream": "false" streamed."""
    before = greedy(client)
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error", error
    assert says in error["message"], error
    assert greedy(client) == before


def test_the_odd_values_openai_allows_still_work(client):
    """null for stream, and stop strings with any characters, are answered as before."""
    for body in (b'{"prompt": "x", "max_tokens": 2, "stream": null}',
                 b'{"prompt": "x", "max_tokens": 2, "stream": false, "stop": ["\\ud800"]}'):
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text[:300]
