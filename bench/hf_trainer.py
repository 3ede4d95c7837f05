"""ember against Hugging Face Trainer on the demo job, and what `train.deterministic` costs there.

The job: examples/smollm2-lora.toml (LoRA r=8, alpha 16, q/k/v/o_proj on SmolLM2-135M-Instruct,
4 x 128 tokens, fp32, 2 threads) with LoRA dropout 0. Both trainers load the same converted model
folder and train on the same packed sequences (ember's own micro-batches, written out once), with
AdamW lr 5e-4, betas 0.9/0.95, eps 1e-8, no weight decay, clipping at 1.0 and ember's cosine
schedule (4 warmup steps, floor 0.1). Every job is a fresh child process; the arms alternate, in
a rotated order each round:

  ember           train.deterministic = true (the default), no checkpoints but the last, no ledger
  ember-nondet    train.deterministic = false
  ember-nofill    deterministic, with torch.utils.deterministic.fill_uninitialized_memory = False
                  (set after ember's configure_determinism has run)
  hf              transformers.Trainer (its default AdamW implementation, adamw_torch_fused)
  ember-compile   as ember, with train.compile = true (torch.compile, inductor: forward, loss, backward)
  hf-compile      as hf, with TrainingArguments(torch_compile=True) (inductor)
  ember-ckpt      once, after the rounds: the ledger on and async checkpoints every 5 steps

Then `--interleave` cycles (one process, one model) that switch the determinism flags between
ember's own train_step calls (deterministic / not / deterministic without the fill), in a rotated
order each cycle, for paired per-step figures, and a profile of one step in each mode.

Timing, the same way for both: a step's *period* is from the end of one step to the end of the
next (ember: metrics.jsonl `time`, written just after each step; HF: `on_step_end`), so it
contains one of everything a step costs (data fetch, forward, backward, clip, optimizer,
schedule, logging). Also printed: ember's `step_seconds` (data fetch + forward + backward +
optimizer) and HF's on_step_begin -> on_step_end (the same, minus the data fetch). Whole job:
from the kernel's start of the child process to the end of its last step (imports, model load,
data, every step).

The compiled arms compile during their first step; the warm-up steps dropped from the medians
cover it (the compile seconds show in `setup`-to-last-step, not in the period). ember's kernels
are cached in $EMBER_HOME/cache/inductor, HF's in torch's default folder: from the second round
on, both load them rather than compiling again.

`--precision bf16` runs every arm in bf16 mixed precision instead (ember: `precision.mode =
"bf16"`, HF: `TrainingArguments(bf16=True)`; both autocast to bf16 on the CPU): the same job in
the other precision a user may pick, both sides alike, where a CPU multiplies bf16 faster (AMX).

usage: python bench/hf_trainer.py [--rounds 3] [--steps 20] [--warmup 3] [--cycles 12] [--no-ckpt]
                                  [--arms hf,ember,hf-compile,ember-compile] [--precision fp32|bf16]
       python bench/hf_trainer.py --rounds 0 --cycles 30   # the determinism cycles alone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "examples/smollm2-lora.toml"
KJV = ROOT / "examples/data/kjv.jsonl"
THREADS = 2
ARMS = ["hf", "ember", "ember-nondet", "ember-nofill", "hf-compile", "ember-compile"]
MODES = ["det", "nondet", "nofill"]  # --interleave


def recipe(steps: int, deterministic: bool = True, every: int = 0, compile: bool = False, precision: str = "fp32"):
    from ember.recipe import load_recipe
    return load_recipe(RECIPE, [f"train.max_steps={steps}", "method.dropout=0.0", f"train.threads={THREADS}",
                                f"train.deterministic={str(deterministic).lower()}", f"precision.mode={precision}",
                                f"checkpoint.every_steps={every}", f"train.compile={str(compile).lower()}"])


def lr_factor(step: int, warmup: int, max_steps: int, floor: float = 0.1) -> float:
    """ember's cosine (ember.train.schedule), written out so the HF process imports no ember."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def setup(args: argparse.Namespace) -> None:
    """Convert the GGUF (once), cache the tokens, and write ember's first micro-batches out."""
    import torch
    from ember.events import Events
    from ember.models import model_folder
    from ember.train.job import prepare
    r = recipe(args.steps)
    folder, _ = model_folder(r.model.path)
    job = prepare(r, Path(args.out) / "setup-run", False, Events(), ledger_path=False)
    batches = job.batches()
    rows = []
    for k in range(args.steps):
        b = batches.batch(k)
        for i in range(b.ids.shape[0]):
            row = {"input_ids": b.ids[i].clone(),
                   "labels": (b.labels if b.labels is not None else b.ids)[i].clone()}
            if b.positions is not None:
                row["position_ids"] = b.positions[i].clone()
            rows.append(row)
    torch.save(rows, Path(args.out) / "batches.pt")
    (Path(args.out) / "setup.json").write_text(json.dumps({"folder": str(folder), "micro_batch": r.train.micro_batch,
                                                           "seq_len": r.data.seq_len}))


