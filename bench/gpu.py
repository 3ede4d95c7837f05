"""The GPU script's measurements (bench/gpu.sh checks the Python environment, then runs this):
ember's real `ember run` on a 0.5B model (Qwen2.5-0.5B's shape, random init, written here:
no hub) over examples/data/genesis.jsonl, printed as one markdown table, with raw JSON beside it.

Rows: MFU in bf16 for full fine-tuning and LoRA, eager and compiled (`train.compile`, where this
ember has it), and eager with `train.deterministic = false`; checkpoint blocking, synchronous
against asynchronous, on the full state; memory, `ember plan`'s estimate against the measured
peak; QLoRA and 8-bit optimizer states; `ember doctor` on the full eager step (its first cause and
the operators that took the device's time). Every figure is ember's own record: `ember
report --json` (MFU over all steps, the FLOPs per token and the peak it divides by, each
checkpoint's blocked and durable seconds, goodput's compile bucket), metrics.jsonl (the steady
steps: those after the first `warmup`, which pay for compiling and warming up), `ember plan
--calibrate --json` (estimate and the measured peak of one step); and CUDA's allocator peaks
over each whole `ember run` (bench/gpu_probe.py).

usage: python bench/gpu.py [--cpu-smoke] [--budget SECONDS] [--only NAME,...] [--work DIR]
           [--micro-batch N] [--seq-len N] [--steps N]
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ember.metrics.flops import mfu, share_of_peak  # noqa: E402  (pure arithmetic, no torch)
from ember.recipe import to_toml  # noqa: E402

GiB = 1 << 30
GOAL_MFU = 0.45  # issue 31: bf16 on a 0.5B full fine-tune


@dataclass(frozen=True)
class Sizes:
    shape: str                  # bench/gpu_probe.py SHAPES
    precision: str
    seq_len: int
    micro_batch: int
    steps: int                  # steps of an MFU row
    warmup: int                 # first steps left out of the steady figures
    checkpoint: tuple[str, ...]  # the checkpoint rows' overrides
    row_seconds: int            # one row's time limit
    doctor_seconds: int         # `ember doctor --budget` of the doctor row
    extra: tuple[str, ...] = ()  # overrides of every row


# An H200 (989 TFLOP/s bf16): 16k tokens a step, ~0.1-0.2 s. Checkpoints every 6 s leave a 6 GB
# asynchronous persist time to finish before the next one is due, at 1 GB/s or more (else the next
# one waits for it, and its blocked time shows it).
GPU = Sizes("qwen2.5-0.5b", "bf16", 2048, 8, 30, 5,
            ("train.max_steps=80", "checkpoint.every_steps=0", "checkpoint.every_seconds=6"), 300, 90)
SMOKE = Sizes("qwen2-tiny", "fp32", 64, 8, 2, 1, ("train.max_steps=2", "checkpoint.every_steps=1"), 180, 25,
              ("train.threads=1",))


@dataclass
class Row:
    name: str
    config: str
    result: str = ""
    detail: str = ""
    figures: dict = field(default_factory=dict)


class Bench:
    """The shared state of one bench run: where things go, the clock, the ember to call."""

    def __init__(self, sizes: Sizes, work: Path, out: Path, budget: float):
        self.sizes, self.work, self.out = sizes, work, out
        self.deadline = time.monotonic() + budget
        self.budget = budget
        self.env = {**os.environ, "EMBER_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.recipe = work / "recipe.toml"
        self.probes: dict[str, dict] = {}  # row slug -> CUDA allocator peaks of its `ember run`
        self.eager: list[str] = []  # what makes a row eager: train.compile=false where the key exists
        self.child: subprocess.Popen | None = None
        signal.signal(signal.SIGTERM, self.stop)  # a bench told to stop takes its command along
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def stop(self, *_: object) -> None:
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, signal.SIGKILL)
        sys.exit(143)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def call(self, argv: list[str], log: str, stdout: Path | None = None, limit: float | None = None) -> int:
        """Run `argv` in its own process group (a time-out ends it and its children), its output
        into logs/LOG (stdout into `stdout` when given); its exit status, 124 on time-out."""
        limit = min(limit or self.sizes.row_seconds, max(self.left(), 1))
        with open(self.out / "logs" / f"{log}.log", "a") as err, \
                open(stdout, "w") if stdout else open(os.devnull, "w") as so:
            err.write(f"$ {' '.join(argv)}\n")
            err.flush()
            proc = self.child = subprocess.Popen(argv, stdout=so if stdout else err, stderr=err, env=self.env,
                                                 cwd=ROOT, start_new_session=True)
            try:
                return proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                err.write(f"\n[bench] killed after {limit:.0f} s\n")
                return 124
            finally:
                self.child = None

    def ember(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "ember", *args]

    def failure(self, log: str, code: int) -> str:
        """What went wrong, in one line: the command's last `error:` line, else its last line."""
        lines = [x.strip() for x in (self.out / "logs" / f"{log}.log").read_text(errors="replace").splitlines()
                 if x.strip()]
        said = [x for x in lines if x.startswith("error:")] or lines[-1:] or [""]
        why = "time limit" if code == 124 else f"exit {code}"
        return f"failed ({why}): {said[-1][:200]}"

    def json_of(self, slug: str, command: str, overrides: list[str], *args: str, suffix: str = "",
                limit: float | None = None) -> tuple[dict | None, str]:
        """`ember COMMAND RECIPE --set ... ARGS --json`, its answer kept as runs/SLUG(SUFFIX).json:
        (the answer, "") or (None, what went wrong)."""
        answer = self.out / "runs" / f"{slug}{suffix}.json"
        answer.parent.mkdir(exist_ok=True)
        sets = [x for o in (*self.sizes.extra, *overrides) for x in ("--set", o)]
        code = self.call(self.ember(command, str(self.recipe), *sets, *args, "--json"), slug, stdout=answer,
                         limit=limit)
        return (json.loads(answer.read_text()), "") if code == 0 else (None, self.failure(slug, code))

    def refusal(self, *settings: str) -> str | None:
        """None when this ember's recipe accepts `--set` of each of `settings`, else why not (its
        error, after the place it names)."""
        log = "recipe-checks"
        sets = [x for one in settings for x in ("--set", one)]
        code = self.call(self.ember("recipe", str(self.recipe), *sets), log, limit=60)
        return None if code == 0 else self.failure(log, code).split("): ")[-1]

    def run(self, slug: str, overrides: list[str]) -> tuple[int, Path, dict | None]:
        """`ember run` of the bench recipe with `overrides` (through bench/gpu_probe.py, which
        records CUDA's peaks); its exit status, folder and `ember report --json`."""
        folder, probe = self.work / "runs" / slug, self.work / f"{slug}.probe.json"
        sets = [x for o in (*self.sizes.extra, *overrides) for x in ("--set", o)]
        code = self.call([sys.executable, str(ROOT / "bench" / "gpu_probe.py"), "run", str(probe), "run",
                          str(self.recipe), "--out", str(folder), *sets], slug)
        if probe.exists():
            self.probes[slug] = json.loads(probe.read_text())
        if code != 0:
            return code, folder, None
        report = self.out / "runs" / f"{slug}.report.json"
        report.parent.mkdir(exist_ok=True)
        if self.call(self.ember("report", str(folder), "--json"), slug, stdout=report, limit=120) != 0:
            return 1, folder, None
        shutil.copy(folder / "metrics.jsonl", self.out / "runs" / f"{slug}.metrics.jsonl")
        return 0, folder, json.loads(report.read_text())


