"""The ledger: an embedded SQLite database of runs, attempts, events and checkpoints.

Default `$EMBER_HOME/ledger.db`, or `--ledger PATH`. WAL mode, so a reader never blocks the
writing run and two runs can write at once; every write is one short transaction. Schema
changes are forward migrations numbered in MIGRATIONS; a ledger written by a newer ember is
refused rather than touched.

Attempt outcomes, and who sets them (this module's functions, called by the training loop):

    (row inserted at process start, outcome NULL)
      --finish_attempt--> completed | interrupted | crashed
      --close_dead_attempts (next start of the same run)--> killed   (died without saying)
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.paths import ember_home

MIGRATIONS: list[str] = [
    # 1: the first schema
    """
    CREATE TABLE runs (
        id TEXT PRIMARY KEY, path TEXT NOT NULL, created REAL NOT NULL, name TEXT,
        recipe_digest TEXT, manifest TEXT, max_steps INTEGER
    );
    CREATE INDEX runs_path ON runs(path);
    CREATE TABLE attempts (
        run_id TEXT NOT NULL REFERENCES runs(id), attempt INTEGER NOT NULL, host TEXT, pid INTEGER,
        devices TEXT, start REAL NOT NULL, end REAL, last_seen REAL, outcome TEXT, detail TEXT,
        resumed_from INTEGER, PRIMARY KEY (run_id, attempt)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, attempt INTEGER NOT NULL, kind TEXT NOT NULL,
        start REAL NOT NULL, end REAL NOT NULL, step INTEGER, detail TEXT
    );
    CREATE INDEX events_run ON events(run_id, attempt);
    CREATE TABLE checkpoints (
        run_id TEXT NOT NULL, attempt INTEGER NOT NULL, step INTEGER NOT NULL, path TEXT,
        bytes INTEGER, blocked_seconds REAL, durable_seconds REAL, created REAL
    );
    CREATE TABLE summaries (run_id TEXT PRIMARY KEY, updated REAL NOT NULL, summary TEXT NOT NULL);
    """,
    # 2: where step time goes, per attempt (ember.train.breakdown)
    """
    CREATE TABLE step_phases (
        run_id TEXT NOT NULL, attempt INTEGER NOT NULL, phase TEXT NOT NULL, seconds REAL NOT NULL,
        up_to_step INTEGER NOT NULL, PRIMARY KEY (run_id, attempt, phase)
    );
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def default_path() -> Path:
    return ember_home() / "ledger.db"


def connect(path: Path | None = None) -> sqlite3.Connection:
    """Open (creating and migrating) the ledger; refuse one from a newer ember."""
    path = path or default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = sqlite3.connect(path, timeout=10.0, isolation_level=None)  # autocommit; explicit BEGIN
        con.execute("PRAGMA busy_timeout = 10000")
        con.execute("PRAGMA journal_mode = WAL")
        con.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable at checkpoints of the WAL
        con.row_factory = sqlite3.Row
        migrate(con, path)
    except sqlite3.DatabaseError as e:
        raise EmberError(f"ledger {path}: cannot be opened ({e}); move it aside or pass "
                         f"--ledger with another path") from None
    return con


def migrate(con: sqlite3.Connection, path: Path) -> None:
    con.execute("BEGIN IMMEDIATE")  # one migrator at a time
    try:
        con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = con.execute("SELECT version FROM schema_version").fetchone()
        version = row[0] if row else 0
        if version > SCHEMA_VERSION:
            raise EmberError(f"ledger {path}: schema version {version} is newer than this ember "
                             f"understands ({SCHEMA_VERSION}); upgrade ember or use another --ledger")
        for script in MIGRATIONS[version:]:
            for statement in filter(str.strip, script.split(";")):
                con.execute(statement)
        if row is None:
            con.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
        else:
            con.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


@dataclass
class AttemptRow:
    attempt: int
    start: float
    end: float | None
    last_seen: float | None
    outcome: str | None
    resumed_from: int | None
    host: str | None
    devices: str | None


