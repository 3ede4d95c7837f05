"""A run's accounting, assembled from its folder (metrics) and the ledger (attempts, events),
as typed records: `RunReport` for `ember report`, and the `RunSummary` stored for `ember runs`."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ember.ckpt.store import committed_in
from ember.errors import EmberError, NotFound
from ember.ledger import database as ledger_store
from ember.ledger.database import AttemptRow
from ember.ledger.goodput import Bucket, Event, EventKind, Goodput, Span, Step, account
from ember.metrics.cost import Prices, cost
from ember.metrics.flops import mfu, share_of_peak
from ember.metrics.rank_times import RanksSummary
from ember.metrics.heldout import generations
from ember.metrics.heldout import history as held_out_history
from ember.metrics.rank_times import load as load_ranks
from ember.metrics.machine import read_machine
from ember.metrics.stats import Histogram, Spread, Stall, histogram, spread, stalls
from ember.runfolder import read_metrics, read_record


@dataclass
class RunInfo:
    id: str | None
    path: str
    status: str           # completed | interrupted | failed | crashed | killed | running | unknown
    steps: int            # optimizer steps that survived (after the newest checkpoint of a dead attempt: not)
    max_steps: int
    attempts: int | None
    created: float | None
    stopped_early: str | None = None  # why a completed run ended before max_steps ([eval] patience)


@dataclass
class LossInfo:
    first: float
    last: float


@dataclass
class Throughput:
    tokens_per_second: float
    tokens_per_second_per_device: float
    samples_per_second: float
    devices: int
    tokens: int


@dataclass
class Mfu:
    value: float | None
    formula: str | None
    flops_per_token: float | None
    peak_flops: float | None
    peak_source: str | None
    device: str | None
    reason: str | None = None  # why value is None
    beyond_peak: float | None = None  # the share computed, when above 1: the peak is wrong


@dataclass
class GoodputInfo:
    wall_seconds: float
    goodput: float
    buckets: dict[str, float]
    lost_steps: int


@dataclass
class Badput:
    bucket: str
    seconds: float
    share: float
    evidence: str


@dataclass
class CostInfo:
    total: float | None
    per_million_tokens: float | None
    currency: str
    formula: str
    completed: bool


@dataclass
class DataInfo:
    """What the training data holds to learn (run.json's data notes, ember.data.truncation)."""
    format: str
    records: int
    learned: int               # learned tokens per epoch, after truncation and packing
    before: int                # learned tokens of the whole records
    cut: int | None            # records that lost some of theirs
    emptied: int | None        # records that lost all of theirs
    seq_len: int
    long_records: str
    warnings: list[str] = field(default_factory=list)

    def text(self) -> str:
        lost = f"; {self.cut} records lost some of their learned tokens, {self.emptied} all" if self.cut else ""
        return (f"data: {self.records} {self.format} records, {self.learned:,} tokens learned per epoch at seq_len "
                f"{self.seq_len} (of {self.before:,}; long_records = {self.long_records}){lost}")


@dataclass
class RunReport:
    run: RunInfo
    loss: LossInfo | None
    notes: list[str]
    throughput: Throughput | None = None
    mfu: Mfu | None = None
    step_time: Spread | None = None
    stalls: list[Stall] = field(default_factory=list)
    goodput: GoodputInfo | None = None
    where_time_goes: list[Badput] = field(default_factory=list)
    cost: CostInfo | None = None
    attempts: list[AttemptRow] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    ranks: RanksSummary | None = None  # a distributed run's ranks, as of its last attempt's end
    held_out: list[dict[str, Any]] = field(default_factory=list)  # step, loss, perplexity, tokens per evaluation
    generations: list[dict[str, Any]] = field(default_factory=list)  # the newest evaluation's, of [eval] prompts
    step_histogram: Histogram | None = None  # the surviving steps' times, 40 bins
    data: DataInfo | None = None  # what the data holds to learn (runs since it was recorded)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunSummary:
    """The few figures `ember runs` shows, stored in the ledger at the end of every attempt."""
    status: str
    steps: int
    max_steps: int
    tokens_per_second_per_device: float | None = None
    mfu: float | None = None
    goodput: float | None = None
    wall_seconds: float | None = None
    cost: float | None = None
    currency: str | None = None
    p50: float | None = None
    p99: float | None = None
    buckets: dict[str, float] | None = None  # goodput's buckets, seconds (absent in older ledgers)



def resolve_run(ref: str, con: sqlite3.Connection | None) -> Path:
    """A run folder from a path or a ledger run id."""
    if Path(ref).exists():
        return Path(ref)
    if con is not None:
        row = ledger_store.find_run(con, ref)
        if row is not None:
            return Path(row["path"])
    raise NotFound(f"{ref}: neither a run folder nor a run id in the ledger; `ember runs` lists them")


def pid_alive(pid: int | None, host: str | None) -> bool:
    """Whether process `pid` on `host` still runs (only this host's processes can be asked)."""
    if not pid or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build_report(run_path: Path, con: sqlite3.Connection | None) -> RunReport:
    """Everything `ember report` shows."""
    record = read_record(run_path)
    notes: list[str] = []
    kept = read_metrics(run_path / "metrics.jsonl", notes)
    lost = read_metrics(run_path / "metrics.lost.jsonl", notes)
    recipe = record["recipe"]
    perf = record.get("performance", {})
    rows = ledger_store.attempts(con, record["id"]) if con is not None and "id" in record else []
    events = ledger_store.events(con, record["id"]) if rows else []

    status, spans = attempt_spans(rows, kept + lost)
    # Steps after the newest checkpoint of an attempt that died are lost too, once resumed.
    newest = max((step for step, _ in committed_in(run_path / "checkpoints")), default=0)
    pending = status in ("killed", "crashed", "failed")
    steps = [Step(r["attempt"], r["step"], r["step_seconds"], r["data_wait_seconds"],
                  lost=pending and r["step"] > newest) for r in kept]
    steps += [Step(r["attempt"], r["step"], r["step_seconds"], r["data_wait_seconds"], True) for r in lost]
    good = [r for r in kept if not (pending and r["step"] > newest)]
    # A step with no learned token has no loss, and no tokens/s or MFU to average in as 0.
    learned = [r for r in good if r["tokens"]]

    report = RunReport(
        run=RunInfo(record.get("id"), str(run_path), status, good[-1]["step"] if good else 0,
                    recipe["train"]["max_steps"], len(rows) or None, record.get("created"),
                    record.get("stopped_early")),
        loss=LossInfo(learned[0]["loss"], learned[-1]["loss"]) if learned else None,
        notes=notes, ranks=load_ranks(run_path), data=data_info(record),
        held_out=[{k: e[k] for k in ("step", "loss", "perplexity", "tokens")} for e in held_out_history(run_path)
                  if not good or e["step"] <= good[-1]["step"]],
        generations=generations(run_path, good[-1]["step"] if good else None))
    devices = perf.get("devices", 1)
    report.throughput = _throughput(learned, devices, recipe["data"]["seq_len"])
    if good:
        report.mfu = _mfu(perf, report.throughput.tokens_per_second_per_device if report.throughput else None)
        _add_step_times(report, good, rows, events)
    if spans:
        # Only this run's attempts: a copied folder's metrics carry the original run's steps too.
        known = {a.attempt for a in rows}
        steps = [s for s in steps if s.attempt in known]
        g = account(spans, [Event(e["attempt"], e["kind"], e["start"], e["end"], e["step"]) for e in events], steps)
        report.goodput = GoodputInfo(g.wall_seconds, g.goodput, g.buckets, sum(1 for s in steps if s.lost))
        report.where_time_goes = _ranked(g, steps, events)
        c = cost(prices_from(recipe.get("cost", {}), devices), g.wall_seconds,
                 report.throughput.tokens if report.throughput else 0)
        report.cost = CostInfo(c.total, c.per_million_tokens, c.currency, c.formula, status == "completed")
        report.attempts = [replace(a, lost_steps=sum(1 for s in steps if s.lost and s.attempt == a.attempt))
                           for a in rows]
    else:
        notes.append("no attempts of this run in the ledger (run with --no-ledger, or another "
                     "--ledger): goodput and cost need them")
    if con is not None and "id" in record:
        report.checkpoints = [dict(r) for r in ledger_store.checkpoints(con, record["id"])]
    return report


def _throughput(learned: list[dict[str, Any]], devices: int, seq_len: int) -> Throughput | None:
    """Tokens and sequences per second over the steps that learned a token, less the seconds
    they spent compiling (None: no such step)."""
    if not learned:
        return None
    seconds = max(sum(r["step_seconds"] - r.get("compile_seconds", 0.0) for r in learned), 1e-9)
    tokens = sum(r["tokens"] for r in learned)
    return Throughput(tokens / seconds, tokens / seconds / devices, tokens / seq_len / seconds, devices, tokens)


def _add_step_times(report: RunReport, good: list[dict[str, Any]], rows: list[AttemptRow],
                    events: list[sqlite3.Row]) -> None:
    """The step-time spread, its histogram and the stalls of the surviving steps, each stall with
    what coincided (an attempt's first step, a checkpoint just before it)."""
    sp = spread([r["step_seconds"] for r in good])
    first_steps = {a.resumed_from + 1 if a.resumed_from is not None else 1 for a in rows} or {1}
    ck_steps = {e["step"] for e in events if e["kind"] == "checkpoint" and e["step"] is not None}
    report.step_time = sp
    report.step_histogram = histogram([r["step_seconds"] for r in good])
    report.stalls = stalls(good, sp.p50, ck_steps, first_steps)


def data_info(record: dict[str, Any]) -> DataInfo | None:
    """The data notes of run.json, where the run recorded what its data holds to learn."""
    d = record.get("data", {})
    if "learning" not in d:
        return None
    x = d["learning"]
    return DataInfo(d.get("format", "text"), x["records"], x["learned"], x["before"], x["cut"], x["emptied"],
                    x["seq_len"], d.get("long_records", x["rule"]), d.get("warnings", []))


def attempt_spans(rows: list[AttemptRow], records: list[dict[str, Any]]) -> tuple[str, list[Span]]:
    """The run's status and each attempt's wall-clock span: to its end; to now while its process
    runs here; else to its last sign of life (the ledger's, or its last step in `records`)."""
    status, spans = "unknown", []
    for a in rows:
        alive = a.outcome is None and pid_alive(a.pid, a.host)
        end = a.end or (time.time() if alive else max(a.last_seen or a.start, _last_time(records, a.attempt)))
        spans.append(Span(a.attempt, a.start, end))
        status = a.outcome or ("running" if alive else "killed")
    return status, spans


def goodput_so_far(con: sqlite3.Connection, run_id: str, steps: list[Step]) -> Goodput | None:
    """The goodput up to now of a run whose last attempt runs here (None otherwise), from the
    ledger's attempts and events and the run's `steps` (surviving and lost; `account` only sums
    them, so one Step may carry an attempt's totals)."""
    rows = ledger_store.attempts(con, run_id)
    status, spans = attempt_spans(rows, [])
    if status != "running":
        return None
    known = {a.attempt for a in rows}  # a copied folder's metrics carry the original run's steps too
    events = [Event(e["attempt"], e["kind"], e["start"], e["end"], e["step"]) for e in ledger_store.events(con, run_id)]
    return account(spans, events, [s for s in steps if s.attempt in known])


def _last_time(records: list[dict[str, Any]], attempt: int) -> float:
    return max((r["time"] for r in records if r.get("attempt") == attempt), default=0.0)


def _mfu(perf: dict[str, Any], per_device: float | None) -> Mfu:
    """MFU at `per_device` tokens/s (None: no step learned a token, so there is no figure); a
    share above the peak is never a figure either, and says why."""
    fpt, peak, source = perf.get("flops_per_token"), perf.get("peak_flops"), perf.get("peak_source")
    value = mfu(per_device, fpt, peak) if fpt and per_device is not None else None
    share = share_of_peak(per_device, fpt, peak) if fpt and per_device is not None else None
    beyond = share if value is None and share is not None else None
    if beyond is not None:  # never a figure: a share above the peak cannot be true
        reason = (f"the run achieved {beyond:.3g}x the peak of {peak / 1e12:.4g} TFLOP/s ({source}), "
                  f"which cannot be: that peak is too low; set [cost] peak_tflops to the device's")
    elif per_device is None:
        reason = "no step learned a token"
    else:
        reason = None if value is not None else source or "no performance record"
    return Mfu(value, perf.get("flops_formula"), fpt, peak, source, perf.get("device_name"), reason, beyond)


def prices_from(cfg: dict[str, Any], devices: int) -> Prices:
    """Recipe [cost] over $EMBER_HOME/machine.toml [cost]; a 0 or '' in the recipe means unset."""
    machine = asdict(read_machine().cost)

    def pick(key: str, default: Any) -> Any:
        return cfg.get(key) or machine.get(key) or default
    return Prices(device_hour=float(pick("device_hour_price", 0.0)),
                  devices=int(pick("devices", devices)), watts=float(pick("watts", 0.0)),
                  energy_kwh=float(pick("energy_price_kwh", 0.0)), currency=pick("currency", "USD"))


def _ranked(g: Goodput, steps: list[Step], events: list[sqlite3.Row]) -> list[Badput]:
    """Badput buckets, largest first, each with the evidence behind it."""
    out = []
    for name, seconds in g.badput():
        if seconds <= 0:
            continue
        evidence = ""
        if name == Bucket.WASTED_PROGRESS:
            n = sum(1 for s in steps if s.lost)
            evidence = f"{n} steps computed after an attempt's last checkpoint, then again"
        elif name == Bucket.CHECKPOINT_SAVE:
            saves = [e["end"] - e["start"] for e in events if e["kind"] in (EventKind.CHECKPOINT, EventKind.FINAL_SAVE)
                     and '"flush"' not in (e["detail"] or "")]  # the exit-time wait is not a save
            evidence = f"{len(saves)} saves, median {statistics.median(saves):.3f}s blocking" if saves else ""
        elif name == Bucket.DATA_LOADING:
            waits = [s.data_wait for s in steps if not s.lost]
            evidence = f"median data wait {statistics.median(waits) * 1000:.2f} ms a step" if waits else ""
        elif name == Bucket.PROGRAM_STARTUP:
            starts = [e["end"] - e["start"] for e in events if e["kind"] == EventKind.STARTUP]
            evidence = f"{len(starts)} start-ups, {', '.join(f'{s:.1f}s' for s in starts)}"
        elif name == Bucket.COMPILE:
            spans = [e["end"] - e["start"] for e in events if e["kind"] == EventKind.COMPILE]
            evidence = f"{len(spans)} compiles (torch.compile), the longest {max(spans, default=0):.1f}s"
        elif name == Bucket.CHECKPOINT_RESTORE:
            evidence = f"{sum(1 for e in events if e['kind'] == EventKind.RESTORE)} restores"
        elif name == Bucket.OTHER:
            evidence = "shutdown, logging and time between steps not otherwise recorded"
        out.append(Badput(name, seconds, seconds / g.wall_seconds, evidence))
    return out


def summarize(report: RunReport) -> RunSummary:
    """The few figures `ember runs` shows, stored in the ledger's summaries."""
    t, m, g, c, st = report.throughput, report.mfu, report.goodput, report.cost, report.step_time
    return RunSummary(report.run.status, report.run.steps, report.run.max_steps,
                      t.tokens_per_second_per_device if t else None, m.value if m else None,
                      g.goodput if g else None, g.wall_seconds if g else None,
                      c.total if c else None, c.currency if c else None,
                      st.p50 if st else None, st.p99 if st else None, dict(g.buckets) if g else None)


def summary_line(report: RunReport) -> str:
    """The four figures a budget owner asks for, and the cost, on one line."""
    parts = []
    if t := report.throughput:
        parts.append(f"{t.tokens_per_second_per_device:,.0f} tokens/s per device")
    if m := report.mfu:
        parts.append(f"MFU {m.value:.1%} of {m.peak_flops / 1e12:.4g} TFLOP/s ({m.peak_source})"
                     if m.value is not None else f"MFU n/a ({m.reason})")
    if s := report.step_time:
        parts.append(f"step p50 {s.p50 * 1000:.1f} ms, p99 {s.p99 * 1000:.1f} ms")
    if g := report.goodput:
        parts.append(f"goodput {g.goodput:.1%} of {g.wall_seconds:.1f} s")
    if (c := report.cost) and c.total is not None:
        parts.append(f"cost {c.total:.4f} {c.currency}")
    return "; ".join(parts)


def stored_summary(row: sqlite3.Row, last: AttemptRow | None) -> RunSummary | None:
    """The summary stored for a ledger run (`all_runs`' row) if it was stored at the end of its
    `last` attempt; None if there is none or it is an earlier attempt's: the last one runs, died
    without an outcome (killed), or crashed (a crash stores no summary)."""
    if not row["summary"] or last is None or last.outcome is None or last.end is None:
        return None
    stored = RunSummary(**json.loads(row["summary"]))
    return stored if stored.status == last.outcome and row["summary_updated"] >= last.end else None


def run_summary(con: sqlite3.Connection, row: sqlite3.Row, last: AttemptRow | None) -> RunSummary | None:
    """A ledger run's figures (`all_runs`' row, its `last` attempt), as `ember runs`, `/metrics`
    and `ember capacity` count them: the summary stored at that attempt's end, or a fresh report
    where it stored none (see stored_summary); None where neither is there (the folder is gone)."""
    if (stored := stored_summary(row, last)) is not None:
        return stored
    try:
        return summarize(build_report(Path(row["path"]), con))
    except EmberError:
        return None


def list_runs(con: sqlite3.Connection) -> list[tuple[sqlite3.Row, RunSummary]]:
    """Every run in the ledger with its figures (run_summary); one whose folder is gone, what was
    stored for it, if anything."""
    out = []
    for row in ledger_store.all_runs(con):
        attempts = ledger_store.attempts(con, row["id"])
        summary = run_summary(con, row, attempts[-1] if attempts else None)
        if summary is None:
            summary = (RunSummary(**json.loads(row["summary"])) if row["summary"]
                       else RunSummary("folder missing", 0, row["max_steps"]))
        out.append((row, summary))
    return out
