"""Odd requests to the inference worker (what `ember serve` forwards to it as they are, and
answers with the worker's status): an odd value is a 400 that names the field at fault, never a
500, and changes nothing (the next request is answered as before); long stop strings, OpenAI's
text parts and a client that leaves cost no more than they should."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from ember.data.tokenizer import ByteTokenizer
from ember.infer.batching import Batcher
from ember.infer.engine import Engine, Sampling
from ember.web.infer_worker import create_app
from tests.helpers import post_and_leave, wait_until

HI = b'[{"role": "user", "content": "hi"}]'


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine("builtin:tiny", [], seed=7)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def client(engine: Engine):
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
    """null for stream, and stop strings with any characters, are answered as before. Seeded:
    unseeded, a request samples from fresh entropy, and now and then its first token was the end
    of text (finish_reason "stop", seen once in a run of the suite)."""
    for body in (b'{"prompt": "x", "max_tokens": 2, "seed": 1, "stream": null}',
                 b'{"prompt": "x", "max_tokens": 2, "seed": 1, "stream": false, "stop": ["\\ud800"]}'):
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text[:300]


def test_long_stop_strings_cost_what_the_text_costs(client):
    """Before: each token sliced every stop string at every length (250,000 slices of up to 250,000
    characters, for each of four stops), so one request with long stop strings held a CPU for
    minutes while its text was 100 bytes long."""
    stops = [c * 250_000 for c in "#$%&"]  # four of them: a body just under the worker's 1 MiB
    answer = {}

    def ask() -> None:
        answer["r"] = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 100,
                                                            "temperature": 0, "stop": stops})
    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(60)  # milliseconds of work: a generous deadline
    assert not asking.is_alive(), "the request with long stop strings was still generating after 60 s"
    r = answer["r"]
    assert r.status_code == 200, r.text[:300]
    plain = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 100, "temperature": 0})
    assert r.json()["choices"][0] == plain.json()["choices"][0]  # none of the stop strings in 100 bytes


def test_a_chat_past_the_context_says_so_without_a_max_tokens_it_never_sent(client):
    """Before: a chat request without max_tokens whose prompt filled the context was refused with
    "the prompt's 1225 tokens plus max_tokens = -201 are beyond the model's context"."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 1200}]})
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert "leave no room in the model's context of 1024 tokens" in message and "max_tokens" not in message, message


def test_chat_on_the_byte_model_is_rendered_as_training_renders_it(client):
    """Before: the engine rendered builtin:tiny's chats as 'user: hi' lines, while training and
    evaluation render them with ember's own template ('<|user|>' lines): a chat run was served
    prompts unlike any it was trained on, and answered them unlike its evaluation's completions."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a book."}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0})
    plain = client.post("/v1/completions", json={"prompt": ByteTokenizer().chat_prompt(messages),
                                                  "max_tokens": 8, "temperature": 0})
    assert chat.status_code == plain.status_code == 200, (chat.text[:300], plain.text[:300])
    assert chat.json()["usage"] == plain.json()["usage"]
    assert chat.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["text"]


def test_content_as_openais_text_parts_is_the_text_they_hold(client):
    """Before: content as a list of parts, OpenAI's newer form (and one training reads), was a 400
    'messages: a non-empty list of {"role": str, "content": str}'."""
    parts = [{"type": "text", "text": "Name "}, {"type": "text", "text": "a book."}]
    answers = [client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                         "max_tokens": 8, "temperature": 0})
               for content in (parts, "Name a book.")]
    assert [r.status_code for r in answers] == [200, 200], answers[0].text[:300]
    assert answers[0].json()["choices"] == answers[1].json()["choices"]
    assert answers[0].json()["usage"] == answers[1].json()["usage"]
    image = [*parts, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": image}], "max_tokens": 8})
    assert r.status_code == 400 and "messages[0].content[2] is a 'image_url' part" in r.json()["error"]["message"]


# Gemma's chat template refuses a system turn, and Mistral's and Llama 2's roles that do not
# alternate, with the template's raise_exception; this is the gist of them.
STRICT_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                   "{% endif %}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                   "{% endif %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
                   "{% if add_generation_prompt %}<assistant> {% endif %}")


@pytest.fixture(scope="module")
def strict_client(tmp_path_factory: pytest.TempPathFactory):
    """The worker over a tiny Llama whose tokenizer (whole words) has STRICT_TEMPLATE."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    words = ["<unk>", "</s>", "<user>", "<assistant>", "<system>", "hi", "there", "be", "brief"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    tok.chat_template = STRICT_TEMPLATE
    folder = tmp_path_factory.mktemp("strict-template")
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    engine = Engine(str(folder), [])
    engine.load()
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("messages, says", [
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "System role not supported"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}], "roles must alternate"),
], ids=["system-turn", "two-user-turns"])
def test_messages_the_chat_template_refuses_are_a_400_saying_why(strict_client, messages, says):
    """Before: the template's raise_exception escaped as jinja2's TemplateError, a 500."""
    r = strict_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["message"].startswith("messages: ") and says in error["message"], error
    ok = strict_client.post("/v1/chat/completions", json={"messages": messages[1:], "max_tokens": 2})
    assert ok.status_code == 200, ok.text[:300]


