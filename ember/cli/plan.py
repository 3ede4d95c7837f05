"""`ember plan` and `ember preflight`: thin layers over ember.plan."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ember.cli.render import stderr_events
from ember.errors import EXIT_ERROR, EXIT_OK, BadInput, EmberError
from ember.parallel.pp import STAGE_NOTE
from ember.parallel.registry import STRATEGIES
from ember.plan.memory import GiB, MiB


def add_parsers(sub: Any) -> None:
    plan = sub.add_parser("plan", help="memory, remedies, time, cost, checkpoint interval; local or remote",
                          description="Estimate a recipe's peak memory per device (weights, gradients, "
                          "optimizer state, activations, loss buffers), the remedies that make it fit, "
                          "the time and cost of the run, the checkpoint interval, and whether it "
                          "belongs on this machine. Nothing is trained.")
    plan.add_argument("recipe", type=Path)
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    plan.add_argument("--target-micro-batch", type=int, metavar="N",
                      help="plan for this micro batch instead of the recipe's")
    plan.add_argument("--calibrate", action="store_true",
                      help="also measure a few steps here: step time and the real peak against the estimate")
    plan.add_argument("--apply", type=Path, metavar="OUT.toml",
                      help="write the recipe with the best remedy that fits applied")
    plan.add_argument("--device-memory", type=float, metavar="GIB",
                      help="plan for a device with this much free memory (another machine, or a cap)")
    plan.add_argument("--fit", nargs="?", const="device", metavar="MEM",
                      help="search for the fastest configuration that fits MEM (e.g. 8GiB; 'device' or no "
                      "value: the device's free memory, or --device-memory): method, LoRA rank, optimizer-state "
                      "precision, activation checkpointing, micro batch x accumulation; print it and the next "
                      "four as --set lines")
    plan.add_argument("--fit-seq", action="store_true",
                      help="with --fit: also try shorter sequences (halved, down to 16) when nothing fits")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--ledger", type=Path, help="the ledger (default $EMBER_HOME/ledger.db)")

    pre = sub.add_parser("preflight", help="a few real steps on a slice: loss, resume, memory, input speed",
                         description="Before a long run: tokenize a slice of the data, run a few optimizer "
                         "steps, check the loss is finite, checkpoint and restore in a fresh process "
                         "and compare bit for bit, measure peak memory against the plan and the input "
                         "pipeline against the model. Exit 0 when every check passes, 1 otherwise.")
    pre.add_argument("recipe", type=Path)
    pre.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    pre.add_argument("--steps", type=int, default=3, help="optimizer steps to run (default 3)")
    pre.add_argument("--json", action="store_true")


def cmd_plan(args: argparse.Namespace) -> int:
    if args.fit is not None or args.fit_seq:
        return cmd_fit(args)
    from ember.doctor.calibrated_plan import PlanRequest, plan_recipe
    result = plan_recipe(PlanRequest(args.recipe, args.overrides, args.target_micro_batch, args.calibrate,
                                     args.device_memory, args.ledger, args.apply), stderr_events())
    if args.json:
        print(json.dumps(finite(result.plan.to_dict() | {"target_micro_batch": result.target_micro_batch}),
                         indent=1, default=str))
    else:
        render(result.plan, Console(soft_wrap=True), result.target_micro_batch is not None)
    err = Console(stderr=True, soft_wrap=True)
    if result.apply_note:
        err.print(result.apply_note, markup=False, highlight=False)
    if result.applied is not None:
        changes = ", ".join(f"{k} = {v}" for k, v in result.applied.changes.items()) or "no recipe change"
        launch = result.applied.launch
        start = f"; start it with `ember run {args.apply} --out DIR {launch}`" if launch else ""
        err.print(f"wrote {args.apply}: {result.applied.name} ({changes}){start}", markup=False, highlight=False)
    return EXIT_OK


def cmd_fit(args: argparse.Namespace) -> int:
    from ember.doctor.traced import traced_step
    from ember.plan.fit import FitRequest, fit_recipe
    if args.fit is None:
        raise BadInput("--fit-seq goes with --fit MEM: it lets the search shorten the sequences")
    if args.calibrate or args.target_micro_batch is not None:
        raise BadInput("--fit searches by the plan's estimate alone: drop --calibrate and --target-micro-batch "
                       "(it searches the micro batch itself)")
    f = fit_recipe(FitRequest(args.recipe, args.overrides, args.fit, args.fit_seq, args.device_memory, args.apply),
                   stderr_events().warn, traced_step)
    if args.json:
        print(json.dumps(finite(asdict(f) | {"best": [asdict(c) | {"overrides": c.overrides()} for c in f.best]}),
                         indent=1, default=str))
    else:
        render_fit(f, Console(soft_wrap=True))
    if f.applied is not None:
        Console(stderr=True, soft_wrap=True).print(f"wrote {f.applied}: the recipe with the first configuration "
                                                   f"applied", markup=False, highlight=False)
    return EXIT_OK


def finite(value: Any) -> Any:
    """`value` (JSON-ready dicts and lists) with every nan or infinite float as None: a figure the
    plan cannot predict (a device without a known peak) is null in --json, not NaN, which JSON has not."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def render_fit(f: Any, out: Console) -> None:
    """`ember plan --fit` as printed: what was searched, the fastest that fit, each as --set lines."""
    s = f.space
    ranks = ", ".join(map(str, s["rank"]))
    out.print(f"fit: {f.budget_source}, with the {f.margin:.0%} [plan] memory_margin; {f.searched} configurations "
              f"searched, {f.fitting} fit", markup=False)
    out.print(f"searched: method {', '.join(s['method'])} (LoRA rank {ranks}); optimizer state "
              f"{', '.join(s['state_dtype'])}; activation checkpointing off, on; micro batch "
              f"{', '.join(map(str, s['micro_batch']))} (micro batch x accum held); seq "
              f"{', '.join(map(str, s['seq_len']))}", markup=False)
    out.print(f"time: {f.time_source}", markup=False)
    if f.as_written is not None:
        w = f.as_written
        out.print(f"as written: {_gib(w.peak)} peak, {_gib(w.with_margin)} with margin, "
                  f"{'fits' if w.fits else 'does NOT fit'}, {_seconds(w.step_seconds)}", markup=False)
    for i, c in enumerate(f.best, 1):
        head = "fastest that fits" if i == 1 else "next"
        out.print(f"{i}. {head}: {c.describe()}: {_gib(c.peak)} peak ({_gib(c.with_margin)} with margin), "
                  f"{_seconds(c.step_seconds)}", markup=False)
        sets = " ".join(f"--set {o}" for o in c.overrides()) or "(the recipe as written)"
        out.print(f"   {sets}", markup=False, highlight=False)
    out.print("add the --set lines to `ember run RECIPE` or `ember plan RECIPE`; `ember preflight RECIPE --set ...` "
              "measures the peak", markup=False)
    for n in f.notes:
        out.print(f"note: {n}", markup=False)


