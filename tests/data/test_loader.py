"""Packed data: a seeded order, an O(1) jump to any cursor, the same batches with workers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ember.ckpt.state import DataCursor
from ember.errors import EmberError
from ember.recipe import DataConfig
from ember.data.loader import (
    PackedBatches,
    data_fingerprint,
    make_loader,
    read_documents,
    tokenize,
)
from ember.data.tokenizer import ByteTokenizer


def stream(tmp_path: Path, n_tokens: int) -> Path:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(n_tokens, dtype=np.uint32))
    return path


def test_each_epoch_is_a_permutation_seeded_by_seed_and_epoch(tmp_path):
    batches = PackedBatches(stream(tmp_path, 100 * 4), seq_len=4, micro_batch=10, seed=5,
                            start=DataCursor())
    epoch0 = torch.cat([batches.batch(k).ids for k in range(10)])  # 10 batches of 10 = one epoch
    epoch1 = torch.cat([batches.batch(k).ids for k in range(10, 20)])
    firsts0, firsts1 = sorted(epoch0[:, 0].tolist()), sorted(epoch1[:, 0].tolist())
    assert firsts0 == firsts1 == list(range(0, 400, 4))  # every sequence once per epoch
    assert not torch.equal(epoch0, epoch1)  # a new order each epoch
    again = PackedBatches(stream(tmp_path, 400), 4, 10, seed=5, start=DataCursor())
    other = PackedBatches(stream(tmp_path, 400), 4, 10, seed=6, start=DataCursor())
    assert torch.equal(again.batch(3).ids, batches.batch(3).ids) and not torch.equal(other.batch(3).ids, batches.batch(3).ids)


def test_resume_at_a_cursor_yields_exactly_the_continuation(tmp_path):
    path = stream(tmp_path, 37 * 8 + 5)  # a ragged tail, dropped
    full = PackedBatches(path, seq_len=8, micro_batch=3, seed=1, start=DataCursor())
    assert full.num_sequences == 37
    cursor = full.cursor_after(29)  # crosses two epoch boundaries: 87 = 2 * 37 + 13
    assert cursor == DataCursor(epoch=2, offset=13)
    resumed = PackedBatches(path, 8, 3, seed=1, start=cursor)
    for k in range(20):
        assert resumed[k][0] == full[29 + k][0] == 29 + k  # the ordinal in the stream
        assert torch.equal(resumed.batch(k).ids, full.batch(29 + k).ids)


def test_jump_cost_does_not_grow_with_position(tmp_path):
    path = stream(tmp_path, 10_000 * 16)

    def first_batch_seconds(cursor: DataCursor) -> float:
        t0 = time.perf_counter()
        PackedBatches(path, 16, 4, seed=0, start=cursor).batch(0)
        return time.perf_counter() - t0

    near = min(first_batch_seconds(DataCursor(0, 10)) for _ in range(5))
    far = min(first_batch_seconds(DataCursor(10_000_000, 10)) for _ in range(5))
    assert far < near * 5 + 0.01  # O(1): a billion sequences in costs what ten do


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_delivers_the_same_batches_with_any_worker_count(tmp_path, workers):
    path = stream(tmp_path, 50 * 8)
    batches = PackedBatches(path, 8, 4, seed=3, start=DataCursor(1, 7))
    got = list(make_loader(batches, 30, workers=workers, pin=False))
    assert len(got) == 30
    for k, (ordinal, batch) in enumerate(got):
        assert ordinal == batches.first_ordinal + k and torch.equal(batch.ids, batches.batch(k).ids)


def test_loader_leaves_out_skipped_batches(tmp_path):
    batches = PackedBatches(stream(tmp_path, 50 * 8), 8, 2, seed=3, start=DataCursor(0, 4))
    assert batches.first_ordinal == 2
    got = [ordinal for ordinal, _ in make_loader(batches, 5, workers=0, pin=False, skip={3, 5})]
    assert got == [2, 4, 6, 7, 8]


def test_loader_does_not_draw_from_the_global_torch_rng(tmp_path):
    batches = PackedBatches(stream(tmp_path, 400), 4, 2, seed=0, start=DataCursor())
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    next(iter(make_loader(batches, 3, workers=0, pin=False)))
    assert torch.equal(torch.rand(1), expected)


def test_tokenize_packs_documents_with_eos_and_caches(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    tok = ByteTokenizer()
    cfg = DataConfig(files=[str(f)], seq_len=2)
    fp = data_fingerprint(cfg.files, tok)
    path = tokenize(cfg, tok, fp)
    assert np.load(path).tolist() == [97, 98, 256, 99, 256]
    assert tokenize(cfg, tok, fp) == path
    f.write_text(json.dumps({"text": "abd"}) + "\n")
    assert data_fingerprint(cfg.files, tok) != fp  # content, not name, identifies the data


@pytest.mark.parametrize("name,content,fragment", [
    ("a.jsonl", '{"text": "ok"}\n{"text": \n', "a.jsonl:2: not valid JSON"),
    ("b.jsonl", '{"body": "no text field"}\n', "b.jsonl:1: no string field 'text'"),
    ("c.csv", "x,y\n", "unsupported type '.csv'"),
    ("d.jsonl", '{"text": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n",
     r"d.jsonl:2: not valid JSON \(nested too deeply to read\)"),
])
def test_bad_data_files_are_named_with_line_numbers(tmp_path, name, content, fragment):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(EmberError, match=fragment):
        read_documents(f, "text")


def test_empty_dataset_is_refused(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.zeros(3, dtype=np.uint32))
    with pytest.raises(EmberError, match="fewer than one sequence of seq_len = 8"):
        PackedBatches(path, 8, 1, 0, DataCursor())


def test_tokenizers_differing_in_eos_or_chat_template_do_not_share_a_token_store(tmp_path):
    """The store was keyed by the tokenizer's vocabulary alone: a model with the same
    tokenizer.json but another end-of-sequence token or chat template (a base model and its
    instruct version) was given the first one's tokens ([3, 4, 1] where its own are [3, 4, 2])."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from ember.data.formats import encode
    from ember.data.tokenizer import HFTokenizer

    def tokenizer(eos: str, template: str) -> HFTokenizer:
        backend = Backend(WordLevel({"?": 0, "</s>": 1, "<e>": 2, "hi": 3, "yo": 4}, unk_token="?"))
        backend.pre_tokenizer = Whitespace()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, additional_special_tokens=["</s>", "<e>"], eos_token=eos)
        tok.chat_template = template
        return HFTokenizer(tok)
    plain = "{% for m in messages %}{{ m.content }} {% endfor %}"
    roles = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(record) + "\n")
    cfg = DataConfig(files=[str(f)])
    for tok in (tokenizer("</s>", plain), tokenizer("<e>", plain), tokenizer("</s>", roles)):
        path = tokenize(cfg, tok, data_fingerprint(cfg.files, tok))
        assert np.load(path).tolist() == encode(record, "chat", tok, "text", "assistant", "c.jsonl:1").ids
