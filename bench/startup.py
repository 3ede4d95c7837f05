"""Start-up: `ember run` of the demo job against a hand-written Hugging Face Trainer script of the
same job, to the first training step; and the commands that should answer in a fraction of a second.

1. Time to first step. The job: examples/smollm2-lora.toml unchanged (LoRA r=8, alpha 16, dropout
   0.05 on q/k/v/o_proj of SmolLM2-135M-Instruct, 4 x 128 tokens, fp32, the ledger on, checkpoints
   every 20 steps). Two arms, each a fresh process, alternating in a rotated order each round:

     ember  `python -m ember run examples/smollm2-lora.toml --out NEW` (the command `make demo`
            runs): the CLI, the recipe, the memory plan, the run folder, the model, LoRA, the
            token store, the optimizer, the ledger, then the loop
     hf     a Trainer script as one would write it for this job (`hf_script` below): the
            tokenizer and model from the same converted folder, peft's LoRA, the same JSONL
            tokenized with `datasets.map` (batched) and packed into 128-token blocks, Trainer
            with the same optimizer settings, `save_steps = 20`, one loader worker

   Both warm, as a second `make demo` is: ember's $EMBER_HOME (the converted model, the token
   store, the CPU peak) and the `datasets` cache are filled by one untimed run of each arm first.
   Timed: from just before the parent starts the process (time.time()) to the end of step 1:
   ember's first metrics.jsonl record (`time`, written right after the step), HF's
   `on_step_end` (a TrainerCallback writing time.time() to a file). Also printed: the part
   before the first step starts (ember: `time - step_seconds`; HF: `on_step_begin`, which comes
   after the Trainer fetched the batch). Each process is SIGKILLed (its whole process group)
   once its first step is recorded: nothing after it is timed.

2. Commands: `ember --help`, `runs`, `queue` (against a running service), `submit --help`: wall
   seconds of a fresh process each, median of the rounds (goal <= 0.3 s, no torch; the import
   check itself is tests/test_startup.py).

With `--before COMMIT`, ember at that commit (`git archive`, run from its own folder with the same
$EMBER_HOME) is a third arm of both parts, in the same rounds.

usage: python bench/startup.py [--rounds 5] [--commands-only] [--before COMMIT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples/smollm2-lora.toml"
KJV = ROOT / "examples/data/kjv.jsonl"

HF_SCRIPT = r'''
import json, sys, time
from pathlib import Path
folder, data, out, clock = sys.argv[1:5]
import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments,
                          default_data_collator)
from transformers.utils import logging as hf_logging
hf_logging.set_verbosity_error()
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
model.config.use_cache = False
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
BLOCK = 128

def tokenize(batch):
    return tokenizer([t + tokenizer.eos_token for t in batch["text"]])

def pack(batch):
    ids = [i for row in batch["input_ids"] for i in row]
    n = len(ids) // BLOCK * BLOCK
    blocks = [ids[i:i + BLOCK] for i in range(0, n, BLOCK)]
    return {"input_ids": blocks, "labels": [list(b) for b in blocks], "attention_mask": [[1] * BLOCK for _ in blocks]}

raw = load_dataset("json", data_files=data, split="train")
tokens = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
train = tokens.map(pack, batched=True, remove_columns=tokens.column_names)

class Clock(TrainerCallback):
    def on_step_begin(self, *a, **k):
        if not Path(clock + ".begin").exists():
            Path(clock + ".begin").write_text(repr(time.time()))

    def on_step_end(self, *a, **k):
        Path(clock).write_text(repr(time.time()))

args = TrainingArguments(output_dir=out, max_steps=60, per_device_train_batch_size=4, learning_rate=5e-4,
                         adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
                         lr_scheduler_type="cosine", warmup_steps=4, logging_steps=1, save_steps=20,
                         save_total_limit=2, report_to="none", disable_tqdm=True, dataloader_num_workers=1,
                         use_cpu=True, seed=0)
Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator,
        callbacks=[Clock()]).train()
'''


def first_line(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return json.loads(text.splitlines()[0]) if "\n" in text else None


def run_to_first_step(argv: list[str], env: dict, done, log: Path, cwd: Path = ROOT,
                      timeout: float = 1800) -> tuple[float, dict]:
    """Start ARGV in its own process group; when done() gives the first step's record, kill the group."""
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    try:
        while (rec := done()) is None:
            if proc.poll() is not None:
                sys.exit(f"{argv[:4]} exited {proc.returncode} before its first step; see {log}:\n"
                         + log.read_text()[-3000:])
            if time.time() - t0 > timeout:
                sys.exit(f"{argv[:4]}: no first step after {timeout} s; see {log}")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return t0, rec


def ember_arm(work: Path, env: dict, name: str, root: Path = ROOT) -> dict:
    out = work / name
    env = {**env, "PYTHONPATH": str(root)}
    t0, rec = run_to_first_step([sys.executable, "-m", "ember", "run", str(RECIPE), "--out", str(out)], env,
                                lambda: first_line(out / "metrics.jsonl"), work / f"{name}.log", root)
    return {"first_step": rec["time"] - t0, "setup": rec["time"] - rec["step_seconds"] - t0,
            "step": rec["step_seconds"]}


