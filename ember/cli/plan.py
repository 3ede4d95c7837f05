"""`ember plan` and `ember preflight`: thin layers over ember.plan."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ember.errors import EXIT_ERROR, EXIT_OK, EmberError
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
    from ember.plan.planner import (
        UnknownArchitecture,
        apply_changes,
        detect_devices,
        make_plan,
        replace_memory,
    )
    from ember.recipe import load_recipe
    r = load_recipe(args.recipe, args.overrides)
    if args.target_micro_batch is not None:
        if args.target_micro_batch < 1:
            raise EmberError(f"--target-micro-batch {args.target_micro_batch}: must be >= 1")
        r = apply_changes(r, {"train.micro_batch": args.target_micro_batch})
    calibration = None
    if args.calibrate:
        from ember.plan.preflight import calibrate
        calibration = calibrate(r)
    devices = detect_devices(r.train.device)
    if args.device_memory is not None:
        if args.device_memory <= 0:
            raise EmberError(f"--device-memory {args.device_memory:g}: must be > 0 GiB")
        devices = replace_memory(devices, int(args.device_memory * GiB))
    from ember.ledger.store import connect
    con = connect(args.ledger)  # this machine's checkpoint costs and interruption history
    try:
        plan = make_plan(r, con, calibration, devices)
    except UnknownArchitecture as e:
        from ember.plan.preflight import calibrate
        print(f"{e}: measuring a step here instead (calibration)", file=sys.stderr)
        plan = make_plan(r, con, calibrate(r), devices)
    plan.recipe["target_micro_batch"] = args.target_micro_batch
    if args.json:
        print(json.dumps(asdict(plan), indent=1, default=str))
    else:
        render(plan, Console(soft_wrap=True))
    if args.apply:
        usable = [x for x in plan.remedies if x["fits"] and x["available"] and x["changes"]]
        if plan.fits:
            print(f"fits as written: nothing to apply; {args.apply} not written", file=sys.stderr)
        elif not usable:
            raise EmberError("no remedy ember can apply makes this recipe fit; see the verdict")
        else:
            best = usable[0]
            write_recipe(apply_changes(r, best["changes"]), args.apply)
            print(f"wrote {args.apply}: {best['name']} ({', '.join(f'{k} = {v}' for k, v in best['changes'].items())})",
                  file=sys.stderr)
    return EXIT_OK


def write_recipe(r: Any, path: Path) -> None:
    lines = []
    for section, values in r.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def render(p: Any, out: Console) -> None:
    for d in p.devices:
        out.print(f"device: {d['name']} ({d['kind']}): {_gib(d['total'])} total, {_gib(d['free'])} free")
    m, mem = p.model, p.memory
    if m:
        out.print(f"model: {m['family']}-style, {m['layers']} layers, hidden {m['hidden']}, "
                  f"{m['heads']}/{m['kv_heads']} heads, vocab {m['vocab']:,}; {m['params']:,} parameters, "
                  f"{m['trainable']:,} trained")
    rc = p.recipe
    out.print(f"recipe: {rc['method']}, micro batch {rc['micro_batch']} x seq {rc['seq_len']} x accum "
              f"{rc['grad_accum']}, {rc['precision']}, activation checkpointing "
              f"{'on' if rc['activation_checkpointing'] else 'off'}, loss chunk {rc['loss_chunk'] or 'off'}")
    t = Table(title=f"peak memory per device (at {mem['phase']})", title_justify="left")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    for key in ("weights", "gradients", "optimizer", "activations", "loss_buffers", "temporaries"):
        if key in mem:
            t.add_row(key.replace("_", " "), _gib(mem[key]))
    t.add_row("peak", _gib(mem["peak"]))
    t.add_row(f"+ margin {mem['margin']:.0%}", _gib(mem["with_margin"]))
    if "measured_peak" in mem:
        t.add_row("measured peak", f"{_gib(mem['measured_peak'])} ({mem['error']:+.1%})")
    out.print(t)
    for phase, n in mem.get("phases", {}).items():
        out.print(f"  {phase}: {_gib(n)}")
    out.print(f"fits: {'yes' if p.fits else 'NO'} ({_gib(mem['with_margin'])} needed, "
              f"{_gib(p.devices[0]['free'])} free)")
    if p.remedies and (not p.fits or p.recipe.get("target_micro_batch")):
        t = Table(title="remedies, ranked (cheapest that fits first)", title_justify="left")
        for col in ("", "remedy", "peak", "fits", "compute"):
            t.add_column(col)
        for i, x in enumerate(p.remedies, 1):
            t.add_row(str(i), x["name"] + ("" if x["available"] else " (not available)"), _gib(x["peak"]),
                      "yes" if x["fits"] else "no", f"{x['flops_factor'] - 1:+.0%}")
        out.print(t)
        for i, x in enumerate(p.remedies, 1):
            changes = ", ".join(f"{k} = {json.dumps(v)}" for k, v in x["changes"].items())
            out.print(f"  {i}. {x['how']}" + (f" [{changes}]" if changes else ""), markup=False)
    tm = p.time
    out.print(f"time: {tm['step_seconds']:.4g} s/step ({tm['how']}); {tm['steps']} steps = "
              f"{tm['compute_seconds'] / 3600:.3g} h of compute, {tm['wall_seconds'] / 3600:.3g} h wall-clock "
              f"with start-up, checkpoints and expected lost work", markup=False)
    c = p.cost
    total = "unknown: " + c["formula"] if c["total"] is None else f"{c['total']:.4g} {c['currency']} ({c['formula']})"
    out.print(f"cost: {total}", markup=False)
    ck = p.checkpoint
    out.print(f"checkpoint: {_gib(ck['bytes'])} each, δ = {ck['delta_seconds']:.3g} s "
              f"({'async snapshot' if ck['async'] else 'synchronous save'}; {ck['delta_source']}); "
              f"M = {ck['mtbf_seconds'] / 3600:.3g} h ({ck['mtbf_source']})", markup=False)
    out.print(f"  every {ck['seconds']:.0f} s (Daly; Young {ck['young_seconds']:.0f} s): "
              f"{ck['checkpoint_share']:.2%} of time checkpointing, {ck['lost_share']:.2%} expected "
              f"lost work and restarts; set [checkpoint] every_seconds = \"auto\" to use it", markup=False)
    out.print(f"verdict: [bold]{p.verdict}[/bold]: " + escape("; ".join(p.reasons)))
    for n in p.notes:
        out.print(f"note: {n}", markup=False)


def cmd_preflight(args: argparse.Namespace) -> int:
    from ember.plan.preflight import preflight
    from ember.recipe import load_recipe
    r = load_recipe(args.recipe, args.overrides)
    if args.steps < 2:
        raise EmberError(f"--steps {args.steps}: must be >= 2 (memory is measured on the second)")
    console = Console(stderr=True, soft_wrap=True)
    checks = preflight(r, args.recipe, args.steps, console)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        print_checks(checks, Console(soft_wrap=True))
    return EXIT_OK if all(c.ok or c.warn_only for c in checks) else EXIT_ERROR


def print_checks(checks: list[Any], out: Console) -> None:
    for c in checks:
        mark = "[green]pass[/green]" if c.ok else ("[yellow]warn[/yellow]" if c.warn_only else "[red]FAIL[/red]")
        out.print(f"{mark}  {c.name}: {escape(c.detail)}", highlight=False)
