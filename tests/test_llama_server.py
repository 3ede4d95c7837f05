"""The real llama.cpp server (tests/engines.py) answers the two OpenAI calls ember's inference
endpoint forwards: a plain completion, and a chat completion streamed as server-sent events."""

from __future__ import annotations

import json

import httpx

from tests.engines import llama_server


def test_completion_and_streamed_chat(tmp_path):
    with llama_server(tmp_path) as url, httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": "In the beginning God created",
                                                  "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"].strip(), body
        assert 0 < body["usage"]["completion_tokens"] <= 8, body

        chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=chat) as s:
            assert s.status_code == 200, s.read()
            assert s.headers["content-type"].startswith("text/event-stream"), s.headers
            # Blank lines separate events; lines starting ':' are keep-alive comments.
            events = [line for line in s.iter_lines() if line and not line.startswith(":")]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]", events
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert len(chunks) >= 2, events  # streamed: more than one chunk before [DONE]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text.strip(), events