def ember_arm(args: argparse.Namespace, started: float) -> dict:
    import torch
    from ember.events import Events
    from ember.train.job import prepare
    from ember.train.loop import train
    ckpt = args.arm == "ember-ckpt"
    r = recipe(args.steps, deterministic=args.arm != "ember-nondet", every=5 if ckpt else 0,
               compile=args.arm == "ember-compile", precision=args.precision)
    out = Path(args.out) / "run"
    job = prepare(r, out, False, Events(), ledger_path=Path(args.out) / "ledger.db" if ckpt else False)
    if args.arm == "ember-nofill":  # after configure_determinism (inside prepare)
        torch.utils.deterministic.fill_uninitialized_memory = False
    flags = {"deterministic": torch.are_deterministic_algorithms_enabled(), "precision": r.precision.mode,
             "fill": torch.utils.deterministic.fill_uninitialized_memory, "threads": torch.get_num_threads()}
    train(job)
    done = time.time()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"ends": [x["time"] for x in lines], "inner": [x["step_seconds"] for x in lines],
            "first_start": lines[0]["time"] - lines[0]["step_seconds"], "started": started, "done": done,
            "loss": [x["loss"] for x in lines], "lr": [x["lr"] for x in lines], "flags": flags}


def hf_arm(args: argparse.Namespace, started: float) -> dict:
    import numpy as np
    import torch
    torch.set_num_threads(THREADS)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    info = json.loads((Path(args.out).parent / "setup.json").read_text())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)  # as ember seeds before the model: same LoRA init
    model = AutoModelForCausalLM.from_pretrained(info["folder"], dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    rows = torch.load(Path(args.out).parent / "batches.pt")

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    class Clock(TrainerCallback):
        def __init__(self):
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_step_begin(self, *a, **k):
            self.begins.append(time.time())

        def on_step_end(self, *a, **k):
            self.ends.append(time.time())

    class SameSchedule(Trainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda s: lr_factor(s, 4, args.steps))
            return self.lr_scheduler

    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "hf"), max_steps=args.steps, per_device_train_batch_size=info["micro_batch"],
        learning_rate=5e-4, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        train_sampling_strategy="sequential", remove_unused_columns=False, dataloader_num_workers=0,
        use_cpu=True, seed=0, torch_compile=args.arm == "hf-compile", bf16=args.precision == "bf16")
    clock = Clock()
    trainer = SameSchedule(model=model, args=targs, train_dataset=Rows(), callbacks=[clock])
    trainer.train()
    done = time.time()
    logs = [x for x in trainer.state.log_history if "loss" in x]
    return {"ends": clock.ends, "inner": [e - b for b, e in zip(clock.begins, clock.ends)],
            "first_start": clock.begins[0], "started": started, "done": done,
            "loss": [x["loss"] for x in logs], "lr": [x["learning_rate"] for x in logs],
            "flags": {"deterministic": torch.are_deterministic_algorithms_enabled(),
                      "threads": torch.get_num_threads(), "optim": str(targs.optim),
                      "compile": targs.torch_compile, "bf16": targs.bf16}}


def set_mode(mode: str) -> None:
    import torch
    torch.use_deterministic_algorithms(mode != "nondet")
    torch.utils.deterministic.fill_uninitialized_memory = mode != "nofill"


def interleave(args: argparse.Namespace, started: float) -> dict:
    """ember's train_step under each determinism mode in turn, in one process."""
    from torch.profiler import ProfilerActivity, profile
    from ember.events import Events
    from ember.train.job import prepare
    from ember.train.loop import Data, train_step
    warm = 3
    steps = warm + args.cycles * len(MODES) + len(MODES)
    job = prepare(recipe(steps, precision=args.precision), Path(args.out) / "run", False, Events(), ledger_path=False)
    job.model.train()
    data = Data(job)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(warm):
        train_step(job, data)
    for c in range(args.cycles):
        for mode in MODES[c % 3:] + MODES[:c % 3]:
            set_mode(mode)
            t0 = time.perf_counter()
            train_step(job, data)
            times[mode].append(time.perf_counter() - t0)
    profiles = {}
    for mode in MODES:  # one profiled step each: where the time differs, op by op
        set_mode(mode)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step(job, data)
        profiles[mode] = {e.key: [e.self_cpu_time_total / 1e3, e.count] for e in prof.key_averages()}
    data.close()
    return {"times": times, "profiles": profiles}


