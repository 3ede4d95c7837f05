"""Records longer than seq_len: the answer kept, the end cut, or the record dropped; the learned
tokens counted after the cut and the packing (what the rows really learn); the refusal and the
warning a run gives with them; a step with no learned token judged a fault."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ember.ckpt.state import DataCursor
from ember.errors import EmberError
from ember.events import Events, collect
from ember.recipe import DataConfig, GuardConfig, Recipe
from ember.train import stability
from ember.data import truncation
from ember.data.loader import PackedBatches, data_fingerprint, tokenize
from ember.train.job import data_notes
from ember.data.tokenizer import ByteTokenizer
from ember.data.truncation import learned_in, learning

TOK = ByteTokenizer()
SEQ = 48


def chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def rendered(record: dict) -> int:
    """Tokens of a chat record through the byte model's template, with its end-of-sequence token."""
    u, a = (m["content"] for m in record["messages"])
    return len(f"<|user|>\n{u}\n<|assistant|>\n{a}\n".encode()) + 1


# Ten short records and four whose prompt alone is longer than a row.
RECORDS = [chat(f"q{i}", f"answer {i}") for i in range(10)] + [chat("long " * (12 + i), f"kept {i}") for i in range(4)]
LONG = 4


def store(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(files=[str(f)])
    return tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK))


def rows_learn(path: Path, rule: str, packing: str) -> tuple[int, bytes]:
    """What one epoch of rows learns: the count the loss divides by, and the learned bytes."""
    b = PackedBatches(path, SEQ, 1, 0, DataCursor(), packing, rule)
    count, text = 0, b""
    for r in range(b.num_sequences):
        mb = b.take([r])
        count += mb.targets()
        labels = mb.labels[0, 1:]
        text += bytes(int(t) for t in labels[labels != -100] if t < 256) + b"|"
    return count, text


@pytest.mark.parametrize("packing", ["documents", "padded"])
@pytest.mark.parametrize("rule", ["keep_answer", "truncate", "drop"])
def test_each_rule_counts_what_the_rows_really_learn(tmp_path, rule, packing):
    path = store(tmp_path, RECORDS)
    got = learning(path, SEQ, packing, rule)
    count, text = rows_learn(path, rule, packing)
    assert got.learned == count  # the figure a run prints is what its loss learns
    answers = sum(len(f"answer {i}\n") + 1 for i in range(10))  # learned: content, newline, end-of-sequence
    kept = sum(len(f"kept {i}\n") + 1 for i in range(4))
    assert got.before == answers + kept and got.records == 14
    if rule == "keep_answer":  # every answer whole, each long prompt cut at its beginning
        assert (got.learned, got.cut, got.emptied, got.dropped) == (answers + kept, 0, 0, 0)
        assert all(f"kept {i}\n".encode() in text for i in range(4))
    elif rule == "truncate":  # the long records' first SEQ tokens are all prompt: nothing left of theirs
        assert (got.learned, got.cut, got.emptied, got.dropped) == (answers, LONG, LONG, 0)
        assert b"kept" not in text
    else:
        assert (got.learned, got.cut, got.emptied, got.dropped) == (answers, LONG, LONG, LONG)


