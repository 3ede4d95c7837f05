"""Distributed training on this machine: scaling from one process to two ranks (DDP and FSDP over
loopback, DDP across two network namespaces at two link rates), the parallelism advisor's
predicted step time against the measured one in each case, and ember's distributed path against
a bare torchrun + DDP loop on the same job. Figures are printed, never asserted.

    one process        `ember run`, [train] threads = 1
    2 ranks            `ember run --nproc 2` (ddp, fsdp), a core each
    2 nodes @ RATE     two namespaces on a veth pair shaped by tc tbf (tests/netns.py), one rank each
    advisor            `ember doctor --comm` over the same ranks (a ledger per case), then
                       `ember plan --calibrate`: its predicted step for that layout
    bare DDP           the same model, data order, optimizer and batch in a hand-written loop
                       under torchrun (bench/bare_ddp.py)
    pipeline           `--nproc 2 --set distributed.strategy=pp` under gpipe and 1f1b at grad_accum
                       2, 4, 8, against one process at the same grad_accum: the bubble each stage
                       measured (ranks.json: the median step's share of the schedule a stage
                       waited) against (p-1)/(m+p-1), and the step against the schedule's
                       prediction, one process's step / p / (1 - bubble), and the advisor's

A step's time is the median of `step_seconds` in metrics.jsonl after the first WARMUP steps.
On a CUDA machine the same script adds one and two GPUs on a ~0.5B model in bf16 (NCCL); where
no GPU is present it says so instead of printing a figure.

usage: python bench/distributed.py [--steps 40] [--rates 1gbit,100mbit] [--only pp] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ember.recipe import to_toml  # noqa: E402
from tests import netns  # noqa: E402

WARMUP = 5
PORT = 29571


def model_folder(folder: Path, **shape: int) -> Path:
    """A Llama of the given shape with random weights and ember's byte tokenizer, saved once."""
    from transformers import LlamaForCausalLM

    from ember.models import tiny_config
    from ember.data.tokenizer import ByteTokenizer
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    for k, v in shape.items():
        setattr(config, k, v)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    ByteTokenizer().save(folder)
    return folder


def recipe(folder: Path, model: Path, steps: int, seq_len: int = 128, micro_batch: int = 4, threads: int = 1,
           precision: str = "fp32", grad_accum: int = 4) -> Path:
    r = {"model": {"path": str(model)},
         "data": {"files": [str(ROOT / "examples/data/genesis.jsonl")], "seq_len": seq_len},
         "optimizer": {"lr": 1e-3},
         "train": {"max_steps": steps, "micro_batch": micro_batch, "grad_accum": grad_accum, "seed": 0, "threads": threads},
         "precision": {"mode": precision},
         "checkpoint": {"every_steps": 0, "keep_last": 1}}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.toml"
    path.write_text(to_toml(r))
    return path


def ember(*args: str, prefix: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "ember", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=1200)


