"""The inference engine and its worker: base and LoRA adapters of real runs, swapped without
reloading the base; the OpenAI-compatible API in-process; the worker process once."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from ember.ckpt.contents import MODEL_FILE
from ember.ckpt.state import seed_all
from ember.ckpt.store import CheckpointStore
from ember.errors import EXIT_ERROR
from ember.events import Events
from ember.infer.engine import Engine, RequestError
from ember.models import BYTE_EOS, tiny_config
from ember.web.infer_worker import create_app, main
from ember.web.security import WORKER_TOKEN_ENV
from tests.helpers import ROOT, run_ember, wait_until, write_recipe

SEED = 7  # write_recipe's train.seed: builtin:tiny's init, which the engine must match
PROMPT = "In the beginning God"
WORKER_TOKEN = "the-service-gave-me-this"
WORKER_AUTH = {"Authorization": f"Bearer {WORKER_TOKEN}"}
IDS = [BYTE_EOS, *PROMPT.encode()]  # builtin:tiny's prompt: its bytes, after the end-of-document token


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    """The worker process, on a folder of runs still empty: it starts before the run trains, so
    the two start-ups overlap, and finds the run when asked (it rescans the folder)."""
    root = tmp_path_factory.mktemp("runs")
    with open(root.parent / "worker.err", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ember.web.infer_worker", "--model", "builtin:tiny",
                                 "--runs", str(root), "--seed", str(SEED), "--port", "0"],
                                stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                                env={**os.environ, WORKER_TOKEN_ENV: WORKER_TOKEN})  # as the service starts it
        yield proc, root, root.parent / "worker.err"
        if proc.poll() is None:  # the test stops it; this is for a test that failed first
            proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def runs(worker) -> Path:
    """A folder of runs: `a`, a LoRA run trained 6 steps (checkpoints at steps 3 and 6); `full`,
    a full fine-tuning run's record; `other`, a LoRA run's record on another seed's init."""
    root = worker[1]
    recipe = write_recipe(root.parent / "recipe", method={"kind": "lora", "rank": 4},
                          train={"max_steps": 6}, checkpoint={"every_steps": 3})
    result = run_ember("run", recipe, "--out", root / "a", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((root / "a" / "run.json").read_text())
    for name, (section, key, value) in {"full": ("method", "kind", "full"), "other": ("train", "seed", 3)}.items():
        (root / name).mkdir()
        changed = json.loads(json.dumps(record))
        changed["recipe"][section][key] = value
        (root / name / "run.json").write_text(json.dumps(changed))
    return root


@pytest.fixture(scope="module")
def engine(runs: Path) -> Engine:
    e = Engine("builtin:tiny", [runs], seed=SEED)
    e.load()
    return e


@pytest.fixture(scope="module")
def client(engine: Engine):
    with TestClient(create_app(engine)) as c:
        yield c


def complete(client: TestClient, model: str = "base", **body) -> dict:
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 24,
                                             "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def read_sse(client: TestClient, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a stream, after checking its framing: `data: ...` events, [DONE] last."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", raw[-200:]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def reference_logits(ids: list[int], adapter: Path | None = None) -> torch.Tensor:
    """Next-token logits from builtin:tiny built here, with peft's own loading of a saved adapter."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    seed_all(SEED)
    model = LlamaForCausalLM(tiny_config())
    if adapter is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft's deprecation chatter
            model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0, -1]


def test_health_says_loading_until_the_model_is_ready():
    gate = threading.Event()

    class Held(Engine):
        def load(self) -> None:
            assert gate.wait(60)
            super().load()

    with TestClient(create_app(Held("builtin:tiny", [], seed=SEED))) as c:
        try:
            r = c.get("/health")
            assert (r.status_code, r.json()) == (503, {"status": "loading"})
            r = c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        finally:
            gate.set()
        deadline = time.monotonic() + 60
        while c.get("/health").status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = c.get("/health")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_models_are_base_and_the_lora_runs_trained_on_this_base(client: TestClient):
    r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["object"] == "list"
    data = r.json()["data"]
    assert [m["id"] for m in data] == ["base", "a"]  # not `full` (no adapter), not `other` (another base)
    assert all(m["object"] == "model" for m in data)
    assert data[1]["checkpoint_step"] == 6


def test_an_adapter_is_swapped_onto_the_same_base_and_off_again(engine: Engine, runs: Path):
    model = engine.model
    base = engine.next_token_logits("base", PROMPT)
    adapted = engine.next_token_logits("a", PROMPT)
    again = engine.next_token_logits("base", PROMPT)
    assert torch.equal(base, reference_logits(IDS))  # the base the run trained on (seed 7's init)
    assert torch.equal(adapted, reference_logits(IDS, runs / "a" / "final"))  # the run's step-6 adapter
    assert not torch.equal(adapted, base)
    assert torch.equal(again, base)  # adapters off: exactly the base, which was never reloaded
    assert engine.model is model
    assert engine.loaded_adapters() == {"a": 6}


def test_completions_from_base_and_adapter_and_base_again(client: TestClient):
    base, lora, again = complete(client, "base"), complete(client, "a"), complete(client, "base")
    assert again["choices"][0]["text"] == base["choices"][0]["text"]
    assert lora["model"] == "a" and lora["object"] == "text_completion"
    for r in (base, lora):
        usage, finish = r["usage"], r["choices"][0]["finish_reason"]
        assert usage["prompt_tokens"] == len(IDS)
        assert finish in ("stop", "length")
        assert usage["completion_tokens"] == 24 if finish == "length" else usage["completion_tokens"] <= 24
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_streams_are_server_sent_events_of_the_same_text(client: TestClient):
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    whole = complete(client, "a")
    chunks = read_sse(client, "/v1/completions", body)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]

    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    message = r.json()["choices"][0]["message"]
    chunks = read_sse(client, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == message["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == r.json()["usage"]


def test_chat_on_the_byte_model_is_embers_own_template(client: TestClient):
    """The template training and evaluation render builtin:tiny's chats with (ember.data.tokenizer)."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len("<|user|>\nhi\n<|assistant|>\n") + 1


def test_a_stop_string_ends_the_text_before_it(client: TestClient):
    full = complete(client, max_tokens=40)["choices"][0]["text"]
    at = next(i for i in range(1, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    stop = full[at:at + 2]  # two tokens (bytes): the first is held back until the second decides
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": [stop, "absent"]}
    r = complete(client, **{k: v for k, v in body.items() if k != "model"})
    assert r["choices"][0]["text"] == full[:full.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
    chunks = read_sse(client, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:full.find(stop)]


@pytest.mark.parametrize("path, request_kw, status, says", [
    ("/v1/completions", {"content": b"{not json"}, 400, "not valid JSON"),
    ("/v1/completions", {"json": [1, 2]}, 400, "JSON object"),
    ("/v1/completions", {"json": {"max_tokens": 4}}, 400, "prompt"),
    ("/v1/completions", {"json": {"prompt": "x", "model": "nope"}}, 404, "no such model"),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": 0}}, 400, "max_tokens"),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": 5000, "stream": True}}, 400, "max_tokens"),
    ("/v1/completions", {"json": {"prompt": "x", "max_tokens": "5"}}, 400, "max_tokens"),
    ("/v1/completions", {"json": {"prompt": "x", "temperature": -1}}, 400, "temperature"),
    ("/v1/completions", {"json": {"prompt": "x", "model": "full"}}, 400, "only LoRA adapters"),
    ("/v1/completions", {"json": {"prompt": "x", "model": "other"}}, 400, "--seed 3"),
    ("/v1/completions", {"json": {"prompt": "x" * 2000}}, 400, "context"),
    ("/v1/completions", {"json": {"prompt": "x" * (1 << 20)}}, 413, "bytes"),
    ("/v1/chat/completions", {"json": {"model": "a"}}, 400, "messages"),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "user"}]}}, 400, "messages"),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                       "stream_options": [True]}}, 400, "stream_options"),
    ("/v1/nothing", {"json": {}}, 404, "Not Found"),
])
def test_bad_requests_are_refused_and_change_nothing(client: TestClient, engine: Engine, path, request_kw,
                                                     status, says):
    complete(client, "a", max_tokens=1)
    before = (complete(client, "base", max_tokens=6)["choices"][0]["text"], engine.loaded_adapters())
    r = client.post(path, **request_kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["type"]
    assert (complete(client, "base", max_tokens=6)["choices"][0]["text"], engine.loaded_adapters()) == before


def test_concurrent_requests_take_turns(client: TestClient):
    alone = {m: complete(client, m, max_tokens=8)["choices"][0]["text"] for m in ("base", "a")}
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda m: complete(client, m, max_tokens=8)["choices"][0]["text"], ["base", "a"] * 3))
    assert texts == [alone["base"], alone["a"]] * 3


