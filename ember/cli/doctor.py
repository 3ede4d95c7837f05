"""`ember doctor RUN|RECIPE`: experiments, then a ranked, evidenced list of where step time goes."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ember.cli.render import stderr_events
from ember.errors import EXIT_OK, EmberError
from ember.proc import process_start_time


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="experiments that find where step time goes, ranked with evidence",
                       description="Run short controlled experiments on a recipe (or a run's recipe), each "
                       "changing one thing, its two sides interleaved: the real training loop as written "
                       "against it without checkpoints, the step on the input pipeline against in-memory "
                       "batches, the recipe's threads against fewer when other processes take the cores, "
                       "a micro-batch sweep, a profile, and with --ddp N gradient synchronisation on and "
                       "off. Then rank the causes by the step time their remedy would save, counting only "
                       "differences larger than the measurements' noise.")
    p.add_argument("target", nargs="?", help="a run folder (its recipe and figures) or a TOML recipe")
    p.add_argument("--comm", action="store_true",
                   help="instead: measure the interconnect between --nproc ranks here (or --nnodes nodes), "
                   "all-reduce, all-gather and reduce-scatter from 4 KiB to 16 MiB, and store it in the "
                   "ledger for `ember plan`'s parallelism advice")
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="--comm: ranks on this node (default 2)")
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="--comm: nodes taking part")
    p.add_argument("--node-rank", type=int, default=0, metavar="K", help="--comm: this node's number")
    p.add_argument("--rdzv", default="", metavar="HOST:PORT", help="--comm: node 0's address and a free port")
    p.add_argument("--device", default="auto", help="--comm: 'auto' (the accelerator, else CPU) or 'cpu'")
    p.add_argument("--comm-rank", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                   help="bound on the whole command's time after argument parsing, model load included: "
                   "experiments that would not fit are shortened or skipped, and listed (default 60)")
    p.add_argument("--ddp", type=int, default=1, metavar="N",
                   help="also measure DDP with N processes over gloo on this machine")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plots", type=Path, metavar="DIR", help="write a PNG of the breakdown into DIR")
    p.add_argument("--ledger", type=Path, help="the ledger (default $EMBER_HOME/ledger.db)")


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.comm_rank is not None:  # one of the ranks --comm started
        from ember.doctor.comm import rank_main
        return rank_main(args.comm_rank, args.device)
    if args.comm:
        return cmd_comm(args)
    if args.target is None:
        raise EmberError("ember doctor: name a recipe or run folder, or pass --comm to measure the interconnect")
    started = time.monotonic()  # --budget counts from here: imports, model load and all
    startup = max(0.0, time.time() - process_start_time())  # the interpreter and the CLI, so far
    from ember.doctor.examine import examine
    events = stderr_events()
    report = examine(Path(args.target), args.budget, args.ddp, args.overrides, args.ledger, events, args.plots,
                     started, startup)
    if args.json:
        print(json.dumps(asdict(report), indent=1, default=str))
    else:
        render(report, Console(soft_wrap=True))
    return EXIT_OK


def cmd_comm(args: argparse.Namespace) -> int:
    import tempfile

    from ember.doctor.comm import measure
    from ember.ledger import comm_rows as comm, database as store
    from ember.ranks import Topology
    topology = Topology(args.nproc, args.nnodes, args.node_rank, args.rdzv)
    topology.check()
    with tempfile.TemporaryDirectory(prefix="ember-comm-") as scratch:
        row = measure(topology, args.device, stderr_events(), Path(scratch))
    if row is None:
        Console(stderr=True).print("this node's ranks are done; node 0 records the measurement")
        return EXIT_OK
    comm.record(store.connect(args.ledger), row)
    if args.json:
        print(json.dumps(asdict(row), indent=1))
        return EXIT_OK
    con = Console(soft_wrap=True)
    con.print(f"[bold]{row.backend}, {row.ranks} ranks on {row.nodes} node(s)[/bold] "
              f"({', '.join(row.hosts)}); recorded in the ledger for `ember plan`")
    t = Table("collective", *[_size(int(s)) for s in next(iter(row.samples.values()))], "latency/hop", "bandwidth")
    for kind, by_size in row.samples.items():
        link = row.links[kind]
        t.add_row(kind.replace("_", "-"), *[f"{v * 1e3:.3g} ms" for v in by_size.values()],
                  f"{link['latency'] * 1e6:.0f} µs", f"{link['bandwidth'] / 1e6:,.0f} MB/s")
    con.print(t)
    return EXIT_OK


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def render(report: Any, con: Console) -> None:
    h = report.headline
    mfu = f"{h.mfu:.1%}" if h.mfu is not None else "unknown"
    good = f"{h.goodput:.1%}" if h.goodput is not None else "n/a (a recipe, not a run)"
    con.print(f"[bold]{h.tokens_per_second_per_device:,.0f} tokens/s per device[/bold]; MFU {mfu}; "
              f"step p50 {h.step_p50 * 1000:.1f} ms, p99 {h.step_p99 * 1000:.1f} ms; goodput {good} "
              f"({escape(h.source)})", highlight=False)
    b = report.figures.baseline
    con.print(f"the real loop's step, {b.step_seconds * 1000:.2f} ms (mean of {len(b.iterations)} iterations): "
              + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in b.phases.items() if v > 0), highlight=False)
    t = Table(title="where the step time goes, ranked", title_justify="left")
    for col in ("", "cause", "saving / step", "share", "cost / run"):
        t.add_column(col)
    for i, x in enumerate(report.findings, 1):
        cost = f"{x.saving_cost:.4g}" if x.saving_cost else "-"
        saving = f"{x.saving_seconds * 1000:.2f} ms" if x.cause != "compute-bound" else "-"
        t.add_row(str(i), x.cause, saving, f"{max(0.0, x.saving_share):.0%}", cost)
    con.print(t)
    for i, x in enumerate(report.findings, 1):
        con.print(f"{i}. [bold]{x.cause}[/bold]", highlight=False)
        for e in x.evidence:
            con.print(f"   evidence: {escape(e)}", highlight=False)
        con.print(f"   remedy: {escape(x.remedy)}", highlight=False)
        if x.changes:
            con.print("   changes: " + escape(", ".join(f"{k} = {json.dumps(v)}" for k, v in x.changes.items()))
                      + f"; predicted step {x.predicted_step_seconds * 1000:.2f} ms", highlight=False)
    for s in report.skipped:
        con.print(f"skipped {escape(s.experiment)}: {escape(s.reason)}", highlight=False)
    for p in report.plots:
        con.print(f"plot: {escape(p)}", highlight=False)
    con.print(f"doctor: {report.seconds:.1f} s of the --budget", highlight=False)
