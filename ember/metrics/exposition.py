"""Prometheus exposition of the ledger: what `/metrics` answers (prometheus-client's text format).

Everything is read at scrape time, from the ledger and the run folders, by `LedgerCollector`:

    ember_step_seconds{run}                       histogram of optimizer step times (metrics.jsonl)
    ember_tokens_per_second_per_device{run}       the run's figure as `ember runs` has it; a live
                                                  run's, over its current attempt's learned steps
    ember_mfu_ratio{run}                          model FLOPs utilisation (the same, where known)
    ember_goodput_ratio{run}                      productive share of the run's wall-clock (a live
                                                  run: so far, its running attempt up to now)
    ember_badput_seconds{run,bucket}              the wall-clock outside `productive`, by bucket
    ember_checkpoints_total{run}                  checkpoints committed
    ember_checkpoint_blocked_seconds_total{run}   seconds checkpoints held training up
    ember_checkpoint_durable_seconds_total{run}   seconds until they were durable
    ember_jobs{state}                             the service's jobs by state
    ember_job_preemptions_total                   jobs preempted (SIGTERM, checkpoint, exit 75)
    ember_pauses_total{cause}                     soft pauses by cause (inference, owner, user)
    ember_pause_seconds_total{cause}              their seconds

A scrape costs a few SQL queries and one stat() per run: step times are read incrementally,
only the bytes appended since the last scrape (`StepTimes`); a run whose last attempt stored no
summary (killed, crashed) costs one `ember report`, once, until it changes.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ember.errors import EmberError
from ember.ledger import database as ledger_store
from ember.ledger.database import AttemptRow
from ember.ledger.goodput import Bucket, Goodput, Step
from ember.metrics.flops import mfu
from ember.metrics.report import goodput_so_far, pid_alive, run_summary
from ember.metrics.series import read_records
from ember.runfolder import read_metrics, read_record

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Tail:
    """What one run's metrics.jsonl said so far."""
    inode: int = 0
    offset: int = 0
    counts: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    total: int = 0
    seconds: float = 0.0
    attempt: int | None = None        # the newest attempt seen; its learned tokens, and the seconds of the
    attempt_tokens: int = 0           # steps that learned them less their compile (tokens/s as `ember report`)
    attempt_seconds: float = 0.0
    by_attempt: dict[int, list[float]] = field(default_factory=dict)  # attempt -> [step seconds, data wait]


class StepTimes:
    """Step-time histograms of run folders, read incrementally across scrapes."""

    def __init__(self) -> None:
        self.tails: dict[str, Tail] = {}

    def read(self, run: Path) -> Tail:
        path = run / "metrics.jsonl"
        tail = self.tails.setdefault(str(run), Tail())
        try:
            st = os.stat(path)
        except OSError:
            return tail
        if st.st_ino != tail.inode or st.st_size < tail.offset:  # replaced or rewound: start again
            tail = self.tails[str(run)] = Tail(inode=st.st_ino)
        if st.st_size == tail.offset:
            return tail
        records, tail.offset = read_records(path, tail.offset)
        for r in records:
            s = r.get("step_seconds")
            if not isinstance(s, (int, float)):
                continue
            tail.total += 1
            tail.seconds += s
            for i, bound in enumerate(STEP_BUCKETS):
                if s <= bound:
                    tail.counts[i] += 1
            if r.get("attempt") != tail.attempt:
                tail.attempt, tail.attempt_tokens, tail.attempt_seconds = r.get("attempt"), 0, 0.0
            if r.get("tokens"):  # a step with no learned token, and a step's compile, are no tokens/s
                tail.attempt_tokens += r["tokens"]
                tail.attempt_seconds += s - r.get("compile_seconds", 0.0)
            sums = tail.by_attempt.setdefault(r.get("attempt"), [0.0, 0.0])
            sums[0] += s
            sums[1] += r.get("data_wait_seconds", 0.0)
        return tail