def test_a_newer_checkpoint_is_served_and_a_damaged_or_unfit_one_is_not(runs: Path, tmp_path: Path):
    run = tmp_path / "c"
    shutil.copytree(runs / "a", run)
    seen = []
    e = Engine("builtin:tiny", [run], seed=SEED, events=Events(seen.append))  # one run folder, by name
    e.load()
    weights = load_file(run / "checkpoints" / "step-000000006" / MODEL_FILE)
    store = CheckpointStore(run / "checkpoints", keep_last=5)

    def commit(step: int, tensors: dict) -> Path:
        return store.save(step, lambda folder: save_file(tensors, folder / MODEL_FILE), meta={}).path

    unfit = commit(7, {k: v for k, v in weights.items() if "layers.0." not in k})  # another [method]'s
    with pytest.raises(RequestError, match="does not fit") as refused:
        e.next_token_logits("c", PROMPT)
    assert refused.value.status == 409 and e.loaded_adapters() == {}
    assert torch.equal(e.next_token_logits("base", PROMPT), reference_logits(IDS))  # the base, untouched
    shutil.rmtree(unfit)  # as the trainer retires a checkpoint

    first = e.next_token_logits("c", PROMPT)
    assert e.loaded_adapters() == {"c": 6}
    lora_layers = sum("lora_A" in n for n, _ in e.model.named_parameters())
    commit(8, {k: v * 2 if "lora_B" in k else v for k, v in weights.items()})
    second = e.next_token_logits("c", PROMPT)
    assert not torch.equal(first, second)
    assert e.loaded_adapters() == {"c": 8}
    assert sum("lora_A" in n for n, _ in e.model.named_parameters()) == lora_layers  # the old one is gone

    damaged = commit(9, weights) / MODEL_FILE
    damaged.write_bytes(damaged.read_bytes()[:-8] + b"\0" * 8)
    assert torch.equal(e.next_token_logits("c", PROMPT), second)  # still step 8's
    assert any("step-000000009" in ev.message and ev.kind == "warning" for ev in seen)