def slug_of(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def steady(metrics: Path, warmup: int) -> dict:
    """Tokens/s, step p50 and per-phase medians over the steps after `warmup` (at least the
    last step), from the run's metrics.jsonl."""
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    steps = [s for s in steps if s.get("tokens") and not s.get("skipped")]
    kept = [s for s in steps if s["step"] > warmup] or steps[-1:]
    seconds = sum(s["step_seconds"] for s in kept)
    return {"first_step": kept[0]["step"], "last_step": kept[-1]["step"],
            "tokens_per_second": sum(s["tokens"] for s in kept) / seconds,
            "step_p50": statistics.median(s["step_seconds"] for s in kept),
            "phases_p50": {k: statistics.median(s["phases"].get(k, 0.0) for s in kept) for k in kept[0]["phases"]}}


def size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.2f} MiB"


def peaks_text(p: dict | None) -> str:
    if not p:
        return "CUDA's peaks not read"
    if not p.get("cuda"):
        return "no CUDA allocator (CPU)"
    return f"max allocated {size(p['max_allocated'])}, reserved {size(p['max_reserved'])}"


def mfu_row(b: Bench, name: str, overrides: list[str]) -> Row:
    """MFU, tokens/s and step time of an `ember run` of `sizes.steps` steps, no periodic checkpoints."""
    s = b.sizes
    row = Row(name, f"{s.precision}, {s.micro_batch} x {s.seq_len}, {s.steps} steps")
    slug = slug_of(name)
    code, folder, rep = b.run(slug, [f"train.max_steps={s.steps}", "checkpoint.every_steps=0", *overrides])
    if rep is None:
        row.result = b.failure(slug, code)
        return row
    st = steady(folder / "metrics.jsonl", s.warmup)
    m = rep["mfu"] or {}
    fpt, peak = m.get("flops_per_token"), m.get("peak_flops")
    value = mfu(st["tokens_per_second"], fpt, peak) if fpt else None
    over = share_of_peak(st["tokens_per_second"], fpt, peak) if fpt else None
    compile_s = (rep.get("goodput") or {}).get("buckets", {}).get("compile")
    row.figures = {"steady": st, "mfu_steady": value, "mfu_report": m.get("value"), "mfu": m,
                   "throughput": rep["throughput"], "compile_seconds": compile_s, "cuda": b.probes.get(slug)}
    steps = f"steps {st['first_step']}-{st['last_step']}"
    if value is not None:
        row.result = f"MFU {value:.1%} ({steps})"
    else:
        row.result = f"MFU n/a: {m.get('reason') or 'no peak'}" + (f" (share {over:.3g})" if over else "")
    ph = st["phases_p50"]
    report_mfu = f"{m['value']:.1%}" if m.get("value") is not None else "n/a"
    row.detail = (f"{st['tokens_per_second']:,.0f} tokens/s; step p50 {st['step_p50'] * 1e3:.1f} ms (forward "
                  f"{ph.get('forward', 0) * 1e3:.1f}, backward {ph.get('backward', 0) * 1e3:.1f}, optimizer "
                  f"{ph.get('optimizer', 0) * 1e3:.1f} ms); report over all steps {report_mfu}"
                  + (f"; compile {compile_s:.1f} s" if compile_s else "")
                  + f"; peak {(peak or 0) / 1e12:.4g} TFLOP/s ({str(m.get('peak_source')).split(',')[0]}); "
                  + peaks_text(b.probes.get(slug)))
    shutil.rmtree(folder, ignore_errors=True)
    return row


