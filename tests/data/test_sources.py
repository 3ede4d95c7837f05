"""What the data files hold, as the token store sees it: a .txt file's held-out share in
blocks, every bad record listed at once (file:line and field), an empty file named."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from ember.errors import EmberError
from ember.models import BYTE_EOS
from ember.recipe import DataConfig, EvalConfig
from ember.data import sources, tokenize as sharded
from ember.data.loader import data_fingerprint, tokenize
from ember.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def build(home: Path, monkeypatch, files: list[Path], workers: int = 1, holdout: float = 0.0) -> Path:
    monkeypatch.setenv("EMBER_HOME", str(home))
    cfg = DataConfig(files=[str(f) for f in files], tokenize_workers=workers)
    return tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), ev=EvalConfig(holdout=holdout)).parent.parent


def documents(store: Path, split: str) -> list[str]:
    tokens, starts = np.load(store / split / "tokens.npy"), np.load(store / split / "docs.npy")
    return [bytes(t for t in tokens[a:b].tolist() if t != BYTE_EOS).decode() for a, b in zip(starts[:-1], starts[1:])]


def test_a_single_txt_file_holds_out_the_share_in_blocks(tmp_path, monkeypatch):
    text = "".join(f"line {i}: {'some words ' * (i % 5 + 1)}\n" for i in range(4000))  # ~200 KB
    (tmp_path / "book.txt").write_text(text)
    store = build(tmp_path / "h", monkeypatch, [tmp_path / "book.txt"], holdout=0.05)
    held, kept = documents(store, "eval"), documents(store, "train")
    share = sum(map(len, held)) / len(text)
    assert 0.04 < share < 0.06, share  # ~5%, not 0% or 100%
    assert len(held) >= 5 and sum(map(len, held + kept)) == len(text)  # every byte in one split, once
    for doc in held + kept:  # blocks and runs of blocks, cut at line ends
        at = text.index(doc)
        assert (at == 0 or text[at - 1] == "\n") and doc.endswith("\n")
    train = "".join(kept)
    assert not any(doc.splitlines()[0] in train.splitlines() for doc in held)  # no held-out line is trained on
    again = build(tmp_path / "h2", monkeypatch, [tmp_path / "book.txt"], holdout=0.05)
    assert documents(again, "eval") == held  # a pure function of the text and the seed


def test_a_txt_file_too_short_to_hold_out_the_share_is_refused_with_the_reason(tmp_path, monkeypatch):
    (tmp_path / "note.txt").write_text("a short note\nof three lines\nonly\n")
    with pytest.raises(EmberError, match=r"\[eval\] holdout = 0.05: .*note.txt .*gives 1 block\(s\), too few "
                                         r"to hold out 5.0% of the text"):
        build(tmp_path / "h", monkeypatch, [tmp_path / "note.txt"], holdout=0.05)


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(sources, "SHARD_BYTES", 300)
    monkeypatch.setattr(sharded, "POOL_MIN_BYTES", 0)


def test_every_bad_record_is_listed_with_its_line_and_field(tmp_path, monkeypatch, small_shards):
    """30 bad lines among 90, over several shards: one error counts them all and lists the
    first 20 in file order, each with file:line and what is wrong; the same for any worker count."""
    lines, bad = [], []
    for i in range(1, 91):
        if i % 3:
            lines.append(json.dumps({"text": f"record {i}"}))
            continue
        bad.append(i)
        lines.append(['{"text": "cut', json.dumps({"txt": "x"}), json.dumps({"text": i})][i // 3 % 3])
    f = tmp_path / "a.jsonl"
    f.write_text("\n".join(lines) + "\n")
    messages = []
    for workers in (1, 2):
        with pytest.raises(EmberError) as e:
            build(tmp_path / f"h{workers}", monkeypatch, [f], workers=workers)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    message = messages[0]
    assert message.startswith("30 bad records in the data files") and message.endswith("... and 10 more")
    assert [int(n) for n in re.findall(r"a\.jsonl:(\d+):", message)] == bad[:20]
    assert f"a.jsonl:3: no string field 'text'" in message
    assert f"a.jsonl:6: no string field 'text'" in message  # {"text": 6}: not a string
    assert f"a.jsonl:9: not valid JSON" in message


def test_bad_chat_and_parquet_records_name_the_field(tmp_path, monkeypatch, small_shards):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    chats = [ok] * 5 + [{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}] \
        + [ok] * 5 + [{"messages": []}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    with pytest.raises(EmberError, match=r"(?s)2 bad records.*c\.jsonl:6: messages\[1\]\.role = 'robot'.*"
                                         r"c\.jsonl:12: field 'messages' must be a non-empty list"):
        build(tmp_path / "h1", monkeypatch, [tmp_path / "c.jsonl"], workers=2)
    rows = [{"text": "fine"}, {"text": "also fine"}, {"text": None}, {"text": "ok"}, {"text": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet", row_group_size=2)
    with pytest.raises(EmberError, match=r"(?s)2 bad records.*bad\.parquet:row 2: no string field 'text'.*"
                                         r"bad\.parquet:row 4: no string field 'text'"):
        build(tmp_path / "h2", monkeypatch, [tmp_path / "bad.parquet"])


@pytest.mark.parametrize("name,content", [("empty.jsonl", ""), ("blank.jsonl", "\n \n"), ("empty.txt", ""),
                                          ("blank.txt", "\n\n"), ("empty.parquet", None)])
def test_an_empty_data_file_is_refused_by_name(tmp_path, monkeypatch, name, content):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "a record"}) + "\n")
    empty = tmp_path / name
    if content is None:
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    else:
        empty.write_text(content)
    with pytest.raises(EmberError, match=rf"\[data\] files: .*{re.escape(name)} holds no records \(it is empty, "
                                         rf"or blank\); fill it, or take it out of \[data\] files"):
        build(tmp_path / "h", monkeypatch, [good, empty])


def test_a_first_record_of_no_known_format_is_listed_with_the_others(tmp_path, monkeypatch):
    """The format comes from the first record that has one; a file where none has is refused."""
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [{"body": "x"}, {"text": "ok"}, {"body": "y"}]))
    with pytest.raises(EmberError, match=r"(?s)2 bad records.*a\.jsonl:1: no string field 'text'.*a\.jsonl:3: "):
        build(tmp_path / "h1", monkeypatch, [f])
    f.write_text("".join(json.dumps(r) + "\n" for r in [{"body": "x"}, {"body": "y"}]))
    with pytest.raises(EmberError, match=r"a\.jsonl:1: no 'messages' \(chat\), 'prompt' and 'completion', or 'text' "
                                         r"\(text\) field in any record"):
        build(tmp_path / "h2", monkeypatch, [f])


def test_parquet_shards_read_in_any_order_give_their_rows_and_in_order_continue_the_reader(tmp_path, monkeypatch):
    """Shards inside row groups, read in order, alternately (two workers) or backwards: each gives
    its rows, numbered in the file; one read in order starts where the last stopped (the rows
    before it are not decoded again), and a rewritten file is read anew."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    monkeypatch.setattr(sources, "SHARD_BYTES", 2000)
    rows = [{"text": f"row {i} " + "x" * (i % 50)} for i in range(3000)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1100)  # groups cut by shards
    shards = sources.plan([(str(path), 0.0)], "auto", "text", 0)[0]
    assert len(shards) > 20 and any(s.start % 1100 for s in shards)
    numbered = list(enumerate(rows))
    for order in (range(len(shards)), range(0, len(shards), 2), range(len(shards) - 1, -1, -1)):
        got = {k: list(sources.records(shards[k], "text")) for k in order}
        assert all(got[k] == numbered[shards[k].start:shards[k].stop] for k in order)
        sources.forget_readers()
    list(sources.records(shards[3], "text"))
    reader, at, begun = sources._READER[(str(path), path.stat().st_size, path.stat().st_mtime_ns)]
    assert at == shards[3].stop or at < shards[3].stop < at + begun.num_rows  # kept where shard 3 stopped
    list(sources.records(shards[4], "text"))
    assert next(iter(sources._READER.values()))[0] is reader  # continued, not reopened
    pq.write_table(pa.Table.from_pylist(rows[::-1]), path, row_group_size=1100)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert list(sources.records(shards[5], "text")) == list(enumerate(rows[::-1]))[shards[5].start:shards[5].stop]
    sources.forget_readers()


