"""ember's decode loop (ember.infer.batching) on builtin:tiny, in-process: requests decoded
together in one batch, joining and leaving it at different steps, each get their solo text."""

from __future__ import annotations

import threading

import pytest

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
    e = Engine("builtin:tiny", [], seed=7)
    e.load()
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