def test_an_answer_longer_than_a_row_keeps_its_beginning_after_half_a_row_of_prompt(tmp_path):
    record = chat("u" * 40, "a" * 60)
    path = store(tmp_path, [record])
    b = PackedBatches(path, SEQ, 1, 0, DataCursor(), "padded", "keep_answer")
    mb = b.take([0])
    ids, labels = mb.ids[0].tolist(), mb.labels[0].tolist()
    assert len(ids) == SEQ
    assert bytes(ids[:SEQ // 2]).endswith(b"u\n<|assistant|>\n") and ids[SEQ // 2:] == [ord("a")] * (SEQ // 2)
    assert [t for t in labels if t != -100] == [ord("a")] * (SEQ // 2)
    got = learning(path, SEQ, "padded", "keep_answer")
    assert (got.learned, got.before, got.cut, got.emptied) == (SEQ // 2, 62, 1, 0)


def test_nothing_left_is_refused_with_the_counts_and_a_seq_len_that_fits(tmp_path):
    records = [chat("long " * (12 + i), f"kept {i}") for i in range(20)]
    got = learning(store(tmp_path, records), SEQ, "documents", "truncate")
    lengths = [rendered(r) for r in records]
    p95 = math.ceil(np.percentile(lengths, 95))
    assert got.learned == 0 and got.emptied == 20
    said = got.refusal()
    assert "none of the 20 training records keeps a learned token in rows of seq_len 48" in said
    assert f"seq_len = {p95} would keep 95% of them whole" in said
    assert f"{max(lengths)}, {max(lengths) - 5}, {max(lengths) - 10} tokens" in said  # the longest records
    assert 'long_records = "keep_answer"' in said
    assert got.warning() is not None  # all of them: far above the share


def test_the_warning_comes_above_five_percent_of_records_losing_all(tmp_path):
    short = [chat(f"q{i}", f"answer {i}") for i in range(38)]
    one = learning(store(tmp_path / "a", short + [chat("long " * 20, "x")]), SEQ, "documents", "truncate")
    two = learning(store(tmp_path / "b", short + [chat("long " * 20, "x"), chat("long " * 21, "y")]),
                   SEQ, "documents", "truncate")
    assert one.emptied == 1 and one.warning() is None  # 1 of 39: 2.6%
    assert two.emptied == 2 and two.refusal() is None  # 2 of 40 is 5%: not more than the share
    three = learning(store(tmp_path / "c", short + [chat("long " * (20 + i), "x") for i in range(3)]),
                     SEQ, "documents", "truncate")
    assert "3 of 41 training records (7%) lose all their learned tokens in rows of seq_len 48" in three.warning()


def test_learned_tokens_are_summed_a_block_at_a_time(monkeypatch):
    rng = np.random.default_rng(0)
    targets = (rng.random(5000) < 0.3).astype(np.uint8)
    starts = np.sort(rng.choice(4900, 300, replace=False))
    ends = starts + rng.integers(0, 100, 300)
    ends = np.maximum.accumulate(ends)  # in order, as records and their pieces are
    want = np.array([int(targets[s:e].sum()) for s, e in zip(starts, ends)])
    monkeypatch.setattr(truncation, "BLOCK", 37)
    assert learned_in(targets, starts, ends).tolist() == want.tolist()


def test_a_step_with_no_learned_token_is_judged_empty():
    g = GuardConfig()
    assert stability.judge(math.nan, 0.0, 0, [], g, scaler_handles_inf=False).kind == "empty"
    assert stability.judge(2.0, 1.0, 12, [], g, scaler_handles_inf=False).kind == "ok"
    assert stability.judge(math.nan, 1.0, 12, [], g, scaler_handles_inf=False).kind == "nonfinite"


@pytest.mark.parametrize("rule", ["truncate", "drop"])
def test_the_run_refuses_before_training_when_nothing_is_left(tmp_path, rule):
    """data_notes, which prepare() calls before the first step: refused with the counts, whether
    the records lost their answers or were all left out."""
    records = [chat("long " * (12 + i), f"kept {i}") for i in range(6)]
    path = store(tmp_path, records)
    recipe = Recipe()
    recipe.data = DataConfig(files=[str(tmp_path / "chat.jsonl")], seq_len=SEQ, long_records=rule)
    with pytest.raises(EmberError, match=r"nothing to learn: none of the 6 training records .* seq_len = \d+ would keep"):
        data_notes(recipe, path, Events())
    recipe.data.long_records = "keep_answer"
    events, seen = collect()
    notes = data_notes(recipe, path, events)
    assert notes["learning"]["learned"] == notes["learning"]["before"] == sum(len(f"kept {i}\n") + 1 for i in range(6))
    assert notes["warnings"] == [] and "6 longer than seq_len 48: prompt's beginning cut" in seen[0].message


def test_records_with_every_answer_masked_are_refused_without_advising_a_longer_seq_len(tmp_path):
    """Every assistant turn of weight 0: no seq_len learns anything, so the refusal names the
    weights and train_on, not a seq_len (which it once advised even when already longer)."""
    masked = [{"messages": [{"role": "user", "content": f"question {i}"},
                            {"role": "assistant", "content": f"answer {i}", "weight": 0}]} for i in range(6)]
    path = store(tmp_path, masked)
    recipe = Recipe()
    recipe.data = DataConfig(files=[str(tmp_path / "chat.jsonl")], seq_len=4 * SEQ)
    with pytest.raises(EmberError) as refused:
        data_notes(recipe, path, Events())
    message = str(refused.value)
    assert "nothing to learn: none of the 6 training records" in message
    assert "weight 0" in message and 'train_on = "all"' in message
    assert "seq_len =" not in message and "Raise [data] seq_len" not in message