def checkpoint_row(b: Bench, name: str, asynchronous: bool, sync: Row | None) -> Row:
    """Seconds each checkpoint of the full state blocked training (ember's ledger, through the
    report); the first apart (an asynchronous one allocates its host buffers there)."""
    s = b.sizes
    row = Row(name, f"full state, {s.precision}, " + ", ".join(x.split(".", 1)[1] for x in s.checkpoint))
    slug = slug_of(name)
    code, folder, rep = b.run(slug, ["method.kind=full", f"checkpoint.async={str(asynchronous).lower()}",
                                     "checkpoint.keep_last=1", *b.eager, *s.checkpoint])
    if rep is None:
        row.result = b.failure(slug, code)
        return row
    cks = rep["checkpoints"]
    if not cks:
        row.result = "no checkpoint was recorded"
        return row
    blocked = [c["blocked_seconds"] for c in cks]
    # The first asynchronous snapshot allocates its host buffers; the last (at max_steps, always
    # taken) may come right after a timed one and wait for its persist: the middle ones, where
    # there are any, are the steady figure.
    middle = blocked[1:-1] if len(blocked) > 2 else blocked[1:] or blocked
    later = statistics.median(middle)
    durable = statistics.median(c["durable_seconds"] for c in cks)
    row.figures = {"checkpoints": cks, "blocked_later_median": later, "durable_median": durable}
    row.result = f"blocked {later:.3f} s (median of {len(middle)} after the first)"
    base = (sync.figures or {}).get("blocked_later_median") if sync else None
    if asynchronous and base:
        row.result += f" = {later / base:.1%} of synchronous"
        row.figures["share_of_sync"] = later / base
    row.detail = (f"{len(cks)} checkpoints of {size(cks[0]['bytes'])}, blocked "
                  f"{', '.join(f'{x:.3f}' for x in blocked)} s (the last at max_steps); durable after "
                  f"{durable:.2f} s (median)")
    shutil.rmtree(folder, ignore_errors=True)
    return row


