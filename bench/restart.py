"""Where a restart's seconds go, and what two interruptions cost a 300-step job (issue 31, item 3).

1. **Timeline of a resume**: `ember run` resuming a copy of a run folder checkpointed at step 100
   (the builtin tiny model, micro batch 8 x 128 tokens, 1 thread, the job of bench/remote.py),
   killed right after its first step. A driver runs the CLI in-process with timers around the
   start path's functions (ember.launch, ember.train.job, ember.train.resume), each span appended
   to a file as it ends; the rest is the gap to the first step's metrics record. Phases: Python
   start (kernel's process start to the driver's first line), CLI imports, training imports
   (torch, transformers, peft; what the CLI imports before `prepare`), then each function.
2. **Two interruptions**: the same 300-step job uninterrupted, and interrupted by SIGTERM (what
   `scontrol requeue` sends) once step 100 and step 200 are logged, each time started again as a
   new `ember run` (what a requeue does), with no supervisor; goodput from `ember report --json`.

With `--before COMMIT`, ember at that commit (a `git archive`, its own folder, its own
$EMBER_HOME) runs as a second arm; the arms alternate in every round. Figures are printed,
never asserted; the interrupted runs must end bit-identical to the uninterrupted ones.

usage: python bench/restart.py [--rounds 5] [--before COMMIT] [--goodput-rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from startup import source_at  # noqa: E402  (bench/startup.py: another commit's tree as an arm)
from tests.helpers import GENESIS, assert_same_result, write_recipe  # noqa: E402

JOB = {"data": {"files": [str(GENESIS)], "seq_len": 128}, "optimizer": {"lr": 1e-3},
       "schedule": {"warmup_steps": 3},
       "train": {"max_steps": 300, "micro_batch": 8, "seed": 7, "threads": 1},
       "checkpoint": {"every_steps": 25, "keep_last": 2}}

# Runs `ember run ARGS` in this process with a timer around each function named in SPANS (those
# an arm lacks are skipped); each span is appended to $RESTART_SPANS as soon as it ends.
DRIVER = r'''
import os, sys, time, json, functools, importlib
t_main = time.time()
sys.path[0] = os.getcwd()  # as `python -m ember` has it (the manifest's package cache is keyed by sys.path)
_out = open(os.environ["RESTART_SPANS"], "a")
def span(name, t0, t1):
    _out.write(json.dumps([name, t0, t1]) + "\n"); _out.flush()
from ember.proc import process_start_time
span("python start", process_start_time(), t_main)
t = time.time(); import ember.cli.main; span("CLI imports", t, time.time())
t = time.time(); import ember.train.job, ember.train.loop, ember.train.signals; span("training imports", t, time.time())
def timed(module, name, label=None):
    mod = importlib.import_module(module)
    fn = getattr(mod, name, None)
    if fn is None:
        return
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.time()
        span("begin " + (label or name), t0, t0)  # an enclosing call never ends: the kill comes first
        try:
            return fn(*a, **k)
        finally:
            span(label or name, t0, time.time())
    setattr(mod, name, wrapper)
for module, names in json.loads(os.environ["RESTART_WRAP"]).items():
    for name in names:
        timed(module, name)
sys.argv = ["ember"] + sys.argv[1:]
ember.cli.main.main(sys.argv[1:])
'''

SPANS = {  # module -> functions on the start path; train_here and prepare never end (the kill): their
           # begin marks split the gap after the imports (argument parsing; train_here's own imports)
    "ember.launch": ["load_recipe", "completed_step", "check_memory", "train_here"],
    "ember.train.job": ["prepare", "join_world", "configure_determinism", "config_fields", "load_model",
                        "data_fingerprint", "run_manifest", "performance", "tokenize", "data_notes",
                        "build_parts", "parallelize", "open_ledger", "checkpoint_mtbf", "build_compiler",
                        "restore", "start_attempt"],
    "ember.train.resume": ["choose_checkpoint", "load_checkpoint"],
}
TOP = ["python start", "CLI imports", "training imports", "load_recipe", "completed_step", "check_memory"]
IN_PREPARE = ["join_world", "configure_determinism", "config_fields", "load_model", "data_fingerprint",
              "run_manifest", "performance", "tokenize", "data_notes", "parallelize",
              "build_parts", "open_ledger", "checkpoint_mtbf", "build_compiler", "restore", "start_attempt"]
IN_RESTORE = ["choose_checkpoint", "load_checkpoint"]  # shown under restore, not summed again
ORDER = TOP + IN_PREPARE + IN_RESTORE + ["rest of prepare", "other (the two rows below)", "CLI to train_here",
                                        "train_here to prepare",
                                        "first step", "of which the step itself"]


def env_of(home: Path, **extra: str) -> dict:
    return {**os.environ, "EMBER_HOME": str(home), "HF_HUB_OFFLINE": "1", **extra}


def timeline(root: Path, home: Path, recipe: Path, base: Path, work: Path) -> dict[str, float]:
    """One resume of a copy of `base`, run by the arm at `root`: seconds per phase."""
    trial = work / "trial"
    shutil.rmtree(trial, ignore_errors=True)
    shutil.copytree(base, trial)
    spans, driver = work / "spans.jsonl", work / "driver.py"
    spans.unlink(missing_ok=True)
    driver.write_text(DRIVER)
    env = env_of(home, RESTART_SPANS=str(spans), RESTART_WRAP=json.dumps(SPANS),
                 EMBER_FAULT="train.micro_batch@2")
    done = subprocess.run([sys.executable, str(driver), "run", str(recipe), "--out", str(trial), "--no-supervise"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL and "resuming from" in done.stderr, done.stderr[-3000:]
    rows = [json.loads(line) for line in spans.read_text().splitlines()]
    first = json.loads((trial / "metrics.jsonl").read_text().splitlines()[-1])
    assert first["attempt"] == 2, first  # the resumed attempt's first step
    start = rows[0][1]
    phases: dict[str, float] = {}
    begins = {name[len("begin "):]: t0 for name, t0, _ in rows if name.startswith("begin ")}
    rows = [r for r in rows if not r[0].startswith("begin ")]
    for name, t0, t1 in rows:
        phases[name] = phases.get(name, 0.0) + t1 - t0
    imports_end = max(t1 for name, _, t1 in rows if name == "training imports")
    phases["CLI to train_here"] = begins["train_here"] - imports_end  # argument parsing, launch.run
    phases["train_here to prepare"] = begins["prepare"] - begins["train_here"]
    prepare_end = max(t1 for name, _, t1 in rows if name == "prepare")
    phases["rest of prepare"] = phases["prepare"] - sum(phases.get(k, 0.0) for k in IN_PREPARE)
    phases["first step"] = first["time"] - prepare_end
    phases["of which the step itself"] = first["step_seconds"]
    phases["total"] = first["time"] - start
    phases["other (the two rows below)"] = phases["total"] - sum(phases.get(k, 0.0) for k in TOP + ["prepare", "first step"])
    phases["CLI to train_here"] -= sum(phases.get(k, 0.0) for k in TOP[3:])  # shown on their own rows
    return phases


def train_to(root: Path, home: Path, recipe: Path, out: Path, stop_at: int | None) -> int:
    """`ember run` (a new process, as a requeue starts one); SIGTERM once `stop_at` is logged."""
    proc = subprocess.Popen([sys.executable, "-m", "ember", "run", str(recipe), "--out", str(out)],
                            cwd=root, env=env_of(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    while stop_at is not None and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= stop_at:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode in (0, 75), err[-3000:]
    return proc.returncode


def goodput(root: Path, home: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "ember", "report", str(out), "--json"], cwd=root,
                          env=env_of(home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def interrupted_twice(root: Path, home: Path, recipe: Path, work: Path) -> tuple[dict, dict]:
    """The job uninterrupted, then interrupted at steps 100 and 200: their reports."""
    plain, twice = work / "plain", work / "twice"
    for d in (plain, twice):
        shutil.rmtree(d, ignore_errors=True)
    train_to(root, home, recipe, plain, None)
    for stop in (100, 200, None):
        train_to(root, home, recipe, twice, stop)
    assert_same_result(twice, plain)
    return goodput(root, home, plain), goodput(root, home, twice)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5, help="resume timelines per arm")
    ap.add_argument("--goodput-rounds", type=int, default=1, help="pairs of 300-step jobs per arm (0: none)")
    ap.add_argument("--before", metavar="COMMIT", help="also run ember at this commit, alternating")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-restart-"))
    roots = {"now": ROOT, **({"before": source_at(args.before, work / "before-src")} if args.before else {})}
    for root in roots.values():  # each arm's modules compiled once, as an installed package has them
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "ember")], check=True,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    recipe = write_recipe(work, **JOB)
    homes = {arm: work / f"home-{arm}" for arm in roots}
    bases = {}
    for arm, root in roots.items():  # a checkpoint at step 100 per arm; warms its caches (untimed)
        bases[arm] = work / f"base-{arm}"
        train_to(root, homes[arm], recipe, bases[arm], 100)
    times: dict[str, list[dict[str, float]]] = {arm: [] for arm in roots}
    floor: list[float] = []
    for r in range(args.rounds):
        for arm in (list(roots) if r % 2 == 0 else list(roots)[::-1]):
            (work / arm).mkdir(exist_ok=True)
            times[arm].append(timeline(roots[arm], homes[arm], recipe, bases[arm], work / arm))
            print(f"round {r + 1} {arm:6s} process start -> first step: {times[arm][-1]['total']:.2f} s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
        t0 = time.time()  # the floor: what any script that trains this model with transformers imports
        subprocess.run([sys.executable, "-c", "import torch; from transformers import LlamaForCausalLM"],
                       check=True, cwd=work, capture_output=True, env=env_of(work / "home-floor"))
        floor.append(time.time() - t0)
        print(f"round {r + 1} bare `import torch; from transformers import LlamaForCausalLM`: {floor[-1]:.2f} s",
              flush=True)
    names = [n for n in ORDER + ["total"]
             if any(n in t for ts in times.values() for t in ts)]
    print(f"\nresume of the 300-step job at step ~100, median of {args.rounds} (s):")
    print("| phase | " + " | ".join(roots) + " |\n| --- |" + " ---: |" * len(roots))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{statistics.median(t.get(n, 0.0) for t in times[arm]):.3f}"
                                      for arm in roots) + " |")
    print(f"\nbare imports of torch and transformers' Llama (a fresh interpreter), median: "
          f"{statistics.median(floor):.2f} s")
    for r in range(args.goodput_rounds):
        for arm in (list(roots) if r % 2 == 0 else list(roots)[::-1]):
            plain, twice = interrupted_twice(roots[arm], homes[arm], recipe, work / arm)
            for name, rep in (("uninterrupted", plain), ("interrupted twice", twice)):
                g = rep["goodput"]
                b = {k: round(v, 2) for k, v in g["buckets"].items() if v > 0.005}
                print(f"{arm:6s} {name:18s} attempts {rep['run']['attempts']}  wall {g['wall_seconds']:.1f} s  "
                      f"goodput {g['goodput']:.1%}  {b}", flush=True)
            ratio = twice["goodput"]["goodput"] / plain["goodput"]["goodput"]
            print(f"{arm:6s} goodput interrupted twice / uninterrupted: {ratio:.3f} (bit-identical results)")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