def child(args: argparse.Namespace) -> None:
    from ember.proc import process_start_time
    started = process_start_time()
    if args.arm == "setup":
        setup(args)
        return
    fn = {"hf": hf_arm, "hf-compile": hf_arm, "interleave": interleave}.get(args.arm, ember_arm)
    result = fn(args, started)
    (Path(args.out) / "result.json").write_text(json.dumps(result))


def run_child(arm: str, steps: int, out: Path, extra: list[str] = (), precision: str = "fp32") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--arm", arm, "--steps", str(steps), "--out", str(out), "--precision", precision,
           *extra]
    with open(out / "log.txt", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    if rc != 0:
        sys.exit(f"{arm} failed (exit {rc}); see {out / 'log.txt'}:\n" + (out / "log.txt").read_text()[-3000:])
    return json.loads((out / "result.json").read_text()) if arm != "setup" else {}


def summarize(res: dict, warmup: int) -> dict:
    ends = res["ends"]
    periods = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]  # steps warmup+1.. (1-based)
    return {"period": statistics.median(periods), "inner": statistics.median(res["inner"][warmup:]),
            "wall": ends[-1] - res["started"], "setup": res["first_start"] - res["started"],
            "done": res["done"] - res["started"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps dropped from the medians")
    p.add_argument("--cycles", type=int, default=12, help="--interleave cycles of the three modes (0: skip)")
    p.add_argument("--no-ckpt", action="store_true", help="skip the checkpointing arm")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms of the rounds (hf and ember always)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="every arm's compute precision")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        child(args)
        return
    if not KJV.exists():
        subprocess.run([sys.executable, str(ROOT / "examples/prepare_kjv.py"), str(KJV)], check=True)
    base = Path(tempfile.mkdtemp(prefix="ember-hf-bench-"))
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; precision {args.precision}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; work folder {base}", flush=True)
    arms = [a for a in ARMS if a in {"hf", "ember", *args.arms.split(",")}]
    if args.rounds:  # 0: only the interleaved determinism cycles
        run_child("setup", args.steps, base)
        per: dict[str, list[dict]] = {a: [] for a in arms}
        raw: dict[str, list[dict]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:  # rotated: no arm always first
                res = run_child(arm, args.steps, base / f"r{r}-{arm}", precision=args.precision)
                raw[arm].append(res)
                per[arm].append(summarize(res, args.warmup))
                s = per[arm][-1]
                print(f"round {r + 1} {arm:13s} period {s['period'] * 1e3:7.1f} ms  inner {s['inner'] * 1e3:7.1f} ms  "
                      f"whole job {s['wall']:6.1f} s (setup {s['setup']:5.1f} s)  flags {res['flags']}  "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
        (base / "rounds.json").write_text(json.dumps({"summary": per, "raw": raw}))
        med = {a: {k: statistics.median(s[k] for s in per[a]) for k in per[a][0]} for a in arms}
        tokens = json.loads((base / "setup.json").read_text())
        tokens = tokens["micro_batch"] * tokens["seq_len"]
        print(f"\n{args.steps} steps a job, first {args.warmup} dropped, median of {args.rounds} rounds "
              f"({tokens} tokens a step):")
        print(f"  {'arm':13s} {'period':>10s} {'tokens/s':>9s} {'inner':>10s} {'to last step':>12s} {'setup':>7s} {'to exit of train':>16s}")
        for a in arms:
            m = med[a]
            print(f"  {a:13s} {m['period'] * 1e3:8.1f}ms {tokens / m['period']:9.1f} {m['inner'] * 1e3:8.1f}ms "
                  f"{m['wall']:11.1f}s {m['setup']:6.1f}s {m['done']:15.1f}s")
        e, h = med["ember"], med["hf"]
        print(f"ember / HF: step period {e['period'] / h['period']:.3f}, whole job {e['wall'] / h['wall']:.3f}, "
              f"setup {e['setup'] / h['setup']:.3f}" + (f"; non-deterministic ember / HF period "
              f"{med['ember-nondet']['period'] / h['period']:.3f}" if "ember-nondet" in med else ""))
        if "ember-nondet" in med and "ember-nofill" in med:
            print(f"deterministic / non-deterministic period {e['period'] / med['ember-nondet']['period']:.3f}; "
                  f"deterministic / deterministic without the fill {e['period'] / med['ember-nofill']['period']:.3f}")
        if "ember-compile" in med:  # the goals: <= 0.8x HF eager, <= 1.0x HF compiled
            c = med["ember-compile"]
            print(f"compiled ember / HF eager: step period {c['period'] / h['period']:.3f} (goal <= 0.8); "
                  f"compiled ember / ember eager {c['period'] / e['period']:.3f}; whole job {c['wall'] / h['wall']:.3f} of HF eager's")
            if "hf-compile" in med:
                hc = med["hf-compile"]
                print(f"compiled ember / HF torch_compile=True: step period {c['period'] / hc['period']:.3f} (goal <= 1.0); "
                      f"HF compiled / HF eager {hc['period'] / h['period']:.3f}; whole job {c['wall'] / hc['wall']:.3f}")
        dl = max(abs(a - b) for a, b in zip(raw["ember"][0]["loss"], raw["hf"][0]["loss"]))
        dr = max(abs(a - b) for a, b in zip(raw["ember"][0]["lr"], raw["hf"][0]["lr"]))
        print(f"same job? per-step loss ember vs HF: largest difference {dl:.2e} over "
              f"{len(raw['hf'][0]['loss'])} steps; lr {dr:.2e}; ember losses {raw['ember'][0]['loss'][:3]}... "
              f"HF {raw['hf'][0]['loss'][:3]}...", flush=True)

    if args.rounds and not args.no_ckpt:
        res = run_child("ember-ckpt", args.steps, base / "ckpt", precision=args.precision)
        s = summarize(res, args.warmup)
        print(f"\nember-ckpt (ledger on, async checkpoints every 5 steps) period {s['period'] * 1e3:.1f} ms "
              f"(x{s['period'] / e['period']:.3f} of ember's median), mean of periods after warm-up "
              f"{statistics.mean(b - a for a, b in zip(res['ends'][args.warmup - 1:], res['ends'][args.warmup:])) * 1e3:.1f} ms, "
              f"whole job {s['wall']:.1f} s (x{s['wall'] / e['wall']:.3f}), to exit of train {s['done']:.1f} s", flush=True)
        (base / "ckpt.json").write_text(json.dumps(res))

    if args.cycles:
        res = run_child("interleave", args.steps, base / "interleave", ["--cycles", str(args.cycles)], args.precision)
        t = res["times"]
        m = {k: statistics.median(v) for k, v in t.items()}
        ratio = lambda a, b: [x / y for x, y in zip(t[a], t[b])]
        print(f"\ninterleaved in one process, {args.cycles} cycles (ember's train_step, data fetch included):")
        for k in MODES:
            print(f"  {k:7s} median {m[k] * 1e3:8.1f} ms  min {min(t[k]) * 1e3:8.1f}  max {max(t[k]) * 1e3:8.1f}")
        for a, b in (("det", "nondet"), ("det", "nofill"), ("nofill", "nondet")):
            rs = ratio(a, b)
            logs = [math.log(x) for x in rs]
            mean, half = statistics.mean(logs), 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
            print(f"  {a}/{b}: geometric mean of per-cycle ratios {math.exp(mean):.4f} (95% "
                  f"{math.exp(mean - half):.4f}-{math.exp(mean + half):.4f}), median {statistics.median(rs):.4f} "
                  f"(range {min(rs):.4f}-{max(rs):.4f}; {a} slower in {sum(x > 1 for x in rs)} of {len(rs)})")
        prof = res["profiles"]
        keys = set().union(*prof.values())
        diff = sorted(keys, key=lambda k: -abs(prof["det"].get(k, [0, 0])[0] - prof["nondet"].get(k, [0, 0])[0]))
        total = {k: sum(v[0] for v in prof[k].values()) for k in MODES}
        print("  profiled step, self CPU total: " + ", ".join(f"{k} {v:.0f} ms" for k, v in total.items()))
        print("  ops whose self CPU time differs most, det vs nondet (ms, calls):")
        for k in diff[:10]:
            print("    " + f"{k:40s} " + "  ".join(
                f"{mo} {prof[mo].get(k, [0, 0])[0]:8.1f} ({prof[mo].get(k, [0, 0])[1]})" for mo in MODES))
        (base / "interleave.json").write_text(json.dumps(res))
    print(f"\nraw figures in {base}; finished {time.strftime('%H:%M:%S UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
