"""`ember runs`, `ember report`, `ember compare`, `ember repro`, `ember capacity`: argument parsing
and printing over ember.metrics and ember.launch. Every user-supplied string (paths, ids) is
printed without markup, so `[x]` in a path stays as typed."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ember.cli.render import stderr_events
from ember.ledger import database as ledger_store
from ember.metrics.compare import VERDICT_EXIT, Comparison, compare_folders
from ember.metrics.report import RunReport, build_report, resolve_run, summary_line

out = Console(soft_wrap=True)
if not out.is_terminal:
    out = Console(soft_wrap=True, width=220)  # piped or captured: rows unwrapped


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _ms(seconds: float | None) -> str:
    return _fmt(None if seconds is None else seconds * 1000, ".1f")


def cmd_runs(args: argparse.Namespace) -> int:
    from ember.metrics.listing import run_table
    con = ledger_store.connect(args.ledger)
    entries = run_table(con, args.status, args.match, args.sort, args.desc)
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=1))
        return 0
    table = Table("run", "status", "steps", "tokens/s/dev", "MFU", "goodput", "p50 / p99 ms", "cost", "path")
    for s in entries:
        cost = f"{s.cost:.4f} {s.currency}" if s.cost is not None else "-"
        table.add_row(escape(s.id), s.status, f"{s.steps}/{s.max_steps}",
                      _fmt(s.tokens_per_second_per_device, ",.0f"), _fmt(s.mfu, ".1%"), _fmt(s.goodput, ".1%"),
                      f"{_ms(s.p50)} / {_ms(s.p99)}", cost, escape(s.path))
    out.print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    con = ledger_store.connect_or_warn(args.ledger, stderr_events().warn)
    path = resolve_run(args.run, con)
    report = build_report(path, con)
    if args.plots:
        from ember.metrics.report_plots import write_plots
        report.plots = [str(p) for p in write_plots(report, path, args.plots)]
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=str))
        return 0
    print_report(report)
    return 0


def print_report(report: RunReport) -> None:
    """A run's report as `ember report` prints it: summary lines, and tables where there are rows."""
    r = report.run
    out.print(f"{r.id}  {r.status}  step {r.steps}/{r.max_steps}  attempts {_fmt(r.attempts, 'd')}  ({r.path})",
              highlight=False, markup=False)
    if r.stopped_early:
        out.print(r.stopped_early, highlight=False, markup=False)
    out.print(summary_line(report), highlight=False, markup=False)
    if d := report.data:
        out.print(d.text(), highlight=False, markup=False)
        for w in d.warnings:
            out.print(f"warning: {w}", highlight=False, markup=False)
    if report.goodput:
        out.print(goodput_table(report))
    if report.held_out:
        out.print("held-out loss: " + ", ".join(f"step {e['step']} {e['loss']:.4f}" for e in report.held_out)
                  + f" (perplexity {report.held_out[-1]['perplexity']:.2f} at step {report.held_out[-1]['step']}, "
                  f"{report.held_out[-1]['tokens']:,} tokens)", highlight=False, markup=False)
    if report.generations:
        out.print(f"generations at step {report.generations[0]['step']}:", highlight=False, markup=False)
        for g in report.generations:
            out.print(f"  {g['prompt']!r} -> {g['completion']!r}", highlight=False, markup=False)
    if st := report.step_time:
        out.print(f"step time: p50 {st.p50 * 1000:.2f} ms, p90 {st.p90 * 1000:.2f} ms, "
                  f"p99 {st.p99 * 1000:.2f} ms, max {st.max * 1000:.2f} ms over {st.count} steps")
        for s in report.stalls[:10]:
            out.print(f"  stall: step {s.step} {s.seconds * 1000:.1f} ms ({s.ratio:.1f}x median): "
                      f"{'; '.join(s.coincided)}", highlight=False, markup=False)
    if m := report.mfu:
        peak = _fmt(m.peak_flops and m.peak_flops / 1e12, ",.2f", " TFLOP/s")
        share = _fmt(m.value, '.2%') if m.value is not None or m.beyond_peak is None else f"n/a ({m.reason})"
        out.print(f"MFU: {share}  formula {m.formula} = {m.flops_per_token:,.0f} "
                  f"FLOPs/token; peak {peak} ({m.peak_source})", highlight=False, markup=False)
    if c := report.cost:
        total = f"{c.total:.4f} {c.currency}" if c.total is not None else "unknown"
        what = "per completed run" if c.completed else "so far (not completed)"
        out.print(f"cost {what}: {total}; per million tokens: {_fmt(c.per_million_tokens, '.4f')}; "
                  f"{c.formula}", highlight=False, markup=False)
    if rk := report.ranks:
        out.print(ranks_table(report))
        out.print(f"all ranks: {rk.tokens_per_second:,.0f} tokens/s; median steps differ by {rk.spread:.1%} across "
                  f"ranks; the others wait for rank {rk.slowest} ({rk.slowest_cause}); {rk.sync_share:.1%} of a "
                  f"step spent waiting at the step's all-reduce", highlight=False, markup=False)
        if rk.bubble is not None:
            stages = ", ".join(f"rank {x.rank} {x.bubble:.1%}" for x in rk.ranks if x.bubble is not None)
            out.print(f"pipeline bubble: {rk.bubble:.1%} of the schedule measured (median step; {stages}); "
                      f"{_fmt(rk.bubble_predicted, '.1%')} predicted, (stages - 1) / (micro-batches per "
                      f"pipeline + stages - 1)",
                      highlight=False, markup=False)
    if report.attempts:
        out.print(attempts_table(report))
    for note in report.notes:
        out.print(f"note: {note}", highlight=False, markup=False)
    for p in report.plots:
        out.print(f"plot: {p}", highlight=False, markup=False)