def memory_row(b: Bench, name: str, overrides: list[str], run_slug: str) -> Row:
    """`ember plan --calibrate`'s estimate of a step's peak against the peak it measures (on CUDA,
    max_memory_allocated over one real step), with the whole `ember run`'s allocator peaks."""
    s = b.sizes
    row = Row(name, f"{s.precision}, {s.micro_batch} x {s.seq_len}")
    plan, failed = b.json_of(slug_of(name), "plan", overrides, "--calibrate", suffix=".plan")
    if plan is None:
        row.result = failed
        return row
    mem = plan["memory"]
    probe = b.probes.get(run_slug)
    row.figures = {"estimate": mem["peak"], "with_margin": mem["with_margin"], "measured_step": mem.get("measured_peak"),
                   "error": mem.get("error"), "phase": mem["phase"], "cuda_run": probe}
    measured = mem.get("measured_peak")
    row.result = (f"plan {size(mem['peak'])}, measured {size(measured)} ({mem['error']:+.1%})"
                  if measured else f"plan {size(mem['peak'])}, not measured")
    row.detail = f"peak at {mem['phase']}; with the plan's margin {size(mem['with_margin'])}; whole run: "
    if probe and probe.get("cuda"):
        row.detail += f"{peaks_text(probe)} (plan {mem['peak'] / probe['max_allocated'] - 1:+.1%} of allocated)"
    else:
        row.detail += peaks_text(probe) if probe else f"not read (the {run_slug} row did not run its `ember run`)"
    return row


def doctor_row(b: Bench, name: str, overrides: list[str]) -> Row:
    """`ember doctor --json` on a configuration: its first cause (what its remedy would save) and
    the operators that took the step's time (torch.profiler: device time on CUDA), so a GPU run
    says where the MFU it measured goes."""
    s = b.sizes
    row = Row(name, f"{s.precision}, {s.micro_batch} x {s.seq_len}, --budget {s.doctor_seconds}")
    report, failed = b.json_of(slug_of(name), "doctor", overrides, "--budget", str(s.doctor_seconds),
                               limit=s.doctor_seconds + 60)
    if report is None:
        row.result = failed
        return row
    first = (report["findings"] or [None])[0]
    ops = report["figures"].get("top_ops") or []
    row.figures = {"findings": report["findings"], "top_ops": ops, "headline": report["headline"],
                   "skipped": report["skipped"]}
    row.result = "no cause above the noise" if not first else (  # as `ember doctor` ranks them
        f"{first['cause']}: {max(0.0, first['saving_share']):.0%} of the step" if first["cause"] == "compute-bound"
        else f"{first['cause']}: its remedy saves {first['saving_seconds'] * 1e3:.1f} ms "
             f"({max(0.0, first['saving_share']):.0%}) of a step")
    row.detail = ("top operators: " + ", ".join(f"{o['name']} {o['share']:.0%}" for o in ops[:6]) if ops
                  else "no profile (" + "; ".join(f"{k}: {v}" for k, v in (report["skipped"] or {}).items()) + ")")
    if first:
        row.detail += f"; remedy: {first['remedy']}"
    return row


def write_recipe(b: Bench, model: Path) -> None:
    """The recipe every row starts from; a row's own settings are `--set` overrides of it."""
    s = b.sizes
    b.recipe.write_text(to_toml({
        "model": {"path": str(model)}, "method": {"kind": "full"},
        "data": {"files": [str(ROOT / "examples" / "data" / "genesis.jsonl")], "seq_len": s.seq_len},
        "optimizer": {"lr": 1e-4}, "train": {"max_steps": s.steps, "micro_batch": s.micro_batch, "seed": 0},
        "checkpoint": {"every_steps": 0}, "precision": {"mode": s.precision}}))