def _seconds(s: float) -> str:
    return f"{s:.4g} s/step predicted" if s == s else "step time unknown"


def render_parallel(a: Any, out: Console) -> None:
    out.print(f"parallelism over the measured interconnect ({a.interconnect.measured}; all-reduce "
              f"{a.interconnect.all_reduce.bandwidth / 1e6:,.0f} MB/s, {a.interconnect.all_reduce.latency * 1e6:.0f} µs "
              f"a hop):", markup=False)
    t = Table("n", "layout", "step", "comm", "memory", "eff.", box=None, padding=(0, 1))
    for o in a.options:
        t.add_row(str(o.devices), o.strategy, f"{o.step_seconds:.3g} s", f"{o.exposed_seconds:.3g} s",
                  _gib(o.memory_bytes) + ("" if o.fits else " (no fit)"), f"{o.efficiency:.0%}")
    out.print(t)
    for o in a.options:  # a pipeline's memory is its fullest stage's: say which
        for note in (n for n in o.notes if n.startswith(STAGE_NOTE)):
            out.print(f"  {o.strategy} on {o.devices}: {note}", markup=False)
    *most, last = STRATEGIES
    out.print("step: predicted optimizer step; comm: communication the compute does not hide; memory: per "
              "device at the step's peak; eff.: one device's step / (n x this step); "
              f"ember runs each ({', '.join(most)} and {last}): --set distributed.strategy=NAME", markup=False)
    if a.recommended is not None:
        rec = a.recommended
        run = (f" (ember run RECIPE --out OUT --nproc {rec.devices} --set distributed.strategy={rec.strategy})"
               if rec.devices > 1 else "")
        out.print(f"recommended: [bold]{escape(rec.strategy)} on {rec.devices}[/bold]: "
                  + escape("; ".join(a.reasons) + run))
    else:
        out.print("recommended: none: " + escape("; ".join(a.reasons)))


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def render(p: Any, out: Console, show_remedies: bool = False) -> None:
    """A plan as `ember plan` prints it; the remedies only when it does not fit, or when asked."""
    for d in p.devices:
        out.print(f"device: {d.name} ({d.kind}): {_gib(d.total)} total, {_gib(d.free)} free", markup=False)
    mem = p.memory
    if p.model and p.model.shape is None:
        out.print(f"model: {p.model.family}, its step traced on its module graph (fake tensors); "
                  f"{p.model.params:,} parameters, {p.model.trainable:,} trained", markup=False)
    elif p.model:
        m = p.model.shape
        out.print(f"model: {m.family}-style, {m.layers} layers, hidden {m.hidden}, {m.heads}/{m.kv_heads} heads, "
                  f"vocab {m.vocab:,}; {p.model.params:,} parameters, {p.model.trainable:,} trained")
    rc = p.recipe
    bases = {"nf4": "a 4-bit nf4 base", "gguf": "the GGUF file's quantized blocks"}
    method = f"{rc.method} over {bases[rc.quantize]}" if rc.quantize in bases else rc.method
    out.print(f"recipe: {method}, micro batch {rc.micro_batch} x seq {rc.seq_len} x accum {rc.grad_accum}, "
              f"{rc.precision}, activation checkpointing {'on' if rc.activation_checkpointing else 'off'}, "
              f"loss chunk {rc.loss_chunk or 'off'}, optimizer state {rc.optimizer_state}")
    out.print(memory_table(mem))
    for phase, n in mem.phases.items():
        out.print(f"  {phase}: {_gib(n)}")
    out.print(f"fits: {'yes' if p.fits else 'NO'} ({_gib(mem.with_margin)} needed, {_gib(p.devices[0].free)} free)")
    if p.remedies and (not p.fits or show_remedies):
        out.print(remedies_table(p.remedies))
        for i, x in enumerate(p.remedies, 1):
            changes = [f"{k} = {json.dumps(v)}" for k, v in x.changes.items()]
            changes += [f"ember run ... {x.launch}"] if x.launch else []
            out.print(f"  {i}. {x.how}" + (f" [{'; '.join(changes)}]" if changes else ""), markup=False)
    tm = p.time
    mfu = f", MFU {tm.mfu:.0%}" if tm.mfu is not None else ""
    if math.isfinite(tm.wall_seconds):
        out.print(f"time: {tm.step_seconds:.4g} s/step ({tm.how}{mfu}); {tm.steps} steps = "
                  f"{tm.compute_seconds / 3600:.3g} h of compute, {tm.wall_seconds / 3600:.3g} h wall-clock "
                  f"with start-up, checkpoints and expected lost work", markup=False)
    else:  # no peak FLOP/s for this device (nan): say so rather than print nan
        out.print(f"time: {tm.how}; {tm.steps} steps, wall-clock unknown", markup=False)
    c = p.cost
    total = "unknown: " + c.formula if c.total is None else f"{c.total:.4g} {c.currency} ({c.formula})"
    out.print(f"cost: {total}", markup=False)
    ck = p.checkpoint
    out.print(f"checkpoint: {_gib(ck.bytes)} each, δ = {ck.delta_seconds:.3g} s "
              f"({'async snapshot' if ck.asynchronous else 'synchronous save'}; {ck.delta_source}); "
              f"M = {ck.mtbf_seconds / 3600:.3g} h ({ck.mtbf_source})", markup=False)
    iv = ck.interval
    out.print(f"  every {iv.seconds:.0f} s (Daly; Young {iv.young_seconds:.0f} s): "
              f"{iv.checkpoint_share:.2%} of time checkpointing, {iv.lost_share:.2%} expected "
              f"lost work and restarts; set [checkpoint] every_seconds = \"auto\" to use it", markup=False)
    out.print(f"verdict: [bold]{p.verdict}[/bold]: " + escape("; ".join(p.reasons)))
    if p.parallel is not None:
        render_parallel(p.parallel, out)
    else:
        out.print("parallelism: no interconnect measured from this machine; `ember doctor --comm` measures it "
                  f"and then this plan compares the layouts ember runs: {', '.join(STRATEGIES)}", markup=False)
    for n in p.notes:
        out.print(f"note: {n}", markup=False)


