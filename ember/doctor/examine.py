"""`ember doctor` as one library call: the experiments on a recipe (or a run's recipe), the
ranked causes, and the four figures a budget owner asks for, from the run when there is one.

--budget bounds the whole call: the clock starts when the caller says (the CLI: right after
parsing its arguments), so loading the model and preparing the job count against it."""

from __future__ import annotations

import json
import math
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ember.doctor.diagnose import Figures, Finding, Skipped, diagnose
from ember.durable import write_durable
from ember.errors import EmberError
from ember.runfolder import is_run_folder, read_record
from ember.events import Events
from ember.recipe import Recipe, build_recipe, load_recipe

if TYPE_CHECKING:
    from ember.metrics.report import RunReport

# Kept from the budget for what follows the experiments: ranking, output, and the interpreter's
# exit, which takes 1.2 s with torch and transformers loaded on a busy 2-core machine.
RESERVE_SECONDS = 1.5
PLOT_SECONDS = 2.0  # and for the PNG: matplotlib's import and drawing, 1.4 s there
DOCTOR_FILE = "doctor.json"  # in a run folder: its newest diagnosis


@dataclass
class Headline:
    source: str
    tokens_per_second_per_device: float
    mfu: float | None
    step_p50: float
    step_p99: float
    goodput: float | None


@dataclass
class DoctorReport:
    headline: Headline
    findings: list[Finding]
    figures: Figures
    run_cost: float | None
    skipped: list[Skipped] = field(default_factory=list)  # experiments not run (or cut short), and why
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0  # from the budget's clock start to the report


def examine(target: Path, budget: float, ddp: int, overrides: list[str], ledger: Path | None,
            events: Events, plots: Path | None = None, started: float | None = None,
            startup: float = 0.0) -> DoctorReport:
    """Run the doctor's experiments on `target` (a run folder or a recipe file) and rank the
    causes, all within `budget` seconds of `started` (time.monotonic(); default now).
    `startup`: seconds the calling process took to get to `started` (interpreter, imports): a
    fresh process, such as a DDP worker's, takes them again."""
    started = time.monotonic() if started is None else started
    if not 0 < budget < math.inf:  # nan too: it compares false with everything
        raise EmberError(f"--budget {budget:g}: must be a finite number of seconds > 0")
    if ddp < 1:
        raise EmberError(f"--ddp {ddp}: must be >= 1")
    if not target.exists():
        raise EmberError(f"{target}: no such run folder or recipe")
    if target.is_dir() and not is_run_folder(target):
        raise EmberError(f"{target}: not a run folder (no run.json); give a run folder or a recipe")
    if target.is_dir() and overrides:
        raise EmberError("--set applies to a recipe file, not to a run folder's recipe")
    r = load_recipe(target, overrides) if target.is_file() else None
    if plots is not None:  # made now, not after the whole budget is spent
        try:
            plots.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise EmberError(f"--plots {plots}: not a folder ember can write doctor.png into ({e}); "
                             f"give a folder") from None
    # Only now torch and the rest (seconds on a busy machine): a mistyped argument fails at once.
    from ember.doctor.experiments.budget import Budget
    from ember.doctor.experiments.runner import run_all
    from ember.ledger import database as ledger_store
    from ember.ledger.history import mtbf_seconds
    from ember.metrics.report import build_report
    run_report = None
    con = ledger_store.connect_or_warn(ledger, events.warn)
    if r is None:
        run_report = build_report(target, con)
        record = read_record(target)
        r = build_recipe(record["recipe"], f"{target}/run.json")
    # This machine's interruptions, as `ember plan` and the loop's every_seconds = "auto" count them.
    mtbf = mtbf_seconds(r.checkpoint.interruption_hours, con, socket.gethostname())
    clock = Budget(budget, started, RESERVE_SECONDS + (PLOT_SECONDS if plots is not None else 0.0), startup)
    figures, skipped = run_all(r, clock, ddp, events, mtbf.seconds)
    for s in skipped:
        events.info(f"doctor: skipped {s.experiment}: {s.reason}")
    findings = diagnose(figures)
    cost = _run_cost(r, run_report)
    for x in findings:
        x.saving_cost = x.saving_share * cost if cost else None
    out = DoctorReport(headline(figures, run_report), findings, figures, cost, skipped)
    if plots is not None:
        from ember.doctor.figure import plot
        out.plots = [str(p) for p in plot(figures, findings, plots)]
    out.seconds = time.monotonic() - started
    if run_report is not None:  # the run's page shows the newest diagnosis
        save_diagnosis(target, out)
    return out


def save_diagnosis(run: Path, report: DoctorReport) -> None:
    """Keep `report` as the run folder's newest diagnosis (OUT/doctor.json, replaced durably)."""
    write_durable(run / DOCTOR_FILE, json.dumps(asdict(report), indent=1, default=str))


def saved_diagnosis(run: Path) -> dict | None:
    """The newest `ember doctor RUN` report of a run folder (DoctorReport as a dict), or None."""
    try:
        return json.loads((run / DOCTOR_FILE).read_text())
    except (OSError, ValueError):
        return None


def headline(f: Figures, report: RunReport | None) -> Headline:
    """The four figures: from the run if given, else from the doctor's baseline iterations."""
    if report is not None and report.throughput is not None and report.step_time is not None:
        return Headline(f"run {report.run.id}", report.throughput.tokens_per_second_per_device,
                        report.mfu.value if report.mfu else None, report.step_time.p50, report.step_time.p99,
                        report.goodput.goodput if report.goodput else None)
    b = f.baseline
    return Headline("the doctor's baseline (the real loop)", b.tokens_per_second, b.mfu, b.step_p50, b.step_p99, None)


def _run_cost(r: Recipe, report: RunReport | None) -> float | None:
    """What the whole run costs: the run's own figure, else the plan's prediction."""
    from ember.plan.planner import make_plan
    if report is not None and report.cost is not None and report.cost.total:
        return report.cost.total
    try:
        return make_plan(r).cost.total
    except EmberError:
        return None


__all__ = ["DoctorReport", "Finding", "Headline", "examine", "saved_diagnosis"]