def hf_arm(work: Path, env: dict, name: str, folder: Path) -> dict:
    clock = work / f"{name}.clock"
    script = work / "hf_script.py"
    script.write_text(HF_SCRIPT)

    def done():
        try:
            return {"end": float(clock.read_text()), "begin": float(Path(f"{clock}.begin").read_text())}
        except (OSError, ValueError):
            return None
    t0, rec = run_to_first_step([sys.executable, str(script), str(folder), str(KJV), str(work / name), str(clock)],
                                env, done, work / f"{name}.log")
    return {"first_step": rec["end"] - t0, "setup": rec["begin"] - t0, "step": rec["end"] - rec["begin"]}


def source_at(commit: str, folder: Path) -> Path:
    """ember's tree at `commit`, written into `folder` (git archive): another arm of a bench."""
    folder.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def command_seconds(env: dict, root: Path, *args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ember", *args], env={**env, "PYTHONPATH": str(root)}, cwd=root,
                   capture_output=True, check=True)
    return time.perf_counter() - t0


def commands(work: Path, env: dict, rounds: int, roots: dict[str, Path]) -> None:
    (Path(env["EMBER_HOME"]) / "owner.toml").write_text("[inference]\nenabled = false\n")
    serve = subprocess.Popen([sys.executable, "-m", "ember", "serve", "--port", "0"], env=env, cwd=ROOT,
                             stdout=open(work / "serve.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = Path(env["EMBER_HOME"]) / "serve" / "serve.json"
        deadline = time.time() + 120
        while not info.exists() and time.time() < deadline and serve.poll() is None:
            time.sleep(0.1)
        cases = [(code, c) for c in [("--help",), ("runs",), ("queue",), ("submit", "--help")] for code in roots]
        times: dict[tuple, list[float]] = {c: [] for c in cases}
        for r in range(rounds):
            for code, c in cases[r % len(cases):] + cases[:r % len(cases)]:
                times[code, c].append(command_seconds(env, roots[code], *c))
        print(f"\ncommands, fresh process each, median of {rounds} (load average {os.getloadavg()[0]:.2f}):")
        for (code, c), t in times.items():
            print(f"  {code:6s} ember {' '.join(c):13s} {statistics.median(t):.3f} s  (range {min(t):.3f}-{max(t):.3f})")
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--commands-only", action="store_true")
    p.add_argument("--before", metavar="COMMIT", help="also time ember at this commit, in the same rounds")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-startup-bench-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EMBER_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    (work / "home").mkdir()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; work folder {work}", flush=True)
    roots = {"now": ROOT, **({"before": source_at(args.before, work / "before")} if args.before else {})}
    for root in roots.values():  # compiled once (an archive has no __pycache__): untimed
        command_seconds(env, root, "--help")
    commands(work, env, max(args.rounds, 5), roots)
    if args.commands_only:
        return
    if not KJV.exists():
        subprocess.run([sys.executable, str(ROOT / "examples/prepare_kjv.py"), str(KJV)], check=True)
    sys.path.insert(0, str(ROOT))
    os.environ["EMBER_HOME"] = env["EMBER_HOME"]
    from ember.models import model_folder
    from ember.recipe import load_recipe
    folder, _ = model_folder(load_recipe(RECIPE).model.path)  # converted once (untimed)
    warm = {"ember": ember_arm(work, env, "warm-ember"), "hf": hf_arm(work, env, "warm-hf", folder)}
    print(f"warm-up (untimed: fills the token store and the datasets cache): "
          f"ember {warm['ember']['first_step']:.1f} s, hf {warm['hf']['first_step']:.1f} s", flush=True)
    if args.before:  # its first run compiles its modules: untimed too
        warm["before"] = ember_arm(work, env, "warm-before", roots["before"])
    arms = ["ember", "hf"] + (["before"] if args.before else [])
    res: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            if arm == "hf":
                x = hf_arm(work, env, f"r{r}-hf", folder)
            else:
                x = ember_arm(work, env, f"r{r}-{arm}", roots["now" if arm == "ember" else "before"])
            res[arm].append(x)
            print(f"round {r + 1} {arm:5s} to first step {x['first_step']:6.2f} s (before it {x['setup']:6.2f} s, "
                  f"the step {x['step']:6.2f} s)  load {os.getloadavg()[0]:.2f}", flush=True)
    med = {a: {k: statistics.median(x[k] for x in res[a]) for k in res[a][0]} for a in arms}
    print(f"\nmedian of {args.rounds} rounds:")
    for a in arms:
        m = med[a]
        print(f"  {a:5s} to first step {m['first_step']:6.2f} s   before it {m['setup']:6.2f} s   step 1 {m['step']:6.2f} s")
    ratios = [e["first_step"] / h["first_step"] for e, h in zip(res["ember"], res["hf"])]
    print(f"ember / HF to first step: {med['ember']['first_step'] / med['hf']['first_step']:.3f} (medians); "
          f"per round {', '.join(f'{x:.3f}' for x in ratios)}; before the first step "
          f"{med['ember']['setup'] / med['hf']['setup']:.3f}")
    if args.before:
        b = med["before"]
        print(f"ember at {args.before} / HF to first step {b['first_step'] / med['hf']['first_step']:.3f}, before "
              f"the first step {b['setup'] / med['hf']['setup']:.3f}; now / {args.before} before the first step "
              f"{med['ember']['setup'] / b['setup']:.3f}")
    (work / "startup.json").write_text(json.dumps(res))
    print(f"raw figures in {work / 'startup.json'}; finished {time.strftime('%H:%M:%S UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