def markdown(rows: list[Row]) -> str:
    cell = lambda x: str(x).replace("|", "\\|")
    lines = ["| row | configuration | result | detail |", "| --- | --- | --- | --- |"]
    return "\n".join(lines + [f"| {cell(r.name)} | {cell(r.config)} | {cell(r.result)} | {cell(r.detail)} |"
                              for r in rows])


@dataclass
class Planned:
    name: str
    need: float                         # seconds it needs at the least on the GPU (else it is not started)
    make: Callable[[], Row] | None      # how to measure it; None: `said` is its result, nothing runs
    said: str = ""


def plan_rows(b: Bench, compiled: str | None, qlora: str | None, int8: str | None) -> list[Planned]:
    """The rows in the order they run: what matters most first, so a spent budget cuts the least."""
    done: dict[str, Row] = {}
    full, lora = ["method.kind=full"], ["method.kind=lora", "method.rank=16"]

    def measure(name: str, need: float, make: Callable[[str], Row], unless: str | None = None) -> Planned:
        def made() -> Row:
            done[name] = make(name)
            return done[name]
        return Planned(name, need, None if unless else made, unless or "")
    qlora_sets = ["method.kind=lora", "method.quantize=nf4", "method.rank=16"]
    return [
        measure("full, eager", 45, lambda n: mfu_row(b, n, full + b.eager)),
        measure("full, compiled", 150, lambda n: mfu_row(b, n, full + ["train.compile=true"]),
                compiled and f"skipped: {compiled}"),
        measure("doctor, full, eager", 130,  # its own loop, bounded by its budget, not by max_steps
                lambda n: doctor_row(b, n, full + b.eager + ["train.max_steps=100000"])),
        measure("LoRA, eager", 45, lambda n: mfu_row(b, n, lora + b.eager)),
        measure("checkpoint, synchronous", 60, lambda n: checkpoint_row(b, n, False, None)),
        measure("checkpoint, asynchronous", 60,
                lambda n: checkpoint_row(b, n, True, done.get("checkpoint, synchronous"))),
        measure("memory, full", 40, lambda n: memory_row(b, n, full + b.eager, "full-eager")),
        measure("QLoRA", 45, lambda n: mfu_row(b, n, qlora_sets + b.eager), qlora and f"not landed: {qlora}"),
        measure("memory, QLoRA", 40, lambda n: memory_row(b, n, qlora_sets + b.eager, "qlora"),
                qlora and f"not landed: {qlora}"),
        measure("full, 8-bit optimizer states", 45,
                lambda n: mfu_row(b, n, full + b.eager + ["optimizer.state_dtype=int8"]),
                int8 and f"not landed: {int8}"),
        measure("memory, LoRA", 40, lambda n: memory_row(b, n, lora + b.eager, "lora-eager")),
        measure("LoRA, compiled", 150, lambda n: mfu_row(b, n, lora + ["train.compile=true"]),
                compiled and f"skipped: {compiled}"),
        measure("full, eager, deterministic off", 45,
                lambda n: mfu_row(b, n, full + b.eager + ["train.deterministic=false"])),
        Planned("co-serving", 0, None, "not in this script yet: co-serving (`[serve] coserve = true`) is "
                "measured on CPU by bench/coserve_light.py; its GPU latency row goes here"),
    ]


ROWS = [p.name for p in plan_rows(None, None, None, None)]  # type: ignore[arg-type]  (names only: nothing runs)


def features(b: Bench, smoke: bool) -> tuple[str | None, str | None, str | None]:
    """Why the compiled, QLoRA and 8-bit rows cannot run with this ember (None: they can), from
    what its recipe accepts; sets what makes the other rows eager."""
    compiled = b.refusal("train.compile=true")
    if compiled and "unknown key 'compile'" in compiled:
        compiled = "train.compile not available in this ember"
    elif compiled:
        compiled = f"this ember's recipe refuses train.compile = true ({compiled})"
    b.eager = [] if compiled == "train.compile not available in this ember" else ["train.compile=false"]
    if smoke and not compiled and not os.environ.get("GPU_BENCH_SMOKE_COMPILE"):
        compiled = "--cpu-smoke leaves compiling out (minutes on a CPU; GPU_BENCH_SMOKE_COMPILE=1 runs it)"
    qlora = b.refusal("method.kind=lora", "method.quantize=nf4")
    int8 = b.refusal("optimizer.state_dtype=int8")
    return (compiled, qlora and f"this ember's recipe refuses method.quantize = 'nf4' ({qlora})",
            int8 and f"this ember's recipe refuses optimizer.state_dtype = 'int8' ({int8})")