def on_nodes(a: netns.Node, b: netns.Node, *args: str) -> str:
    """The same ember command as node 0 and node 1; node 0's stdout."""
    procs = [subprocess.Popen([*n.prefix(), sys.executable, "-m", "ember", *map(str, args), "--nnodes", "2",
                               "--node-rank", str(k), "--rdzv", f"{a.addr}:{PORT}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for k, n in enumerate((a, b))]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a node failed: {err[-2000:]}")
    return outs[0][0]


def step_of(run: Path) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_seconds"] for r in rows[WARMUP:])


def predicted(r: Path, ledger: Path, strategy: str, devices: int) -> tuple[float, str]:
    done = ember("plan", r, "--calibrate", "--json", "--ledger", ledger)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    advice = json.loads(done.stdout)["parallel"]
    option = next(o for o in advice["options"] if o["strategy"] == strategy and o["devices"] == devices)
    rec = advice["recommended"]
    return option["step_seconds"], f"{rec['strategy']}@{rec['devices']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rates", default="1gbit,100mbit")
    ap.add_argument("--only", choices=["pp"], help="only the pipeline cases (and the loopback comm they are planned on)")
    ap.add_argument("--hidden", type=int, default=256,
                    help="the model's width (a multiple of 64; intermediate 2.75x, a head per 64): 256 "
                         "is 3.4 M parameters, 13.5 MB of fp32 gradients a step; wider puts more "
                         "compute behind each micro-batch's send")
    args = ap.parse_args()
    if args.hidden % 64:
        raise SystemExit(f"--hidden {args.hidden}: must be a multiple of 64 (a head is 64 wide)")
    tmp = Path(tempfile.mkdtemp(prefix="ember-bench-dist-"))
    model = model_folder(tmp / "model", hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=4, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64)
    r = recipe(tmp, model, args.steps)
    rows = []
    loop_ledger = tmp / "loopback.db"
    comm = ember("doctor", "--comm", "--nproc", "2", "--ledger", loop_ledger)
    if comm.returncode != 0:
        raise SystemExit(comm.stderr[-2000:])
    if args.only == "pp":
        pipeline(tmp, model, args.steps, loop_ledger)
        print(f"(folders in {tmp})")
        return

    def run(name: str, *extra: str) -> float:
        out = tmp / name
        done = ember("run", r, "--out", out, "--no-ledger", *extra)
        if done.returncode != 0:
            raise SystemExit(f"{name}: {done.stderr[-2000:]}")
        return step_of(out)

    one = run("one")
    for strategy in ("ddp", "fsdp"):
        measured = run(f"loop-{strategy}", "--nproc", "2", "--set", f"distributed.strategy={strategy}")
        pred, rec = predicted(r, loop_ledger, strategy, 2)
        rows.append((f"2 ranks, loopback, {strategy}", measured, pred, rec))
    why = netns.available()
    for rate in filter(None, args.rates.split(",")) if why is None else []:
        ledger = tmp / f"{rate}.db"
        with netns.two_nodes(rate) as (a, b):
            on_nodes(a, b, "doctor", "--comm", "--nproc", "1", "--ledger", ledger)
            out = tmp / f"nodes-{rate}"
            on_nodes(a, b, "run", r, "--out", out, "--no-ledger", "--nproc", "1")
        pred, rec = predicted(r, ledger, "ddp", 2)
        rows.append((f"2 nodes @ {rate}, ddp", step_of(out), pred, rec))
    bare = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "bench" / "bare_ddp.py"), str(r), str(args.steps)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1200)
    bare_step = float(bare.stdout.strip().splitlines()[-1]) if bare.returncode == 0 else float("nan")

    tokens = 4 * 4 * 128  # micro_batch x grad_accum x seq_len
    print(f"one process: {one * 1e3:.1f} ms a step, {tokens / one:,.0f} tokens/s")
    print(f"{'layout':28} {'measured':>9} {'tok/s/dev':>10} {'efficiency':>10} {'predicted':>9} {'pred/meas':>9}  advisor's pick")
    for name, measured, pred, rec in rows:
        print(f"{name:28} {measured * 1e3:7.1f}ms {tokens / measured / 2:10,.0f} {one / (2 * measured):10.0%} "
              f"{pred * 1e3:7.1f}ms {pred / measured:9.2f}  {rec}")
    if why is not None:
        print(f"two-node cases not run: {why}")
    ddp = next(m for n, m, _, _ in rows if n.endswith("loopback, ddp"))
    print(f"bare torchrun + DDP loop: {bare_step * 1e3:.1f} ms a step; ember's 2-rank DDP / bare = {ddp / bare_step:.3f}"
          + ("" if bare.returncode == 0 else f" (bare loop failed: {bare.stderr[-500:]})"))
    pipeline(tmp, model, args.steps, loop_ledger)
    gpu(tmp, args.steps)
    print(f"(folders in {tmp})")