def test_a_lone_surrogate_or_an_overlong_number_is_a_bad_record_not_a_crash(tmp_path, monkeypatch):
    """A line holding half of an emoji (`"\\ud83d"`, as a cut string leaves it) or an integer of
    5,000 digits parses in Python's json; both were tracebacks (the tokenizer's UnicodeEncodeError,
    json's ValueError) instead of bad records named by line."""
    f = tmp_path / "s.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "cut \\ud83d here"}\n{"text": "x", "id": ' + "1" * 5000 + '}\n'
                 '{"text": "a whole emoji \\ud83d\\ude00 is fine"}\n')
    with pytest.raises(EmberError, match=r"(?s)2 bad records.*s\.jsonl:2: .*unpaired surrogate.*\\ud83d.*"
                                         r"s\.jsonl:3: not valid JSON \(.*4300 digits"):
        build(tmp_path / "h", monkeypatch, [f])


def test_a_byte_order_mark_starts_no_record(tmp_path, monkeypatch):
    """Windows editors begin a UTF-8 file with a byte order mark: a .jsonl file's first line was
    refused ("not valid JSON (Unexpected UTF-8 BOM ...)") and a .txt file's was trained on."""
    for name, text in [("a.jsonl", json.dumps({"text": "first"}) + "\r\n" + json.dumps({"text": "second"}) + "\r\n"),
                       ("b.txt", "In the beginning\n")]:
        plain, marked = tmp_path / "plain" / name, tmp_path / "marked" / name
        for path, prefix in ((plain, b""), (marked, b"\xef\xbb\xbf")):
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(prefix + text.encode())
        assert documents(build(tmp_path / f"h-{name}-bom", monkeypatch, [marked]), "train") == \
            documents(build(tmp_path / f"h-{name}", monkeypatch, [plain]), "train")