def memory_table(mem: Any) -> Table:
    """The peak memory per device, part by part, with the margin and (calibrated) the measured peak."""
    t = Table(title=f"peak memory per device (at {mem.phase})", title_justify="left")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    for key in ("weights", "gradients", "optimizer", "activations", "loss_buffers", "temporaries"):
        if getattr(mem, key) is not None:
            t.add_row(key.replace("_", " "), _gib(getattr(mem, key)))
    t.add_row("peak", _gib(mem.peak))
    t.add_row(f"+ margin {mem.margin:.0%}", _gib(mem.with_margin))
    if mem.measured_peak is not None:
        t.add_row("measured peak", f"{_gib(mem.measured_peak)} ({mem.error:+.1%})")
    return t


def remedies_table(remedies: list[Any]) -> Table:
    """The remedies, ranked: each one's peak, whether it fits, its compute cost."""
    t = Table(title="remedies, ranked (cheapest that fits first)", title_justify="left")
    for col in ("", "remedy", "peak", "fits", "compute"):
        t.add_column(col)
    for i, x in enumerate(remedies, 1):
        t.add_row(str(i), x.name + ("" if x.available else " (not available)"), _gib(x.peak),
                  "yes" if x.fits else "no", f"{x.flops_factor - 1:+.0%}")
    return t


def cmd_preflight(args: argparse.Namespace) -> int:
    from ember.doctor.preflight import preflight
    from ember.recipe import load_recipe
    r = load_recipe(args.recipe, args.overrides)
    if args.steps < 2:
        raise EmberError(f"--steps {args.steps}: must be >= 2 (memory is measured on the second)")
    checks = preflight(r, args.recipe, args.steps, stderr_events())
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        print_checks(checks, Console(soft_wrap=True))
    return EXIT_OK if all(c.ok or c.warn_only for c in checks) else EXIT_ERROR


def print_checks(checks: list[Any], out: Console) -> None:
    for c in checks:
        mark = "[green]pass[/green]" if c.ok else ("[yellow]warn[/yellow]" if c.warn_only else "[red]FAIL[/red]")
        out.print(f"{mark}  {c.name}: {escape(c.detail)}", highlight=False)
