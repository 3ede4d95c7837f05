"""Co-serving ([serve] coserve): a training run answers OpenAI requests for its own model between
micro-batches (with httpx, and with OpenAI's own client), refuses bad ones with a 4xx, and trains
exactly what the same recipe trains serving nothing: losses and final weights bit for bit, LoRA
with dropout included."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.artifacts import shared
from tests.helpers import assert_same_result, run_ember, start_ember, stop, wait_until, write_recipe

# Long enough that every request is sent while the run trains (a step takes ~0.03 s here);
# two micro-batches a step, so requests are also answered between the micro-batches of a step.
FULL = {"train": {"max_steps": 150, "grad_accum": 2}, "schedule": {"kind": "constant"}}
LORA = {**FULL, "method": {"kind": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.1}}
SERVE = {"coserve": True}
PROMPT = "In the beginning God created"


def baseline(sections: dict) -> Path:
    """The run of `sections` without co-serving, shared across test runs."""
    def build(folder: Path) -> None:
        recipe = write_recipe(folder, **sections)
        done = run_ember("run", recipe, "--out", folder / "run", "--no-ledger")
        assert done.returncode == 0, done.stderr
    return shared("coserve-baseline", sections, build) / "run"


def serving(tmp_path: Path, sections: dict):
    """The co-serving run started (a process we stop if the test fails), and its OUT/serve.json."""
    recipe = write_recipe(tmp_path, **sections, serve=SERVE)
    out = tmp_path / "run"
    proc = start_ember("run", recipe, "--out", out, "--no-ledger", warm=True)
    try:
        info = wait_until("OUT/serve.json", lambda: proc.poll() is None and (out / "serve.json").exists()
                          and json.loads((out / "serve.json").read_text()), 300, 0.01)
    except BaseException:
        stop(proc)
        print(proc.outputs)
        raise
    return proc, out, info


def finished(proc, out: Path) -> None:
    """The run completed, served during training (some step's phases hold `serve`), and left no serve.json."""
    code = proc.wait(timeout=600)
    stderr = proc.stderr.read()
    assert code == 0, stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["phases"].get("serve", 0) > 0 for r in rows[:-1]), stderr  # answered mid-run, not only at the end
    assert "co-serving:" in stderr and not (out / "serve.json").exists()


def post(info: dict, path: str, body: object, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token or info['token']}"}
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(info["url"] + path, headers=headers, timeout=300, **kwargs)