def measure_rows(b: Bench, planned: list[Planned], only: set[str], smoke: bool) -> list[Row]:
    """Each planned row's measurement, or why it has none (not asked for, budget spent, not landed)."""
    rows: list[Row] = []
    for row in planned:
        if row.make is None:
            rows.append(Row(row.name, "", row.said))
        elif only and slug_of(row.name) not in only:
            rows.append(Row(row.name, "", "not run (--only)"))
        elif b.left() < (10 if smoke else row.need):
            rows.append(Row(row.name, "", f"skipped: time budget ({b.left():.0f} of {b.budget:.0f} s left)"))
        else:
            print(f"[bench] {row.name} ({b.left():.0f} s left) ...", file=sys.stderr, flush=True)
            started = time.monotonic()
            rows.append(row.make())
            rows[-1].figures["wall_seconds"] = time.monotonic() - started
        print(f"[bench] {row.name}: {rows[-1].result}", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="the same pipeline on CPU: a tiny model, 2 steps")
    p.add_argument("--budget", type=float, default=None, help="seconds for all rows (GPU 480, smoke 600)")
    p.add_argument("--only", default="", help="rows to run, comma-separated: " + ", ".join(map(slug_of, ROWS)))
    p.add_argument("--work", type=Path, help="working folder (default: a new temporary one, removed at the end)")
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--steps", type=int)
    args = p.parse_args()
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if unknown := only - set(map(slug_of, ROWS)):
        p.error(f"--only {','.join(sorted(unknown))}: the rows are {', '.join(map(slug_of, ROWS))}")
    t0, smoke = time.monotonic(), args.cpu_smoke
    sizes = SMOKE if smoke else GPU
    sizes = replace(sizes, micro_batch=args.micro_batch or sizes.micro_batch, seq_len=args.seq_len or sizes.seq_len,
                    steps=args.steps or sizes.steps,
                    extra=sizes.extra + (f"train.device={'cpu' if smoke else 'cuda'}",))
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    work = args.work or Path(tempfile.mkdtemp(prefix="ember-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    b = Bench(sizes, work, out, args.budget or (600 if smoke else 480))
    model = work / "model"
    write_recipe(b, model)
    compiled, qlora, int8 = features(b, smoke)
    print(f"[bench] writing the {sizes.shape} model ...", file=sys.stderr, flush=True)
    if not model.exists() and b.call([sys.executable, str(ROOT / "bench" / "gpu_probe.py"), "model", str(model),
                                      sizes.shape], "model", limit=300) != 0:
        print(b.failure("model", 1), file=sys.stderr)
        return 1
    rows = measure_rows(b, plan_rows(b, compiled, qlora, int8), only, smoke)
    full = [r.figures["mfu_steady"] for r in rows if r.name.startswith("full") and r.figures.get("mfu_steady")]
    goal = f"goal: MFU >= {GOAL_MFU:.0%} in bf16 on the 0.5B full fine-tune: " + (
        "not measured here (--cpu-smoke)" if smoke else "not measured (no full fine-tuning row has a figure)"
        if not full else f"{'met' if max(full) >= GOAL_MFU else 'not met'} (best full fine-tuning row {max(full):.1%})")
    text = (f"{markdown(rows)}\n\n{goal}\ntook {time.monotonic() - t0:.0f} s; model {sizes.shape}; work folder "
            f"{work}{'' if args.work else ' (removed)'}")
    print(text, flush=True)
    machine = os.environ.get("GPU_BENCH_ENV", "")
    (out / "gpu-table.md").write_text(f"{machine}\n\n{text}\n")
    (out / "gpu-raw.json").write_text(json.dumps({"machine": machine.splitlines(), "sizes": asdict(sizes),
                                                  "rows": [asdict(r) for r in rows]}, indent=1, default=str))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
