"""A job as `ember queue`, the API and the queue page show it (`JobView`), why it does not train
now in words (`why_waiting`), and what the service reads of a job's run folder and of the
ledger's runs: its last step, whether it completed, how its last attempt ended, why it failed."""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from ember.metrics.series import finite
from ember.runfolder import completed as run_completed
from ember.ledger.database import run_attempt_details, run_attempt_outcomes, summary_for_path
from ember.ledger.job_rows import JobRow
from ember.ledger.job_states import LOCAL_FINAL as FINAL


@dataclass
class JobView:
    """A job as `ember queue` shows it."""
    id: int
    name: str
    state: str
    priority: int
    devices: list[int]
    step: int
    max_steps: int
    hold: str | None
    pause: str | None
    preemptions: int
    cause: str | None
    out: str
    goodput: float | None = None
    held_by: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # why it does not train now, in words
    log: str = ""                                      # its output (`ember logs`)
    run: str | None = None  # the ledger's id of the run in `out` (the dashboard's /runs/RUN); None before it trains


@dataclass(frozen=True)
class Inference:
    """Inference as a waiting job's explanation needs it."""
    device: int
    idle_gap_seconds: float  # the gap in use (ember.sched.inference.Gate.gap)
    idle_gap_rule: str = "fixed"  # how it was chosen: "fixed", "auto (40 periods)", ...


def why_waiting(j: JobRow, held_by: list[str], requested: str | None, inference: Inference,
                admission: str | None) -> list[str]:
    """Why job `j` does not train now: a hand's hold or pause, the owner's rules and yield
    (`held_by`), inference (`requested`: the soft pause asked of it), or what admission said
    (memory, priority, devices). Empty when it trains or has ended."""
    if j.state in FINAL or (j.state == "running" and j.pause is None and not held_by):
        return []
    why = []
    if j.hold == "user":
        why.append(f"held by hand (a hard pause): `ember resume {j.name}` lets it start again")
    elif j.hold == "cancel":
        why.append("being cancelled")
    elif j.hold == "interrupted":
        why.append(f"stopped by a signal from outside the service: `ember resume {j.name}` starts it again")
    if j.pause == "user":
        why.append(f"paused by hand (soft, the process kept): `ember resume {j.name}`")
    why += held_by
    if j.state == "soft-paused" and requested == "inference":
        how = "" if inference.idle_gap_rule == "fixed" else f"; idle gap {inference.idle_gap_rule}"
        why.append(f"inference requests on device {inference.device} (it resumes "
                   f"{inference.idle_gap_seconds:.3g} s after the last one{how})")
    if j.state == "queued" and j.hold is None and not held_by:
        why.append(admission or "waiting for the scheduler's next decision")
    return why


def completed(out: Path) -> bool:
    """Whether the run folder holds a completed run (ember.runfolder.completed)."""
    return run_completed(out) is not None


def _last_metrics(out: Path) -> dict:
    path = out / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            return record
    return {}


def last_step(out: Path) -> int:
    """The step of the run folder's last metrics line (0 before the first)."""
    return int(finite(_last_metrics(out).get("step")) or 0)  # another tool's line (a step named 'train') is no step


def last_step_time(out: Path) -> float:
    """When the run folder's last metrics line was written (0 before the first)."""
    return float(finite(_last_metrics(out).get("time")) or 0.0)


def last_outcome(con: sqlite3.Connection, out: Path) -> str | None:
    """How the ledger's last attempt of the run in `out` ended; None without one."""
    outcomes = run_attempt_outcomes(con, out)
    return outcomes[-1] if outcomes else None


def failure_cause(con: sqlite3.Connection, out: Path, log: Path, code: int) -> str:
    """Why a job failed: the ledger's last attempt detail, else the last line of its log."""
    details = [d for d in run_attempt_details(con, out) if d]
    if details:
        return details[-1]
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    errors = [x for x in lines if x.startswith("error:")]  # what `ember run` said, not its summary
    return errors[-1] if errors else lines[-1] if lines else f"exit {code}"


def run_goodput(con: sqlite3.Connection, out: str) -> float | None:
    """The goodput of the run in `out`, from the ledger's summary; None without one."""
    s = summary_for_path(con, Path(out))
    return s.get("goodput") if s else None