class Ledger:
    """Writes for one run. Failures to write warn once and never stop the run."""

    def __init__(self, con: sqlite3.Connection, run_id: str, attempt: int, warn: Any):
        self.con, self.run_id, self.attempt, self.warn = con, run_id, attempt, warn
        self._warned = False

    def _write(self, sql: str, args: tuple) -> None:
        self.call(lambda con, _run_id: con.execute(sql, args))

    def call(self, fn: Any, *args: Any) -> None:
        """fn(con, run_id, *args), retried while the database is busy; warns once on failure."""
        for delay in (0.05, 0.2, 1.0, None):
            try:
                fn(self.con, self.run_id, *args)
                return
            except sqlite3.OperationalError as e:  # busy beyond the timeout, disk full, ...
                if delay is None:
                    if not self._warned:
                        self.warn(f"ledger write failed ({e}); the run goes on, its accounting "
                                  f"in the ledger may be incomplete")
                        self._warned = True
                    return
                time.sleep(delay)

    def event(self, kind: str, start: float, end: float, step: int | None = None,
              detail: dict | None = None) -> None:
        self._write("INSERT INTO events (run_id, attempt, kind, start, end, step, detail) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (self.run_id, self.attempt, kind, start, end, step, json.dumps(detail or {})))
        self.seen(end)

    def checkpoint(self, step: int, path: str, nbytes: int, blocked: float, durable: float) -> None:
        self._write("INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (self.run_id, self.attempt, step, path, nbytes, blocked, durable, time.time()))

    def seen(self, when: float) -> None:
        self._write("UPDATE attempts SET last_seen = max(coalesce(last_seen, 0), ?) "
                    "WHERE run_id = ? AND attempt = ?", (when, self.run_id, self.attempt))

    def finish(self, outcome: str, detail: str = "") -> None:
        now = time.time()
        self._write("UPDATE attempts SET end = ?, last_seen = ?, outcome = ?, detail = ? "
                    "WHERE run_id = ? AND attempt = ?",
                    (now, now, outcome, detail, self.run_id, self.attempt))

    def phases(self, totals: dict[str, float], step: int) -> None:
        """This attempt's seconds per step phase so far (replaced at each checkpoint and at exit)."""
        def write(con: sqlite3.Connection, run_id: str) -> None:
            con.executemany("INSERT OR REPLACE INTO step_phases VALUES (?, ?, ?, ?, ?)",
                            [(run_id, self.attempt, k, v, step) for k, v in totals.items()])
        self.call(write)

    def summary(self, summary: dict) -> None:
        self._write("INSERT OR REPLACE INTO summaries VALUES (?, ?, ?)",
                    (self.run_id, time.time(), json.dumps(summary)))

    def close(self) -> None:
        self.con.close()


class NullLedger:
    """Stands in when accounting is off (--no-ledger): every write is a no-op."""

    def event(self, *args: Any, **kwargs: Any) -> None: ...
    def checkpoint(self, *args: Any, **kwargs: Any) -> None: ...
    def seen(self, *args: Any) -> None: ...
    def finish(self, *args: Any) -> None: ...
    def summary(self, *args: Any) -> None: ...
    def phases(self, *args: Any) -> None: ...
    def close(self) -> None: ...


def register_run(con: sqlite3.Connection, run_id: str, path: Path, name: str, digest: str,
                 manifest: dict, max_steps: int) -> None:
    con.execute("INSERT INTO runs (id, path, created, name, recipe_digest, manifest, max_steps) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET path = excluded.path, "
                "recipe_digest = excluded.recipe_digest, manifest = excluded.manifest, "
                "max_steps = excluded.max_steps",
                (run_id, str(path.resolve()), time.time(), name, digest, json.dumps(manifest), max_steps))


def start_attempt(con: sqlite3.Connection, run_id: str, attempt: int, start: float, host: str,
                  pid: int, devices: str, resumed_from: int | None) -> None:
    con.execute("INSERT OR REPLACE INTO attempts (run_id, attempt, host, pid, devices, start, "
                "last_seen, resumed_from) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, attempt, host, pid, devices, start, start, resumed_from))


def close_dead_attempts(con: sqlite3.Connection, run_id: str, last_step_time: dict[int, float]) -> int:
    """Mark attempts that never said how they ended as killed, ending at their last sign of life."""
    rows = con.execute("SELECT attempt, last_seen, start FROM attempts WHERE run_id = ? AND "
                       "outcome IS NULL", (run_id,)).fetchall()
    for row in rows:
        end = max(row["last_seen"] or row["start"], last_step_time.get(row["attempt"], 0.0))
        con.execute("UPDATE attempts SET outcome = 'killed', end = ?, detail = ? WHERE run_id = ? "
                    "AND attempt = ?", (end, "died without saying (detected at the next start)",
                                        run_id, row["attempt"]))
    return len(rows)


def attempts(con: sqlite3.Connection, run_id: str) -> list[AttemptRow]:
    return [AttemptRow(r["attempt"], r["start"], r["end"], r["last_seen"], r["outcome"],
                       r["resumed_from"], r["host"], r["devices"])
            for r in con.execute("SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt", (run_id,))]


def events(con: sqlite3.Connection, run_id: str) -> list[sqlite3.Row]:
    return con.execute("SELECT * FROM events WHERE run_id = ? ORDER BY start", (run_id,)).fetchall()


def step_phases(con: sqlite3.Connection, run_id: str) -> dict[str, float]:
    """Seconds per step phase over all attempts of a run."""
    rows = con.execute("SELECT phase, sum(seconds) FROM step_phases WHERE run_id = ? GROUP BY phase",
                       (run_id,)).fetchall()
    return {phase: seconds for phase, seconds in rows}


def checkpoints(con: sqlite3.Connection, run_id: str) -> list[sqlite3.Row]:
    return con.execute("SELECT * FROM checkpoints WHERE run_id = ? ORDER BY step", (run_id,)).fetchall()


def find_run(con: sqlite3.Connection, ref: str) -> sqlite3.Row | None:
    """A run by id, id prefix, or folder path."""
    path = str(Path(ref).resolve())
    row = con.execute("SELECT * FROM runs WHERE id = ? OR path = ? ORDER BY created DESC",
                      (ref, path)).fetchone()
    if row is None:
        matches = con.execute("SELECT * FROM runs WHERE id LIKE ?", (ref + "%",)).fetchall()
        row = matches[0] if len(matches) == 1 else None
    return row


def all_runs(con: sqlite3.Connection) -> list[sqlite3.Row]:
    return con.execute("SELECT r.*, s.summary FROM runs r LEFT JOIN summaries s ON s.run_id = r.id "
                       "ORDER BY r.created").fetchall()
