"""`ember doctor RUN|RECIPE`: experiments, then a ranked, evidenced list of where step time goes."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ember.errors import EXIT_OK, EmberError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="experiments that find where step time goes, ranked with evidence",
                       description="Run short controlled experiments on a recipe (or a run's recipe): the "
                       "input pipeline alone, in-memory batches, a micro-batch sweep, one checkpoint, a "
                       "profile, and with --ddp N gradient synchronisation on and off; then rank the "
                       "causes by the step time their remedy would save.")
    p.add_argument("target", help="a run folder (its recipe and figures) or a TOML recipe")
    p.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                   help="total time for the experiments (default 60)")
    p.add_argument("--ddp", type=int, default=1, metavar="N",
                   help="also measure DDP with N processes over gloo on this machine")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plots", type=Path, metavar="DIR", help="write a PNG of the breakdown into DIR")
    p.add_argument("--ledger", type=Path, help="the ledger (default $EMBER_HOME/ledger.db)")


def cmd_doctor(args: argparse.Namespace) -> int:
    from ember.doctor.diagnose import diagnose
    from ember.doctor.experiments import run_all
    from ember.recipe import build_recipe, load_recipe
    if args.budget <= 0:
        raise EmberError(f"--budget {args.budget:g}: must be > 0 seconds")
    if args.ddp < 1:
        raise EmberError(f"--ddp {args.ddp}: must be >= 1")
    target = Path(args.target)
    run_report = None
    if target.is_dir():
        from ember.ledger import store as ledger_store
        from ember.metrics.report import build_report
        if not (target / "run.json").is_file():
            raise EmberError(f"{target}: not a run folder (no run.json); give a run folder or a recipe")
        con = ledger_store.connect(args.ledger)
        run_report = build_report(target, con)
        record = json.loads((target / "run.json").read_text())
        r = build_recipe(record["recipe"], f"{target}/run.json")
        if args.overrides:
            raise EmberError("--set applies to a recipe file, not to a run folder's recipe")
    elif target.is_file():
        r = load_recipe(target, args.overrides)
    else:
        raise EmberError(f"{target}: no such run folder or recipe")
    console = Console(stderr=True, soft_wrap=True)
    figures = run_all(r, args.budget, args.ddp, console)
    findings = diagnose(figures)
    headline = _headline(figures, run_report)
    cost = _run_cost(r, run_report)
    out = {"headline": headline, "findings": [asdict(x) | {"saving_cost": x.saving_share * cost if cost else None}
                                              for x in findings],
           "figures": figures, "run_cost": cost}
    if args.plots:
        out["plots"] = [str(p) for p in plot(figures, findings, args.plots)]
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        render(out, Console(soft_wrap=True))
    return EXIT_OK


def _headline(f: dict[str, Any], report: dict[str, Any] | None) -> dict[str, Any]:
    """The four figures a budget owner asks for: from the run if given, else from the experiment."""
    if report and report.get("throughput"):
        g = report.get("goodput") or {}
        return {"source": f"run {report['run']['id']}",
                "tokens_per_second_per_device": report["throughput"]["tokens_per_second_per_device"],
                "mfu": (report.get("mfu") or {}).get("mfu"), "step_p50": report["step_time"]["p50"],
                "step_p99": report["step_time"]["p99"], "goodput": g.get("goodput")}
    return {"source": "the doctor's baseline steps", "tokens_per_second_per_device": f["tokens_per_second"],
            "mfu": f["mfu"], "step_p50": f["step_p50"], "step_p99": f["step_p99"], "goodput": None}


def _run_cost(r: Any, report: dict[str, Any] | None) -> float | None:
    if report and (report.get("cost") or {}).get("total"):
        return report["cost"]["total"]
    from ember.plan.planner import make_plan
    try:
        return make_plan(r).cost["total"]
    except EmberError:
        return None


def render(out: dict[str, Any], con: Console) -> None:
    h = out["headline"]
    mfu = f"{h['mfu']:.1%}" if h["mfu"] is not None else "unknown"
    good = f"{h['goodput']:.1%}" if h["goodput"] is not None else "n/a (a recipe, not a run)"
    con.print(f"[bold]{h['tokens_per_second_per_device']:,.0f} tokens/s per device[/bold]; MFU {mfu}; "
              f"step p50 {h['step_p50'] * 1000:.1f} ms, p99 {h['step_p99'] * 1000:.1f} ms; goodput {good} "
              f"({h['source']})", highlight=False)
    f = out["figures"]
    ph = f["phases"]
    con.print("step breakdown (median): " + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in ph.items() if v > 0),
              highlight=False)
    t = Table(title="where the step time goes, ranked", title_justify="left")
    for col in ("", "cause", "saving / step", "share", "cost / run"):
        t.add_column(col)
    for i, x in enumerate(out["findings"], 1):
        cost = f"{x['saving_cost']:.4g}" if x["saving_cost"] else "-"
        t.add_row(str(i), x["cause"], f"{x['saving_seconds'] * 1000:.2f} ms" if x["cause"] != "compute-bound" else "-",
                  f"{x['saving_share']:.0%}", cost)
    con.print(t)
    for i, x in enumerate(out["findings"], 1):
        con.print(f"{i}. [bold]{x['cause']}[/bold]", highlight=False)
        for e in x["evidence"]:
            con.print(f"   evidence: {escape(e)}", highlight=False)
        con.print(f"   remedy: {escape(x['remedy'])}", highlight=False)
    for p in out.get("plots", []):
        con.print(f"plot: {p}", highlight=False)


def plot(f: dict[str, Any], findings: list[Any], folder: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    folder.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    phases = {k: v * 1000 for k, v in f["phases"].items() if v > 0}
    phases["checkpoint (per step)"] = f["checkpoint_seconds_per_step"] * 1000
    left = 0.0
    for name, ms in phases.items():
        a.barh(0, ms, left=left, label=name)
        left += ms
    a.set(yticks=[], xlabel="ms per step", title="step breakdown (median)")
    a.legend(fontsize=7, loc="upper right")
    causes = [x for x in findings if x.cause != "compute-bound"]
    b.barh([x.cause for x in causes], [x.saving_seconds * 1000 for x in causes], color="tab:orange")
    b.set(xlabel="ms per step saved by the remedy", title="estimated savings")
    fig.tight_layout()
    path = folder / "doctor.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
