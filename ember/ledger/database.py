"""The ledger: an embedded SQLite database of runs, attempts, events and checkpoints.

Default `$EMBER_HOME/ledger.db`, or `--ledger PATH`. WAL mode, so a reader never blocks the
writing run and two runs can write at once; every write is one short transaction. Schema
changes are forward migrations numbered in MIGRATIONS; a ledger written by a newer ember is
refused rather than touched.

Attempt outcomes, and who sets them (this module's functions, called by ember.launch):

    (row inserted at process start, outcome NULL)
      --Ledger.finish--> completed      reached max_steps
                       | interrupted    stopped on request (a signal), checkpointed first: exit 75
                       | failed         an error the user can fix (bad input, out of memory, ...)
                       | crashed        an unexpected exception
      --close_dead_attempts (next start of the same run)--> killed   (died without saying:
                         SIGKILL, the OOM killer, a power cut; the only outcome that counts as
                         an interruption of the machine, see ledger/mtbf.py)
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import EmberError
from ember.paths import home

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
    # 3: the service's jobs (ember.ledger.job_states declares their state machine) and their transitions
    """
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, recipe TEXT NOT NULL, out TEXT NOT NULL,
        overrides TEXT NOT NULL, priority INTEGER NOT NULL, state TEXT NOT NULL, hold TEXT,
        submitted REAL NOT NULL, updated REAL NOT NULL, started REAL, pid INTEGER, pid_start TEXT,
        devices TEXT, request TEXT NOT NULL, cause TEXT, preemptions INTEGER NOT NULL DEFAULT 0,
        pause TEXT
    );
    CREATE TABLE job_transitions (
        job_id INTEGER NOT NULL, time REAL NOT NULL, from_state TEXT, to_state TEXT NOT NULL, why TEXT
    );
    CREATE INDEX job_transitions_job ON job_transitions(job_id);
    """,
    # 4: interconnects `ember doctor --comm` measured (ember.ledger.comm_rows), for the advisor
    """
    CREATE TABLE interconnects (
        id INTEGER PRIMARY KEY, time REAL NOT NULL, hosts TEXT NOT NULL, ranks INTEGER NOT NULL,
        nodes INTEGER NOT NULL, backend TEXT NOT NULL, links TEXT NOT NULL, samples TEXT NOT NULL
    );
    """,
    # 5: the remote gate's audit log (ember.ledger.audit: append-only, hash-chained) and the remote
    # jobs (ember.ledger.job_states declares their state machine; SQL in ember.ledger.remote_rows)
    """
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY, time REAL NOT NULL, who TEXT NOT NULL, action TEXT NOT NULL,
        recipe TEXT NOT NULL, recipe_digest TEXT NOT NULL, target TEXT NOT NULL, datasets TEXT NOT NULL,
        limits TEXT NOT NULL, prediction TEXT NOT NULL, decision TEXT NOT NULL, reasons TEXT NOT NULL,
        prev_hash TEXT NOT NULL, hash TEXT NOT NULL
    );
    CREATE TRIGGER audit_append_only_update BEFORE UPDATE ON audit
        BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
    CREATE TRIGGER audit_append_only_delete BEFORE DELETE ON audit
        BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
    CREATE TABLE remote_jobs (
        id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, target TEXT NOT NULL, slurm_id TEXT,
        state TEXT NOT NULL, submitted REAL NOT NULL, updated REAL NOT NULL, audit_id INTEGER NOT NULL,
        audit_hash TEXT NOT NULL,
        host TEXT NOT NULL, ssh_options TEXT NOT NULL, python TEXT NOT NULL, recipe TEXT NOT NULL, out TEXT NOT NULL,
        remote_dir TEXT NOT NULL, limits TEXT NOT NULL,
        prediction TEXT NOT NULL, run_id TEXT, cost REAL, detail TEXT
    );
    CREATE TABLE remote_transitions (
        job_id INTEGER NOT NULL, time REAL NOT NULL, from_state TEXT, to_state TEXT NOT NULL, why TEXT
    );
    """,
    # 6: the service's job that started an attempt (ember.launchspec: the launch spec carries it)
    """
    ALTER TABLE attempts ADD COLUMN job INTEGER;
    """,
    # 7: remote jobs name their backend (ember.remote.backends); the id it gave the job is no
    # longer Slurm's by name. Every remote job before this one was Slurm's.
    """
    ALTER TABLE remote_jobs RENAME COLUMN slurm_id TO backend_id;
    ALTER TABLE remote_jobs ADD COLUMN backend TEXT NOT NULL DEFAULT 'slurm';
    """,
    # 8: a local job's own hold after each transition, and a hold set or lifted is a transition of
    # its own: ageing counts the time a job could have started (ember.ledger.job_rows.waited_seconds).
    # Transitions before this one read as unheld; a job held as it runs gets a row saying so, from
    # its last change (the hold's, as likely as not), so its hold stops its ageing from there.
    """
    ALTER TABLE job_transitions ADD COLUMN hold TEXT;
    INSERT INTO job_transitions SELECT id, updated, state, state, 'held (as the ledger was upgraded)', hold
        FROM jobs WHERE hold IS NOT NULL;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def default_path() -> Path:
    return home().ledger