def goodput_table(report: RunReport) -> Table:
    """Where a run's wall-clock time went: productive, each loss with its evidence, the whole."""
    g = report.goodput
    t = Table("where the time went", "seconds", "share", "evidence", title="goodput")
    t.add_row("productive", f"{g.buckets['productive']:.2f}", f"{g.goodput:.1%}", "")
    for item in report.where_time_goes:
        t.add_row(item.bucket, f"{item.seconds:.2f}", f"{item.share:.1%}", escape(item.evidence))
    t.add_row("[bold]wall-clock[/bold]", f"{g.wall_seconds:.2f}", "100%", "")
    return t


def ranks_table(report: RunReport) -> Table:
    """Each rank's steps, step times, throughput and where its step time went (a distributed run)."""
    rk = report.ranks
    t = Table("rank", "steps", "step p50", "step p99", "tokens/s", "waiting (sync)", "input", "compute",
              title=f"ranks (attempt {rk.attempt})")
    for x in rk.ranks:
        ph, total = x.phases, x.seconds or 1.0
        t.add_row(str(x.rank), str(x.steps), f"{x.step_p50 * 1000:.1f} ms", f"{x.step_p99 * 1000:.1f} ms",
                  f"{x.tokens_per_second:,.0f}", f"{x.sync_share:.1%}", f"{ph.get('data', 0) / total:.1%}",
                  f"{sum(ph.get(k, 0) for k in ('forward', 'backward', 'optimizer')) / total:.1%}")
    return t


def attempts_table(report: RunReport) -> Table:
    """A run's attempts: how each ended, where it resumed from, how long, the steps it lost."""
    t = Table("attempt", "outcome", "resumed from", "seconds", "lost steps", title="attempts")
    for a in report.attempts:
        end = a.end or a.last_seen or a.start
        t.add_row(str(a.attempt), a.outcome or "-", "-" if a.resumed_from is None else str(a.resumed_from),
                  f"{end - a.start:.1f}", str(a.lost_steps))
    return t


def cmd_compare(args: argparse.Namespace) -> int:
    con = ledger_store.connect_or_warn(args.ledger, stderr_events().warn)
    c = compare_folders(resolve_run(args.run_a, con), resolve_run(args.run_b, con), args.tolerance)
    if args.json:
        print(json.dumps(asdict(c), indent=1, default=str))
    else:
        print_comparison(c)
    return VERDICT_EXIT[c.verdict]


def print_comparison(c: Comparison) -> None:
    out.print(f"verdict: [bold]{c.verdict}[/bold] over {c.steps_compared} steps (tolerance {c.tolerance:g})")
    if c.first_differing_step is not None:
        out.print(f"first differing step: {c.first_differing_step}; max |loss difference|: "
                  f"{c.max_abs_difference:.6g}", highlight=False)
    if c.held_out is not None:
        out.print(c.held_out.text(), highlight=False, markup=False)
    if c.generations:
        out.print(f"generations (A at step {c.generations[0]['step_a']}, B at step {c.generations[0]['step_b']}):",
                  highlight=False, markup=False)
        for g in c.generations:
            out.print(f"  {g['prompt']!r}\n    A: {g['a']!r}\n    B: {g['b']!r}", highlight=False, markup=False)
    out.print(f"final weights: {'equal' if c.weights_equal else 'differ' if c.weights_equal is False else 'n/a'}; "
              f"data fingerprint {'equal' if c.data_fingerprint_equal else 'DIFFERS'}")
    for k, (x, y) in c.recipe_changes.items():
        out.print(f"  recipe {k}: {x!r} -> {y!r}", highlight=False, markup=False)
    for k, (x, y) in c.manifest_changes.items():
        out.print(f"  manifest {k}: {json.dumps(x)[:80]} -> {json.dumps(y)[:80]}", highlight=False, markup=False)
    if c.packages_changed:
        out.print(f"  packages differing: {', '.join(c.packages_changed[:20])}", highlight=False, markup=False)


def cmd_repro(args: argparse.Namespace) -> int:
    from ember.launch import repro
    con = ledger_store.connect_or_warn(args.ledger, stderr_events().warn)
    c = repro(resolve_run(args.run, con), args.out, args.tolerance, args.ledger)
    print_comparison(c)
    return VERDICT_EXIT[c.verdict]


def cmd_capacity(args: argparse.Namespace) -> int:
    from ember.metrics.capacity import capacity_report
    report = capacity_report(ledger_store.connect(args.ledger), args.since)
    if not report.devices:
        out.print("no attempts in the ledger for that period")
        return 0
    period = report.period_seconds
    out.print(f"period: {period / 3600:.2f} h ({'since ' + report.since if report.since else 'since the first attempt'})",
              markup=False, highlight=False)
    for d in report.devices:
        u = d.use
        out.print(f"[bold]{escape(u.device)}[/bold]: duty cycle {u.duty_cycle:.1%} (productive "
                  f"{u.productive_seconds / period:.1%}, badput {u.badput_seconds / period:.1%}, "
                  f"idle {u.idle_seconds / period:.1%})")
        for o in d.options:
            even = f"; break-even duty cycle {o.break_even_duty_cycle:.1%}" if o.break_even_duty_cycle else ""
            out.print(f"  {o.name:10s} {o.cost:12.2f} {report.prices.currency}  = {o.arithmetic}{even}",
                      highlight=False, markup=False)
        if not d.options:
            out.print(f"  set prices under [capacity] in {report.prices_file} to compare renting, reserving "
                      f"and owning", highlight=False, markup=False)
    return 0