def test_a_client_that_leaves_before_the_whole_answer_frees_the_engine(engine, monkeypatch):
    """Before: an answer not streamed was generated to its last token after its client had gone
    (up to max_tokens, 4096: minutes on a CPU for a real model, its place in the batch taken).
    The worker is the service's (it answers only with the token)."""
    alone = engine.generate("base", "In the beginning", Sampling(max_tokens=100, temperature=0))
    alone.text()
    assert alone.usage.finish_reason == "length"  # alone, it makes all of its 100 tokens
    made = []
    emit = Batcher._emit

    def lockstep(self, job, token):  # the loop waits for each token to be taken, or the job cancelled
        emit(self, job, token)
        made.append(token)
        wait_until("the token taken or the job cancelled", lambda: job.cancelled.is_set() or job.out.empty(),
                   60, 0.001)
    monkeypatch.setattr(Batcher, "_emit", lockstep)
    post_and_leave(create_app(engine, "the-token"), "/v1/completions",
                   {"prompt": "In the beginning", "max_tokens": 100, "temperature": 0},
                   {"authorization": "Bearer the-token"})
    assert len(made) < 100, "the generation went on to its last token after its client had left"


@pytest.mark.parametrize("record", [{"recipe": {"method": "lora"}}, {"recipe": {"method": {"kind": "lora"}, "model": 3}},
                                    {"recipe": {"method": {"kind": "lora"}, "train": []}},
                                    {"recipe": {"method": {"kind": "lora"}}, "model": "x"}])
def test_a_run_whose_record_holds_a_table_as_another_type_is_left_out_not_a_500(tmp_path, record):
    """A run folder whose run.json has an object's place taken by something else ([method] as a
    string: `"method": "lora"`) made GET /v1/models and every request a 500 (AttributeError:
    'str' object has no attribute 'get'). It is left out of the models, and a request naming it
    is a 409 saying which entry and what to do; the base answers as before."""
    import json
    run = tmp_path / "odd"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(record))
    engine = Engine("builtin:tiny", [run], seed=7)
    engine.load()
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        models = c.get("/v1/models")
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["base"], models.text
        r = c.post("/v1/completions", json={"model": "odd", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 409 and ("run.json: its 'recipe." in r.text or "run.json: its 'model'" in r.text), r.text
        assert "is not an object" in r.text and "restore it from a backup" in r.text, r.text
        assert greedy(c)


def test_embeddings_on_the_built_in_engine_is_a_404_saying_where_they_are_served(client):
    """POST /v1/embeddings (a route the service forwards) was Starlette's bare "Not Found": as
    if the URL were mistyped. It says the built-in engine computes none and which engine does."""
    r = client.post("/v1/embeddings", json={"input": "hi", "model": "base"})
    assert r.status_code == 404 and "computes no embeddings" in r.json()["error"]["message"], r.text
    assert "[inference] upstream" in r.json()["error"]["message"]
