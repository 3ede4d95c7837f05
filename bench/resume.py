"""Time from process start to the first step after a resume, at step 10 and at step 10,000 of a
long data stream (the builtin tiny model on Genesis: step 10,000 is ~25 epochs in). Goal: no
growth with position, since the data cursor jumps straight to (epoch, offset).

usage: python bench/resume.py [--rounds 3]
"""

from __future__ import annotations

import argparse
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
FAR = 10_000
RECIPE = f"""
[model]
path = "builtin:tiny"
[data]
files = ["{ROOT / 'examples/data/genesis.jsonl'}"]
seq_len = 64
[train]
max_steps = {FAR + 100}
micro_batch = 8
threads = 1
[checkpoint]
every_steps = {{every}}
keep_last = 1
"""


def ember(recipe: Path, out: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", "run", str(recipe), "--out", str(out)],
                          env={**os.environ, **env}, capture_output=True, text=True)


def make_run(work: Path, at: int) -> tuple[Path, Path]:
    """A run folder whose newest checkpoint is at step `at` (trained for real, then killed)."""
    recipe = work / f"r{at}.toml"
    recipe.write_text(RECIPE.replace("{every}", str(at)))
    out = work / f"run{at}"
    result = ember(recipe, out, {"EMBER_FAULT": f"train.micro_batch@{at + 1}"})
    assert result.returncode == -9, result.stderr
    return recipe, out


def time_to_first_step(recipe: Path, out: Path, at: int) -> float:
    """Start a resume, kill it right after its first step; seconds from exec to that step."""
    trial = out.with_name(out.name + "-trial")
    shutil.rmtree(trial, ignore_errors=True)
    shutil.copytree(out, trial)
    t0 = time.time()
    result = ember(recipe, trial, {"EMBER_FAULT": "train.micro_batch@2"})
    assert result.returncode == -9 and "resuming from" in result.stderr, result.stderr
    first = [json.loads(line) for line in (trial / "metrics.jsonl").read_text().splitlines()][-1]
    assert first["step"] == at + 1
    return first["time"] - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-resume-bench-"))
    os.environ["EMBER_HOME"] = str(work / "home")
    os.environ["HF_HUB_OFFLINE"] = "1"
    t0 = time.time()
    runs = {at: make_run(work, at) for at in (10, FAR)}
    print(f"prepared checkpoints at steps 10 and {FAR} in {time.time() - t0:.0f} s", flush=True)
    times: dict[int, list[float]] = {10: [], FAR: []}
    for r in range(args.rounds):
        for at, (recipe, out) in runs.items():
            times[at].append(time_to_first_step(recipe, out, at))
        print(f"round {r + 1}: " + ", ".join(f"step {at}: {t[-1]:.2f} s" for at, t in times.items()),
              flush=True)
    near, far = statistics.median(times[10]), statistics.median(times[FAR])
    print(f"\nprocess start -> first step after resume, median of {args.rounds}:")
    print(f"  at step 10:     {near:.2f} s\n  at step {FAR}: {far:.2f} s\n  ratio far/near: {far / near:.3f}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