def test_a_txt_file_listed_twice_with_a_held_out_share_is_two_whole_copies(tmp_path, monkeypatch):
    """Listed twice (to weigh it double), a .txt file's blocks were cut as one stream across the
    two copies: 378,038 tokens stored for 213,802 of text, runs of blocks spanning both copies."""
    text = "".join(f"line {i}: {'some words ' * (i % 5 + 1)}\n" for i in range(4000))
    (tmp_path / "book.txt").write_text(text)
    once = build(tmp_path / "h1", monkeypatch, [tmp_path / "book.txt"], holdout=0.05)
    twice = build(tmp_path / "h2", monkeypatch, [tmp_path / "book.txt"] * 2, holdout=0.05)
    for split in ("train", "eval"):
        assert documents(twice, split) == documents(once, split) * 2


def test_a_file_in_both_data_and_eval_files_is_refused(tmp_path, monkeypatch):
    """A file named in [eval] files too: first it took the eval files' share (all) for its [data]
    listing, so with [eval] holdout = 0.1 every record was held out and training had 0 tokens;
    then it trained on its share while the eval split held the whole file again, its training
    records included: a 'held-out' loss over what the model trains on. Now refused, for a .jsonl
    file and a .txt file (whose blocks are shared out) alike, before anything is tokenized."""
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "h"))
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(100)))
    (tmp_path / "book.txt").write_text("".join(f"line {i}: {'some words ' * (i % 5 + 1)}\n" for i in range(4000)))
    for name in ("d.jsonl", "book.txt"):
        cfg = DataConfig(files=[str(tmp_path / name)])
        with pytest.raises(EmberError, match=f"\\[eval\\] files: .*{name} is the same file as \\[data\\] files'"):
            tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), ev=EvalConfig(holdout=0.1, files=cfg.files))
    assert not (tmp_path / "h" / "cache" / "tokens").exists() or not any((tmp_path / "h" / "cache" / "tokens").iterdir())


def test_a_held_out_share_that_holds_out_no_record_is_refused_with_the_reason(tmp_path, monkeypatch):
    """10 records at [eval] holdout = 0.05 (0.5 expected) held out none: the run trained with no
    evaluation at all, not a word said, and [eval] patience and prompts silently did nothing
    (a .txt file too short to share out is refused: so are these)."""
    records = [{"text": f"note {i}"} for i in range(10)]
    assert not any(sources.held_out(r, 0, 0.05) for r in records)
    f = tmp_path / "few.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    for attempt in ("built", "cached"):  # the same answer when the store is found built
        with pytest.raises(EmberError, match=r"\[eval\] holdout = 0.05 held out none of the 10 records .*about 0.5 "
                                             r"expected.*\[eval\] files"):
            build(tmp_path / "h", monkeypatch, [f], holdout=0.05)