class LedgerCollector:
    """A prometheus-client collector over the ledger `connect()` opens (or keeps open for the
    calling thread; see the module docstring).
    `job_states`: every state a job can be in, so that each is exposed, 0 included."""

    def __init__(self, connect: Callable[[], sqlite3.Connection], job_states: tuple[str, ...] = ()):
        self.connect, self.job_states = connect, job_states
        self.steps = StepTimes()
        self.performance: dict[str, dict] = {}  # run folder -> run.json's performance record
        self.fresh: dict[str, tuple[tuple, dict]] = {}  # run -> (what it was made of, a fresh report's summary)

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; every family is made at scrape time

    def collect(self) -> Iterator[Metric]:
        yield from self._collect(self.connect())

    def _collect(self, con: sqlite3.Connection) -> Iterator[Metric]:
        step = HistogramMetricFamily("ember_step_seconds", "Optimizer step time of the run's surviving steps "
                                     "(metrics.jsonl).", labels=["run"])
        tps = GaugeMetricFamily("ember_tokens_per_second_per_device", "Learned tokens per second per device "
                                "(a live run: over its current attempt).", labels=["run"])
        util = GaugeMetricFamily("ember_mfu_ratio", "Model FLOPs utilisation, where the peak is known.",
                                 labels=["run"])
        good = GaugeMetricFamily("ember_goodput_ratio", "Productive share of the run's wall-clock.", labels=["run"])
        bad = GaugeMetricFamily("ember_badput_seconds", "Wall-clock outside productive steps, by goodput bucket.",
                                labels=["run", "bucket"])
        last = ledger_store.last_attempts(con)
        live = {run for run, a in last.items() if a.outcome is None and pid_alive(a.pid, a.host)}
        for row in ledger_store.all_runs(con):
            run, path = row["id"], Path(row["path"])
            tail = self.steps.read(path)
            if tail.total:
                cumulative = [(str(b), float(c)) for b, c in zip(STEP_BUCKETS, tail.counts)]
                step.add_metric([run], cumulative + [("+Inf", float(tail.total))], tail.seconds)
            summary = self._summary(con, row, last.get(run), tail) if run not in live else \
                json.loads(row["summary"]) if row["summary"] else {}
            per_device, ratio = summary.get("tokens_per_second_per_device"), summary.get("mfu")
            if run in live and tail.attempt_seconds > 0:
                perf = self._performance(path)
                per_device = tail.attempt_tokens / tail.attempt_seconds / perf.get("devices", 1)
                fpt = perf.get("flops_per_token")
                ratio = mfu(per_device, fpt, perf.get("peak_flops")) if fpt else None
            if per_device is not None:
                tps.add_metric([run], per_device)
            if ratio is not None:
                util.add_metric([run], ratio)
            goodput, buckets = summary.get("goodput"), summary.get("buckets") or {}
            if run in live and (so_far := self._goodput_so_far(con, run, path, tail)) is not None:
                goodput, buckets = so_far.goodput, so_far.buckets  # the stored summary is an earlier attempt's
            if goodput is not None:
                good.add_metric([run], goodput)
            for bucket, seconds in buckets.items():
                if bucket != Bucket.PRODUCTIVE:
                    bad.add_metric([run, bucket], seconds)
        yield from (step, tps, util, good, bad)
        yield from self._checkpoints(con)
        yield from self._service(con)

    def _summary(self, con: sqlite3.Connection, row: sqlite3.Row, last: AttemptRow | None, tail: Tail) -> dict:
        """A run's figures as `ember runs` has them (report.run_summary), kept until the run changes;
        where its folder is gone, what was stored, if anything."""
        key = (last, row["summary_updated"], tail.inode, tail.offset)
        cached = self.fresh.get(row["id"])
        if cached is None or cached[0] != key:
            summary = run_summary(con, row, last)
            cached = key, asdict(summary) if summary is not None else json.loads(row["summary"]) if row["summary"] else {}
            self.fresh[row["id"]] = cached
        return cached[1]

    def _goodput_so_far(self, con: sqlite3.Connection, run_id: str, run: Path, tail: Tail) -> Goodput | None:
        """A live run's goodput up to now: its surviving steps' sums from `tail`, and the steps
        computed again after a resume (metrics.lost.jsonl, small: read whole)."""
        steps = [Step(attempt, 0, seconds, wait, False) for attempt, (seconds, wait) in tail.by_attempt.items()]
        try:
            lost = read_metrics(run / "metrics.lost.jsonl")
        except EmberError:
            return None  # a damaged log: no live goodput here; `ember report` names the line
        steps += [Step(r["attempt"], r["step"], r["step_seconds"], r["data_wait_seconds"], True) for r in lost]
        return goodput_so_far(con, run_id, steps)

    def _performance(self, run: Path) -> dict:
        if str(run) not in self.performance:
            try:
                self.performance[str(run)] = read_record(run).get("performance", {})
            except EmberError:
                return {}
        return self.performance[str(run)]

    def _checkpoints(self, con: sqlite3.Connection) -> Iterator[Metric]:
        n = CounterMetricFamily("ember_checkpoints", "Checkpoints committed.", labels=["run"])
        blocked = CounterMetricFamily("ember_checkpoint_blocked_seconds", "Seconds checkpoints held training up.",
                                      labels=["run"])
        durable = CounterMetricFamily("ember_checkpoint_durable_seconds", "Seconds from a checkpoint's start "
                                      "until it was durable.", labels=["run"])
        for run, count, b, d in con.execute("SELECT run_id, count(*), total(blocked_seconds), "
                                            "total(durable_seconds) FROM checkpoints GROUP BY run_id"):
            n.add_metric([run], count)
            blocked.add_metric([run], b)
            durable.add_metric([run], d)
        yield from (n, blocked, durable)

    def _service(self, con: sqlite3.Connection) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("ember_jobs", "The service's jobs by state.", labels=["state"])
        counts = dict.fromkeys(self.job_states, 0)
        counts.update(dict(con.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()))
        for state, count in counts.items():
            jobs.add_metric([state], count)
        pre = CounterMetricFamily("ember_job_preemptions", "Jobs preempted: checkpointed and stopped to make room "
                                  "or on request.")
        pre.add_metric([], con.execute("SELECT total(preemptions) FROM jobs").fetchone()[0])
        pauses = CounterMetricFamily("ember_pauses", "Soft pauses of training, by cause.", labels=["cause"])
        paused = CounterMetricFamily("ember_pause_seconds", "Seconds training was soft-paused, by cause.",
                                     labels=["cause"])
        rows = con.execute("SELECT coalesce(json_extract(detail, '$.reason'), "
                           "CASE kind WHEN 'pause_inference' THEN 'inference' ELSE 'owner or user' END), "
                           "count(*), total(end - start) FROM events WHERE kind IN ('pause', 'pause_inference') "
                           "GROUP BY 1").fetchall()
        for cause, count, seconds in rows:
            pauses.add_metric([cause], count)
            paused.add_metric([cause], seconds)
        yield from (jobs, pre, pauses, paused)