def pipeline(tmp: Path, model: Path, steps: int, ledger: Path) -> None:
    """Two pipeline stages under each schedule at grad_accum 2, 4, 8: the bubble and the step,
    measured against predicted (see the module docstring); `load`, the machine's 1-minute load
    average as each case ends (its neighbours' share of the cores the ranks run on)."""
    print(f"{'pipeline, 2 stages':22} {'bubble: pred':>12} {'meas':>6} {'meas/pred':>9}  {'stage 0, 1':>12}  "
          f"{'step: meas':>10} {'1 proc':>8} {'schedule':>8} {'pred/meas':>9} {'advisor':>8} {'pred/meas':>9}  load")
    for accum in (2, 4, 8):
        r = recipe(tmp / f"accum{accum}", model, steps, grad_accum=accum)
        one = tmp / f"accum{accum}" / "one"
        done = ember("run", r, "--out", one, "--no-ledger")
        if done.returncode != 0:
            raise SystemExit(f"one process, grad_accum {accum}: {done.stderr[-2000:]}")
        advisor, _ = predicted(r, ledger, "pp", 2)
        for schedule in ("gpipe", "1f1b"):
            out = tmp / f"accum{accum}" / schedule
            done = ember("run", r, "--out", out, "--no-ledger", "--nproc", "2", "--set", "distributed.strategy=pp",
                         "--set", f"distributed.schedule={schedule}")
            if done.returncode != 0:
                raise SystemExit(f"pp {schedule}, grad_accum {accum}: {done.stderr[-2000:]}")
            rk = json.loads((out / "ranks.json").read_text())
            pred, meas = rk["bubble_predicted"], rk["bubble"]
            stages = ", ".join(f"{x['bubble']:.0%}" for x in rk["ranks"])
            step, single = step_of(out), step_of(one)
            schedule_step = single / 2 / (1 - pred)
            print(f"{schedule + f', grad_accum {accum}':22} {pred:12.1%} {meas:6.1%} {meas / pred:9.2f}  {stages:>12}  "
                  f"{step * 1e3:8.1f}ms {single * 1e3:6.1f}ms {schedule_step * 1e3:6.1f}ms {schedule_step / step:9.2f} "
                  f"{advisor * 1e3:6.1f}ms {advisor / step:9.2f}  {os.getloadavg()[0]:.1f}")


def gpu(tmp: Path, steps: int) -> None:
    """One GPU and all of them on a ~0.5B Llama in bf16 (NCCL): tokens/s per GPU and MFU."""
    import torch
    if not torch.cuda.is_available():
        print("GPU: no CUDA device on this machine: tokens/s per GPU and MFU on a ~0.5B model in bf16 "
              "(NCCL) not measured")
        return
    n = torch.cuda.device_count()
    # hidden 1152, 24 layers: ~0.5 B parameters
    model = model_folder(tmp / "model-0.5b", hidden_size=1152, intermediate_size=4608, num_hidden_layers=24,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
    (tmp / "gpu").mkdir()
    r = recipe(tmp / "gpu", model, steps, seq_len=1024, micro_batch=8, threads=0, precision="bf16")
    for devices in sorted({1, n}):
        out = tmp / f"gpu-{devices}"
        done = ember("run", r, "--out", out, "--no-ledger", *(["--nproc", str(devices)] if devices > 1 else []))
        if done.returncode != 0:
            print(f"GPU x{devices}: failed: {done.stderr[-800:]}")
            continue
        rep = json.loads(ember("report", out, "--json").stdout)
        t, m = rep.get("throughput") or {}, rep.get("mfu") or {}
        print(f"GPU x{devices} ({torch.cuda.get_device_name(0)}): {t.get('tokens_per_second_per_device', 0):,.0f} "
              f"tokens/s per GPU, MFU {m.get('value') or float('nan'):.1%}, step {step_of(out) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
