"""`ember runs`, `ember report`, `ember compare`, `ember repro`: printing over ember.metrics."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ember.errors import EmberError
from ember.jsonl import read_jsonl
from ember.ledger import store as ledger_store
from ember.metrics.compare import compare_runs
from ember.metrics.report import (
    build_report,
    load_run_record,
    resolve_run,
    summary_line,
)

out = Console(soft_wrap=True)
if not out.is_terminal:
    out = Console(soft_wrap=True, width=220)  # piped or captured: rows unwrapped


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def cmd_runs(args: argparse.Namespace) -> int:
    con = ledger_store.connect(args.ledger)
    table = Table("run", "status", "steps", "tokens/s/dev", "MFU", "goodput", "p50 / p99 ms", "cost", "path")
    for row in ledger_store.all_runs(con):
        s = json.loads(row["summary"]) if row["summary"] else {}
        attempts = ledger_store.attempts(con, row["id"])
        status = s.get("status") or (attempts[-1].outcome if attempts else None) or "running/killed"
        cost = f"{s['cost']:.4f} {s['currency']}" if s.get("cost") is not None else "-"
        table.add_row(row["id"], status, f"{s.get('steps', '?')}/{row['max_steps']}",
                      _fmt(s.get("tokens_per_second_per_device"), ",.0f"), _fmt(s.get("mfu"), ".1%"),
                      _fmt(s.get("goodput"), ".1%"),
                      f"{_fmt(s.get('p50') and s['p50'] * 1000, '.1f')} / {_fmt(s.get('p99') and s['p99'] * 1000, '.1f')}",
                      cost, row["path"])
    out.print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    con = ledger_store.connect(args.ledger)
    path = resolve_run(args.run, con)
    report = build_report(path, con)
    if args.plots:
        from ember.metrics.plots import write_plots
        notes: list[str] = []
        written = write_plots(report, read_jsonl(path / "metrics.jsonl", notes),
                              read_jsonl(path / "metrics.lost.jsonl", notes), args.plots)
        report["plots"] = [str(p) for p in written]
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    r = report["run"]
    out.print(f"[bold]{r['id']}[/bold]  {r['status']}  step {r['steps']}/{r['max_steps']}  "
              f"attempts {r['attempts']}  ({r['path']})", highlight=False)
    out.print(summary_line(report), highlight=False, markup=False)
    if g := report.get("goodput"):
        t = Table("where the time went", "seconds", "share", "evidence", title="goodput")
        t.add_row("productive", f"{g['buckets']['productive']:.2f}", f"{g['goodput']:.1%}", "")
        for item in report["where_time_goes"]:
            t.add_row(item["bucket"], f"{item['seconds']:.2f}", f"{item['share']:.1%}", item["evidence"])
        t.add_row("[bold]wall-clock[/bold]", f"{g['wall_seconds']:.2f}", "100%", "")
        out.print(t)
    if st := report.get("step_time"):
        out.print(f"step time: p50 {st['p50'] * 1000:.2f} ms, p90 {st['p90'] * 1000:.2f} ms, "
                  f"p99 {st['p99'] * 1000:.2f} ms, max {st['max'] * 1000:.2f} ms over {st['count']} steps")
        for s in report["stalls"][:10]:
            out.print(f"  stall: step {s['step']} {s['seconds'] * 1000:.1f} ms ({s['ratio']:.1f}x median): "
                      f"{'; '.join(s['coincided'])}", highlight=False)
    if m := report.get("mfu"):
        out.print(f"MFU: {_fmt(m['value'], '.2%')}  formula {m['formula']} = {m['flops_per_token']:,.0f} "
                  f"FLOPs/token; peak {_fmt(m['peak_flops'] and m['peak_flops'] / 1e12, ',.2f', ' TFLOP/s')} "
                  f"({m['peak_source']})", highlight=False, markup=False)
    if c := report.get("cost"):
        total = f"{c['total']:.4f} {c['currency']}" if c["total"] is not None else "unknown"
        what = "per completed run" if c["completed"] else "so far (not completed)"
        out.print(f"cost {what}: {total}; per million tokens: {_fmt(c['per_million_tokens'], '.4f')}; "
                  f"{c['formula']}", highlight=False, markup=False)
    if a := report.get("attempts"):
        t = Table("attempt", "outcome", "resumed from", "seconds", "lost steps", title="attempts")
        for x in a:
            end = x["end"] or x["last_seen"] or x["start"]
            t.add_row(str(x["attempt"]), str(x["outcome"]), str(x["resumed_from"]),
                      f"{end - x['start']:.1f}", str(x["lost_steps"]))
        out.print(t)
    for note in report["notes"]:
        out.print(f"note: {note}", highlight=False, markup=False)
    for p in report.get("plots", []):
        out.print(f"plot: {p}", highlight=False)
    return 0


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(path / "metrics.jsonl", [])}


def _weights_equal(a: Path, b: Path) -> bool | None:
    import torch
    from safetensors.torch import load_file
    fa, fb = sorted((a / "final").glob("*.safetensors")), sorted((b / "final").glob("*.safetensors"))
    if not fa or not fb:
        return None
    if [p.name for p in fa] != [p.name for p in fb]:
        return False
    for x, y in zip(fa, fb):
        ta, tb = load_file(x), load_file(y)
        if ta.keys() != tb.keys() or not all(torch.equal(ta[k], tb[k]) for k in ta):
            return False
    return True


def compare_paths(a: Path, b: Path, tolerance: float) -> Any:
    return compare_runs(load_run_record(a), load_run_record(b), _losses(a), _losses(b), tolerance,
                        _weights_equal(a, b))


def cmd_compare(args: argparse.Namespace) -> int:
    con = ledger_store.connect(args.ledger)
    a, b = resolve_run(args.run_a, con), resolve_run(args.run_b, con)
    c = compare_paths(a, b, args.tolerance)
    if args.json:
        print(json.dumps(asdict(c), indent=1, default=str))
        return 0
    print_comparison(c)
    return 0


def print_comparison(c: Any) -> None:
    out.print(f"verdict: [bold]{c.verdict}[/bold] over {c.steps_compared} steps "
              f"(tolerance {c.tolerance:g})")
    if c.first_differing_step is not None:
        out.print(f"first differing step: {c.first_differing_step}; max |loss difference|: "
                  f"{c.max_abs_difference:.6g}", highlight=False)
    out.print(f"final weights: {'equal' if c.weights_equal else 'differ' if c.weights_equal is False else 'n/a'}; "
              f"data fingerprint {'equal' if c.data_fingerprint_equal else 'DIFFERS'}")
    for k, (x, y) in c.recipe_changes.items():
        out.print(f"  recipe {k}: {x!r} -> {y!r}", highlight=False)
    for k, (x, y) in c.manifest_changes.items():
        out.print(f"  manifest {k}: {json.dumps(x)[:80]} -> {json.dumps(y)[:80]}", highlight=False)
    if c.packages_changed:
        out.print(f"  packages differing: {', '.join(c.packages_changed[:20])}", highlight=False)


def cmd_repro(args: argparse.Namespace) -> int:
    """Re-run from the recorded recipe into a new folder with the same command, then compare."""
    con = ledger_store.connect(args.ledger)
    source = resolve_run(args.run, con)
    record = load_run_record(source)
    if args.out.exists():
        raise EmberError(f"--out {args.out}: exists; repro needs a new folder")
    args.out.mkdir(parents=True)
    recipe_file = args.out.parent / f".{args.out.name}.recipe.toml"
    recipe_file.write_text(_to_toml(record["recipe"]))
    cmd = [sys.executable, "-m", "ember", "run", str(recipe_file), "--out", str(args.out)]
    if args.ledger:
        cmd += ["--ledger", str(args.ledger)]
    env = {**os.environ, **record.get("manifest", {}).get("env", {})}
    code = subprocess.run(cmd, env=env).returncode
    recipe_file.unlink()
    if code != 0:
        raise EmberError(f"the re-run exited {code}; {args.out} holds what it did")
    c = compare_paths(source, args.out, args.tolerance)
    print_comparison(c)
    return 0 if c.verdict in ("identical", "close") else 1


def _to_toml(recipe: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, values in recipe.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def cmd_capacity(args: argparse.Namespace) -> int:
    """Duty cycle per device over a period, and the cost of that work rented, reserved or owned."""
    import datetime as dt
    import time
    import tomllib

    from ember.metrics.capacity import DeviceUse, MachinePrices, options
    from ember.paths import ember_home

    con = ledger_store.connect(args.ledger)
    now = time.time()
    since = None
    if args.since:
        try:
            since = dt.datetime.fromisoformat(args.since).timestamp()
        except ValueError:
            raise EmberError(f"--since {args.since!r}: not a date; use e.g. 2026-11-01 or "
                             f"2026-11-01T08:00") from None
    use: dict[str, list[float]] = {}
    starts = []
    for row in ledger_store.all_runs(con):
        rows = ledger_store.attempts(con, row["id"])
        share = _goodput_share(row, con)
        for a in rows:
            end = a.end or a.last_seen or a.start
            lo = max(a.start, since) if since else a.start
            overlap = max(0.0, min(end, now) - lo)
            starts.append(a.start)
            held = use.setdefault(f"{a.host}: {a.devices}", [0.0, 0.0])
            held[0] += overlap * share
            held[1] += overlap * (1 - share)
    if not use:
        out.print("no attempts in the ledger for that period")
        return 0
    period = now - (since or min(starts))
    cfg_path = ember_home() / "machine.toml"
    cfg = tomllib.loads(cfg_path.read_text()).get("capacity", {}) if cfg_path.is_file() else {}
    try:
        prices = MachinePrices(**cfg)
    except TypeError as e:
        raise EmberError(f"{cfg_path}: [capacity] {e}; keys are on_demand_hour, reserved_hour, "
                         f"hardware_price, lifetime_years, watts, energy_price_kwh, currency") from None
    out.print(f"period: {period / 3600:.2f} h ({'since ' + args.since if since else 'since the first attempt'})")
    for device, (productive, badput) in sorted(use.items()):
        u = DeviceUse(device, period, productive, badput)
        out.print(f"[bold]{device}[/bold]: duty cycle {u.duty_cycle:.1%} (productive "
                  f"{productive / period:.1%}, badput {badput / period:.1%}, idle {u.idle_seconds / period:.1%})")
        opts = options(u, prices)
        for o in opts:
            even = f"; break-even duty cycle {o.break_even_duty_cycle:.1%}" if o.break_even_duty_cycle else ""
            out.print(f"  {o.name:10s} {o.cost:12.2f} {prices.currency}  = {o.arithmetic}{even}",
                      highlight=False, markup=False)
        if not opts:
            out.print(f"  set prices under [capacity] in {cfg_path} to compare renting, reserving "
                      f"and owning", highlight=False, markup=False)
    return 0


def _goodput_share(row: Any, con: Any) -> float:
    """Productive share of a run's held time: from its summary, else from a fresh report."""
    if row["summary"]:
        g = json.loads(row["summary"]).get("goodput")
        if g is not None:
            return g
    try:
        return (build_report(Path(row["path"]), con).get("goodput") or {}).get("goodput") or 0.0
    except EmberError:
        return 0.0  # the run folder is gone: count its time as badput