def test_a_folder_that_is_not_a_saved_dataset_is_refused_before_its_files_are_hashed(tmp_path, monkeypatch):
    """A folder of .jsonl files (a natural guess) was hashed whole for the data fingerprint,
    every byte of every file under it, before the refusal: minutes for a large corpus."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "part-0.jsonl").write_text(json.dumps({"text": "a"}) + "\n")

    def hashed(path):
        raise AssertionError(f"{path} was hashed")
    monkeypatch.setattr(sources, "cached_sha256", hashed)
    with pytest.raises(EmberError, match=r"shards: a folder, but not a Hugging Face dataset saved with save_to_disk"):
        data_fingerprint([str(tmp_path / "shards")], TOK)


def test_a_txt_file_trains_on_its_line_ends_as_written_whatever_its_size_or_held_out_share(tmp_path, monkeypatch):
    """A .txt file read whole went through Python's newline translation (CRLF and a lone CR
    became LF) while one read in blocks (above 64 MB, or under [eval] holdout) kept its bytes: the
    same text trained on other tokens when it grew or when a share of it was held out."""
    text = "".join(f"line {i}\r\n" if i % 3 else f"line {i}\r" for i in range(300))
    (tmp_path / "w.txt").write_bytes(text.encode())
    whole = build(tmp_path / "h1", monkeypatch, [tmp_path / "w.txt"])
    assert documents(whole, "train") == [text]
    monkeypatch.setattr(sources, "LARGE_TEXT_BYTES", 100)
    assert documents(build(tmp_path / "h2", monkeypatch, [tmp_path / "w.txt"]), "train") == [text]


def test_a_file_replaced_by_other_bytes_of_its_size_and_mtime_is_hashed_again(tmp_path, monkeypatch):
    """The content-hash cache was keyed on (path, size, mtime): other bytes of the same size put
    in place by `cp -p`, `rsync -a` or `tar x` (which keep the mtime) were taken for the old file,
    so a run trained on the old file's cached tokens and a resume over changed data was allowed."""
    import os
    import shutil
    from ember.durable import sha256_file
    from ember.paths import cached_sha256
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "h"))
    f, other = tmp_path / "d.jsonl", tmp_path / "other.jsonl"
    f.write_text('{"text": "alpha"}\n')
    other.write_text('{"text": "omega"}\n')  # the same size
    os.utime(other, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
    before = cached_sha256(f)
    shutil.copy2(other, f)  # cp -p: other's bytes, and its (= f's old) mtime
    assert f.stat().st_mtime_ns == other.stat().st_mtime_ns and f.stat().st_size == other.stat().st_size
    assert cached_sha256(f) == sha256_file(f) != before
    third = tmp_path / "third.jsonl"
    third.write_text('{"text": "sigma"}\n')
    os.utime(third, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
    os.replace(third, f)  # rsync's way: a new file renamed over it, the same mtime
    assert cached_sha256(f) == sha256_file(f) and "sigma" in f.read_text()


@pytest.mark.parametrize("damage", ["cut short", "docs zeroed", "targets gone"])
def test_a_damaged_token_store_is_found_and_tokenized_again(tmp_path, monkeypatch, damage):
    """A token store was trusted as soon as its info.json was there, and its files were renamed
    into place unsynced: one cut short (a power cut after the rename, or a hand) failed every later
    run on the data with numpy's traceback (EOFError, 'mmap length is greater than file size'),
    and one of zeros trained on zeros. A store whose files disagree with its counts is now found,
    said, and tokenized again: the same tokens as before."""
    from ember.events import Events
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "h"))
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                                  {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                         for i in range(40)))
    cfg = DataConfig(files=[str(f)])
    path = tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK))
    folder = path.parent
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert set(before) == {"tokens.npy", "docs.npy", "targets.npy"}
    if damage == "cut short":
        with open(folder / "tokens.npy", "r+b") as fh:
            fh.truncate(len(before["tokens.npy"]) // 2)
    elif damage == "docs zeroed":
        (folder / "docs.npy").write_bytes(before["docs.npy"][:128] + bytes(len(before["docs.npy"]) - 128))
    else:
        (folder / "targets.npy").unlink()
    said = []
    again = tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), Events(lambda e: said.append(e.message)))
    assert again == path and {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert any(m.startswith(f"token cache {folder.parent} is damaged (") and m.endswith("tokenizing the data again")
               for m in said), said
    said.clear()
    tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), Events(lambda e: said.append(e.message)))
    assert not any("damaged" in m for m in said)  # sound now: read as it is
