"""ember's decode loop (ember.infer.batching) on builtin:tiny, in-process: requests decoded
together in one batch, joining and leaving it at different steps, each get their solo text."""

from __future__ import annotations

import threading

import pytest
import torch

from ember.infer.batching import PREFILL_CHUNK
from ember.infer.engine import Engine, Sampling
from tests.helpers import wait_until

# Different lengths, so rows join with left padding on either side; the last is longer than a
# prefill chunk, so it is prefilled in several passes between the others' decode steps.
PROMPTS = ["In the beginning God", "And the earth was without form, and void; and darkness",
           "Let there be light", "x" * (PREFILL_CHUNK + 40)]
LENGTHS = [24, 9, 30, 17]  # the short ones leave the batch while the others go on


@pytest.fixture(scope="module")
def engine() -> Engine:
    """builtin:tiny with its attention and output sharpened: at its random init, attention is
    near uniform and a wrong position id or mask barely moves the argmax; sharpened, either
    changes the greedy text (checked by breaking each in batching.py)."""
    e = Engine("builtin:tiny", [], seed=7)
    e.load()
    with torch.no_grad():
        for name, p in e.model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6)
            elif name.endswith("lm_head.weight"):
                p.mul_(4)
    return e


def together(engine: Engine, samplings: list[Sampling]) -> list[str]:
    """The texts of PROMPTS generated concurrently, all queued before the loop's next step."""
    texts: list[str] = [""] * len(PROMPTS)

    def one(i: int) -> None:
        texts[i] = engine.generate("base", PROMPTS[i], samplings[i]).text()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    with engine.lock:  # the loop waits at its next step until every request is queued
        for t in threads:
            t.start()
        wait_until("all requests queued", lambda: len(engine.batcher.waiting) == len(PROMPTS), 60, 0.01)
    for t in threads:
        t.join(120)
    return texts


def test_batched_greedy_text_equals_each_requests_solo_text(engine: Engine):
    greedy = [Sampling(max_tokens=n, temperature=0) for n in LENGTHS]
    alone = [engine.generate("base", p, s).text() for p, s in zip(PROMPTS, greedy)]
    engine.batcher.widest = 0
    assert together(engine, greedy) == alone
    assert engine.batcher.widest == len(PROMPTS)  # they really shared decode steps


def test_a_seeded_sample_is_the_same_in_a_batch_as_alone(engine: Engine):
    seeded = [Sampling(max_tokens=n, temperature=0.9, top_p=0.95, seed=i) for i, n in enumerate(LENGTHS)]
    alone = [engine.generate("base", p, s).text() for p, s in zip(PROMPTS, seeded)]
    assert together(engine, seeded) == alone
    assert len(set(alone)) == len(alone)


def test_a_temperature_near_zero_samples_the_greedy_token_and_fails_no_one_in_its_batch(engine: Engine):
    """Before: at temperature 1e-300 the logits divided by it were inf, softmax made nan of them
    and torch.multinomial raised in the decode loop, which failed every request in the batch
    (a 500 for each, whatever its own settings)."""
    greedy = [Sampling(max_tokens=n, temperature=0) for n in LENGTHS]
    alone = [engine.generate("base", p, s).text() for p, s in zip(PROMPTS, greedy)]
    near_zero = [greedy[0], Sampling(max_tokens=LENGTHS[1], temperature=1e-300, seed=1), *greedy[2:]]
    assert together(engine, near_zero) == alone


def test_concurrent_http_requests_share_steps_and_each_get_their_solo_text(engine: Engine):
    """Through the worker's app: two plain completions and a streamed chat, sent at once."""
    import json

    from fastapi.testclient import TestClient

    from ember.web.infer_worker import create_app
    bodies = [("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 20}),
              ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 12}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})]

    def text(client: TestClient, path: str, body: dict, stream: bool) -> str:
        r = client.post(path, json={**body, "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if "message" in choice else choice["text"]
        events = r.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], r.text[-200:]
        chunks = [json.loads(e.removeprefix("data: "))["choices"] for e in events[:-2]]
        return "".join(c[0].get("text") or c[0].get("delta", {}).get("content") or "" for c in chunks if c)

    with TestClient(create_app(engine)) as client:
        alone = [text(client, path, body, False) for path, body in bodies]
        answers: list[str] = [""] * len(bodies)

        def one(i: int) -> None:
            answers[i] = text(client, *bodies[i], stream=i == 2)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        engine.batcher.widest = 0
        with engine.lock:
            for t in threads:
                t.start()
            wait_until("all requests queued", lambda: len(engine.batcher.waiting) == len(bodies), 60, 0.01)
        for t in threads:
            t.join(120)
    assert answers == alone and all(alone)
    assert engine.batcher.widest >= 2  # they shared decode steps (one may end at its first tokens)