def connect(path: Path | None = None, shared: bool = False) -> sqlite3.Connection:
    """Open (creating and migrating) the ledger; refuse one from a newer ember. The default
    ledger's folder ($EMBER_HOME) is created; a named ledger's folder must exist. `shared`: the
    connection may be used from several threads (the service serialises them with its lock)."""
    if path is None:
        path = default_path()
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not path.parent.is_dir():
        raise EmberError(f"ledger {path}: the folder {path.parent} does not exist; create it or "
                         f"pass another --ledger")
    try:
        con = sqlite3.connect(path, timeout=10.0, isolation_level=None,  # autocommit; explicit BEGIN
                              check_same_thread=not shared)
        con.execute("PRAGMA busy_timeout = 10000")
        con.execute("PRAGMA journal_mode = WAL")
        con.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable at checkpoints of the WAL
        con.row_factory = sqlite3.Row
        migrate(con, path)
    except sqlite3.DatabaseError as e:
        raise EmberError(f"ledger {path}: cannot be opened ({e}); move it aside or pass "
                         f"--ledger with another path") from None
    return con


def connect_or_warn(path: Path | None, warn: Any) -> sqlite3.Connection | None:
    """The ledger, or None after a warning when it cannot be opened: what only reads or
    accounts goes on without it."""
    try:
        return connect(path)
    except EmberError as e:
        warn(f"{e}; going on without the ledger")
        return None


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
            for statement in statements(script):
                con.execute(statement)
        if row is None:
            con.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
        else:
            con.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def statements(script: str) -> list[str]:
    """A migration's statements, split at the semicolons that end one (a trigger's body has its own)."""
    out, pending = [], ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                out.append(pending)
            pending = ""
    return out


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
    pid: int | None
    lost_steps: int = 0  # steps of this attempt computed again later: from the run folder (a report)


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

    def call(self, *args: Any) -> None: ...
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
                  pid: int, devices: str, resumed_from: int | None, job: int | None = None) -> None:
    """An attempt begins; `job`: the service's job that started it (ember serve), if any."""
    con.execute("INSERT OR REPLACE INTO attempts (run_id, attempt, host, pid, devices, start, "
                "last_seen, resumed_from, job) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, attempt, host, pid, devices, start, start, resumed_from, job))


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


def _attempt_row(r: sqlite3.Row) -> AttemptRow:
    return AttemptRow(r["attempt"], r["start"], r["end"], r["last_seen"], r["outcome"],
                      r["resumed_from"], r["host"], r["devices"], r["pid"])


def attempts(con: sqlite3.Connection, run_id: str) -> list[AttemptRow]:
    return [_attempt_row(r) for r in con.execute("SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt", (run_id,))]


def last_attempts(con: sqlite3.Connection) -> dict[str, AttemptRow]:
    """Every run's newest attempt, by run id, in one query."""
    return {r["run_id"]: _attempt_row(r) for r in con.execute(
        "SELECT a.* FROM attempts a JOIN (SELECT run_id, max(attempt) AS n FROM attempts GROUP BY run_id) m "
        "ON a.run_id = m.run_id AND a.attempt = m.n")}


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
    return con.execute("SELECT r.*, s.summary, s.updated AS summary_updated FROM runs r "
                       "LEFT JOIN summaries s ON s.run_id = r.id "
                       "ORDER BY r.created").fetchall()


def _runs_at(con: sqlite3.Connection, path: Path) -> list[str]:
    return [r[0] for r in con.execute("SELECT id FROM runs WHERE path = ? ORDER BY created",
                                      (str(path.resolve()),))]


def latest_run_at(con: sqlite3.Connection, path: Path) -> str | None:
    """The id of the newest run recorded in folder `path`, if any."""
    ids = _runs_at(con, path)
    return ids[-1] if ids else None


def run_attempt_outcomes(con: sqlite3.Connection, path: Path) -> list[str | None]:
    """The outcomes of the attempts of the run in folder `path`, oldest first."""
    ids = _runs_at(con, path)
    return [r[0] for i in ids for r in con.execute(
        "SELECT outcome FROM attempts WHERE run_id = ? ORDER BY attempt", (i,))]


def run_attempt_details(con: sqlite3.Connection, path: Path) -> list[str | None]:
    """What the attempts of the run in folder `path` said about how they ended, oldest first."""
    ids = _runs_at(con, path)
    return [r[0] for i in ids for r in con.execute(
        "SELECT detail FROM attempts WHERE run_id = ? AND outcome IN ('failed', 'crashed') ORDER BY attempt", (i,))]


def summary_for_path(con: sqlite3.Connection, path: Path) -> dict | None:
    """The stored summary of the newest run in folder `path`, if any."""
    for run_id in reversed(_runs_at(con, path)):
        row = con.execute("SELECT summary FROM summaries WHERE run_id = ?", (run_id,)).fetchone()
        if row:
            return json.loads(row[0])
    return None