def test_a_folder_of_runs_is_rescanned_and_may_not_exist_yet(runs: Path, tmp_path: Path):
    seen, later = [], tmp_path / "later"
    e = Engine("builtin:tiny", [later], seed=SEED, events=Events(seen.append))
    assert [ev.kind for ev in seen] == ["warning"] and e.runs() == {}
    later.mkdir()
    shutil.copytree(runs / "a", later / "b")
    assert e.runs() == {"b": later / "b"} and [m["id"] for m in e.models()] == ["base", "b"]


def test_the_worker_refuses_a_port_in_use_and_a_runs_file(runs: Path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--model", "builtin:tiny", "--runs", str(runs), "--port", str(port)]) == EXIT_ERROR
    assert main(["--model", "builtin:tiny", "--runs", str(runs / "a" / "run.json")]) == EXIT_ERROR
    out, err = capsys.readouterr()
    assert out == "" and f"--port {port}" in err and "run.json: not a folder" in err


def test_the_worker_process_says_its_port_loads_and_serves(worker, runs: Path):
    proc, _, log = worker
    assert select.select([proc.stdout], [], [], 60)[0], "no line on stdout within 60 s"
    line = proc.stdout.readline()
    match = re.fullmatch(r"listening on (http://127\.0\.0\.1:\d+)\n", line)
    assert match, (line, log.read_text()[-2000:])
    url, statuses = match.group(1), []
    deadline = time.monotonic() + 60
    with httpx.Client() as http:  # one client for the poll: httpx.get() builds one (21 CPU-ms) each call
        while time.monotonic() < deadline and statuses[-1:] != [200]:
            statuses.append(http.get(f"{url}/health", timeout=10, headers=WORKER_AUTH).status_code)
            time.sleep(0.05)
    assert statuses[-1] == 200 and set(statuses) <= {503, 200}, statuses
    # Its port is on loopback: without the token the service gave it, nothing is answered.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": WORKER_TOKEN}):
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = httpx.request(method, f"{url}{path}", headers=headers, timeout=10,
                              json={"prompt": PROMPT, "max_tokens": 4} if method == "POST" else None)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, headers)
    models = httpx.get(f"{url}/v1/models", timeout=10, headers=WORKER_AUTH).json()["data"]
    assert [m["id"] for m in models] == ["base", "a"]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30,
                   headers=WORKER_AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM), log.read_text()[-2000:]  # uvicorn re-raises it


def test_the_worker_exits_promptly_on_sigterm_even_mid_generation(tmp_path):
    """A generation that would run for 10 minutes (held at its first token) does not keep a
    SIGTERMed worker alive: it exits within its grace (issue 26, item 3). Before: uvicorn waited
    for the answer to the last token, and the service had to SIGKILL it."""
    with open(tmp_path / "worker.err", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ember.web.infer_worker", "--model", "builtin:tiny",
                                 "--seed", str(SEED), "--port", "0"], stdout=subprocess.PIPE, stderr=log,
                                text=True, cwd=ROOT,
                                env={**os.environ, "EMBER_FAULT": "infer.token", "EMBER_FAULT_HANG": "600"})
    try:
        url = proc.stdout.readline().split()[-1]
        with httpx.Client() as http:  # one client for the poll: httpx.get() builds one (21 CPU-ms) each call
            wait_until("the model loaded", lambda: http.get(f"{url}/health", timeout=10).status_code == 200, 120, 0.05)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 8, "stream": True}) as answer:
            first = next(answer.iter_lines())  # the generation has begun, and hangs at its first token
            assert first.startswith("data: "), first
            proc.send_signal(signal.SIGTERM)
            wait_until("the worker's exit after SIGTERM", lambda: proc.poll() is not None, 60, 0.05)
        assert proc.returncode == 0, (tmp_path / "worker.err").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_worker_takes_half_the_cores_and_refuses_no_threads(capsys):
    """Half the cores by default, as llama.cpp: beside a busy program, torch's threads on every
    core spin at each barrier (bench/README.md: 2.0 s a token against 0.14 s on 2 busy cores)."""
    from ember.web.infer_worker import default_threads
    assert default_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    assert main(["--model", "builtin:tiny", "--threads", "0"]) == EXIT_ERROR
    assert "--threads 0" in capsys.readouterr().err