def streamed(info: dict, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed answer; it must end with [DONE]."""
    headers = {"Authorization": f"Bearer {info['token']}"}
    with httpx.stream("POST", info["url"] + path, json={**body, "stream": True}, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


def answer_ok(kind: str, got) -> None:
    """A whole answer (a Response) or a stream's chunks (a list), valid for its kind."""
    if isinstance(got, list):
        assert all("error" not in c for c in got), got
        ends = [c["choices"][0]["finish_reason"] for c in got if c["choices"]]
        assert ends[-1] in ("stop", "length") and not any(ends[:-1]), got
        assert got[-1].get("usage", {"completion_tokens": 1})["completion_tokens"] >= 1, got
        return
    assert got.status_code == 200, got.text
    body = got.json()
    choice = body["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), body
    assert body["usage"]["completion_tokens"] >= 1, body


def test_a_full_run_answers_while_it_trains_bit_identically(tmp_path):
    """Completions and chat completions, whole and streamed, sampled and greedy, sent together
    while the run trains; bad requests get their 4xx; the run trains what it trains alone."""
    base = baseline(FULL)
    proc, out, info = serving(tmp_path, FULL)
    chat = [{"role": "user", "content": "Who made the light?"}]
    good = {
        "completion": lambda: post(info, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
        "completion, streamed": lambda: streamed(info, "/v1/completions", {"prompt": PROMPT, "max_tokens": 9,
                                                                            "model": "run", "seed": 5}),
        "chat": lambda: post(info, "/v1/chat/completions", {"messages": chat, "max_tokens": 10, "model": "live",
                                                             "temperature": 0.8, "seed": 3}),
        "chat, streamed": lambda: streamed(info, "/v1/chat/completions", {
            "messages": chat, "max_tokens": 7, "stream_options": {"include_usage": True}}),
    }
    bad = [  # (the status each gets, the request): the request is at fault
        (401, lambda: post(info, "/v1/completions", {"prompt": PROMPT}, token="wrong")),
        (404, lambda: post(info, "/v1/completions", {"prompt": PROMPT, "model": "no-such-run"})),
        (400, lambda: post(info, "/v1/completions", {"prompt": PROMPT, "model": "base"})),  # full: no base left
        (400, lambda: post(info, "/v1/completions", {"prompt": PROMPT, "model": "committed"})),  # a second copy
        (400, lambda: post(info, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})),
        (400, lambda: post(info, "/v1/chat/completions", "{not json")),
        (400, lambda: post(info, "/v1/chat/completions", {"messages": "hello"})),
    ]
    try:
        with ThreadPoolExecutor(len(good) + len(bad)) as pool:
            answers = {k: pool.submit(f) for k, f in good.items()}
            refusals = [(status, pool.submit(f)) for status, f in bad]
            for kind, future in answers.items():
                answer_ok(kind.split(",")[0], future.result())
            for status, future in refusals:
                got = future.result()
                assert got.status_code == status and got.json()["error"]["message"], got.text
        finished(proc, out)
    finally:
        stop(proc)
    assert_same_result(out, base)


def test_a_lora_run_with_dropout_serves_live_committed_and_base_to_openai_clients(tmp_path):
    """OpenAI's own client: the live adapter, the last committed one (swapped in for its
    forwards and out again), and the base (adapter disabled); streamed and whole; the run
    with LoRA dropout trains what it trains alone."""
    openai = pytest.importorskip("openai")  # in the dev extra (pyproject.toml)
    base = baseline(LORA)
    proc, out, info = serving(tmp_path, LORA)
    client = openai.OpenAI(base_url=info["url"] + "/v1", api_key=info["token"], max_retries=0, timeout=300)
    try:
        committed = lambda: next(m for m in client.models.list().data if m.id == "committed").checkpoint_step
        wait_until("a committed checkpoint to serve", committed, 300, 0.05)
        chat = [{"role": "user", "content": "Who divided the waters?"}]
        with ThreadPoolExecutor(6) as pool:
            whole = [pool.submit(client.completions.create, model=m, prompt=PROMPT, max_tokens=8, temperature=0)
                     for m in ("live", "committed", "base")]
            chats = [pool.submit(lambda m=m: list(client.chat.completions.create(
                model=m, messages=chat, max_tokens=6, stream=True))) for m in ("live", "committed", "base")]
            for f in whole:
                c = f.result()
                assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens >= 1, c
            for f in chats:
                chunks = f.result()
                assert chunks[0].choices[0].delta.role == "assistant", chunks
                assert chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt=PROMPT, max_tokens=4)
        finished(proc, out)
    finally:
        stop(proc)
    assert_same_result(out, base)


def test_co_serving_with_several_ranks_is_refused_before_anything_runs(tmp_path):
    recipe = write_recipe(tmp_path, **FULL, serve=SERVE)
    done = run_ember("run", recipe, "--out", tmp_path / "run", "--nproc", "2", "--no-ledger")
    assert done.returncode != 0 and "[serve] coserve" in done.stderr and "one process" in done.stderr, done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_stop_answers_the_request_under_way_with_an_error_and_the_run_exits(tmp_path):
    """SIGTERM while a long answer streams: the run stops as it would (exit 75, a checkpoint),
    the stream ends with an error chunk instead of hanging, and OUT/serve.json is gone."""
    import signal
    slow = {**FULL, "train": {**FULL["train"], "max_steps": 100_000}}
    # A small share and no saved-up burst: the answer streams over many gaps, so it is under way
    # when the signal lands (with the default 1 s burst, one gap could answer it whole).
    recipe = write_recipe(tmp_path, **slow, serve={**SERVE, "gap_share": 0.05, "burst_seconds": 0})
    out = tmp_path / "run"
    proc = start_ember("run", recipe, "--out", out, "--no-ledger", warm=True)
    try:
        info = wait_until("OUT/serve.json", lambda: (out / "serve.json").exists()
                          and json.loads((out / "serve.json").read_text()), 300, 0.01)
        body = {"prompt": PROMPT, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", info["url"] + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {info['token']}"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the answer has begun
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert "the training run stopped" in rest[-1], rest[-3:]
        assert proc.wait(timeout=300) == 75
    finally:
        stop(proc)
    assert not (out / "serve.json").exists() and (out / "checkpoints").is_dir()
