"""What each dashboard page shows, gathered by calling the library the commands call; the HTML
routes render it and the JSON routes return it. No arithmetic here: only which functions and which
arguments. Errors are the library's, by meaning (ember.errors); ember.web.error_responses answers them."""

from __future__ import annotations

import sqlite3
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.doctor.examine import saved_diagnosis
from ember.errors import BadInput, NotFound, Unavailable
from ember.hardware import Device, detect
from ember.ledger import job_rows as job_rows
from ember.ledger import database as ledger_store
from ember.metrics.capacity import CapacityReport, capacity_report
from ember.metrics.compare import Comparison, compare_folders
from ember.metrics.listing import RunEntry, run_folder, run_table
from ember.metrics.report import RunReport, build_report
from ember.runfolder import read_record
from ember.metrics.series import CURVE_FIELDS, Curves, curves
from ember.recipe import to_toml
from ember.sched.plan_child import plan_json
from ember.sched.service import JobView, Service


REPORTS_KEPT = 8
PLANS_KEPT = 64  # plans remembered (a few kB each; every `?device_memory=` asked is another)


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class RunPage:
    report: RunReport
    record: dict[str, Any]                 # run.json: the recipe, the manifest, the data fingerprint
    diagnosis: dict[str, Any] | None       # the newest `ember doctor RUN`, when there is one
    comparison: Comparison | None = None
    compare_with: str | None = None
    others: list[RunEntry] = field(default_factory=list)  # runs to compare with


@dataclass
class MachinePage:
    devices: list[Device]
    cores: int
    ram_total: int
    capacity: CapacityReport
    service: bool                          # whether these are the running service's devices


@dataclass
class QueuePage:
    jobs: list[JobView]
    yielding: bool                         # an `ember yield` holds all training now
    owner_notes: list[str] = field(default_factory=list)  # owner.toml's error, changes waiting for a restart


class Views:
    """The library calls behind the pages, over one ledger (a read connection per thread)."""

    def __init__(self, ledger: Path | None, service: Service | None):
        self.ledger, self.service = ledger, service
        self.local = threading.local()
        self.plans: dict[tuple, dict] = {}
        self.plan_lock = threading.Lock()
        self.reports: dict[str, tuple[tuple, RunReport]] = {}
        self.lock = threading.Lock()

    def con(self) -> sqlite3.Connection:
        """This thread's connection to the ledger (opened once per server thread)."""
        con = getattr(self.local, "con", None)
        if con is None:
            con = self.local.con = ledger_store.connect(self.ledger)
        return con

    def folder(self, run_id: str) -> Path:
        return run_folder(self.con(), run_id)

    def runs(self, status: str | None, match: str | None, sort: str, descending: bool) -> list[RunEntry]:
        return run_table(self.con(), status, match, sort, descending)

    def report(self, run_id: str) -> RunReport:
        """`ember report` of the run; a finished run's is kept while its files and ledger rows stay
        as they are (a 100,000-step run takes seconds to read)."""
        folder, con = self.folder(run_id), self.con()
        key = (tuple(_stat(folder / name) for name in ("run.json", "metrics.jsonl", "metrics.lost.jsonl")),
               tuple(con.execute("SELECT count(*), total(end), total(last_seen), group_concat(outcome) FROM attempts "
                                 "WHERE run_id = ?", (run_id,)).fetchone()),
               con.execute("SELECT count(*) FROM events WHERE run_id = ?", (run_id,)).fetchone()[0],
               con.execute("SELECT count(*) FROM checkpoints WHERE run_id = ?", (run_id,)).fetchone()[0])
        with self.lock:
            kept = self.reports.get(run_id)
        if kept is not None and kept[0] == key:
            return kept[1]
        report = build_report(folder, con)
        if report.run.status != "running":  # a live run's figures move with the clock
            with self.lock:
                self.reports.pop(run_id, None)
                self.reports[run_id] = (key, report)
                while len(self.reports) > REPORTS_KEPT:
                    self.reports.pop(next(iter(self.reports)))
        return report

    def record(self, run_id: str) -> dict[str, Any]:
        return read_record(self.folder(run_id))

    def diagnosis(self, run_id: str) -> dict[str, Any] | None:
        return saved_diagnosis(self.folder(run_id))

    def curves(self, run_id: str, fields: str | None, start: float | None, end: float | None,
               buckets: int) -> Curves:
        names = tuple(f for f in (fields or ",".join(CURVE_FIELDS)).split(",") if f)
        return curves(self.folder(run_id), run_id, names, start, end, buckets)

    def compare(self, a: str, b: str, tolerance: float) -> Comparison:
        return compare_folders(self.folder(a), self.folder(b), tolerance)

    def run_page(self, run_id: str, compare_with: str | None) -> RunPage:
        page = RunPage(self.report(run_id), self.record(run_id), self.diagnosis(run_id))
        page.others = [e for e in self.runs(None, None, "created", True) if e.id != run_id]
        if compare_with:
            page.comparison, page.compare_with = self.compare(run_id, compare_with, 1e-3), compare_with
        return page

    def machine(self, since: str | None) -> MachinePage:
        m = self.service.machine if self.service is not None else detect(None)
        return MachinePage(list(m.devices), m.cores, m.ram_total, capacity_report(self.con(), since),
                           self.service is not None)

    def queue(self) -> QueuePage:
        if self.service is None:
            raise Unavailable("no service runs here: the queue is `ember serve`'s (this is `ember ui`)")
        return QueuePage(self.service.queue(), self.service.yield_until is not None,
                         self.service.rules_status.notes())

    def plan(self, run_id: str | None, job: str | None, device_memory: float | None,
             target_micro_batch: int | None) -> dict[str, Any]:
        """The plan (`ember plan --json`) of a run's recorded recipe or of a queued job's recipe."""
        if (run_id is None) == (job is None):
            raise BadInput("name one recipe to plan: ?run=RUN_ID or ?job=JOB")
        if run_id is not None:
            text = to_toml(self.record(run_id)["recipe"])
            overrides: list[str] = []
            key: tuple = ("run", text, device_memory, target_micro_batch)  # by content
        else:
            row = job_rows.find(self.con(), job)
            if row is None:
                raise NotFound(f"no job {job!r}; `ember queue` lists them")
            overrides = row.overrides
            try:  # by content: a recipe edited since the job was queued is planned again
                text = Path(row.recipe).read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise NotFound(f"job {job}: its recipe {row.recipe} cannot be read: {e}") from None
            key = ("job", row.recipe, text, tuple(overrides), device_memory, target_micro_batch)
        # Planning is a child process of ~175 MB for seconds: one at a time, once per recipe and
        # question, the newest PLANS_KEPT answers kept (each query string is a question of its own).
        with self.plan_lock:
            if key not in self.plans:
                with tempfile.TemporaryDirectory(prefix="ember-plan-") as tmp:
                    path = Path(tmp) / "recipe.toml" if run_id is not None else Path(row.recipe)
                    if run_id is not None:
                        path.write_text(text)
                    self.plans[key] = plan_json(path, overrides, self.ledger, device_memory, target_micro_batch)
                while len(self.plans) > PLANS_KEPT:
                    self.plans.pop(next(iter(self.plans)))  # the oldest asked
            return self.plans[key]
