"""The SQLite ledger: migrations, refusal of a newer schema, dead attempts, concurrent writers."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from ember.errors import EmberError
from ember.ledger import database as store


def test_fresh_ledger_is_at_the_current_schema_in_wal_mode(tmp_path):
    con = store.connect(tmp_path / "l.db")
    assert con.execute("SELECT version FROM schema_version").fetchone()[0] == store.SCHEMA_VERSION
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.connect(tmp_path / "l.db")  # reopening migrates nothing and fails nothing


def test_a_ledger_from_a_newer_ember_is_refused_untouched(tmp_path):
    path = tmp_path / "l.db"
    con = store.connect(path)
    con.execute("UPDATE schema_version SET version = 99")
    # Closed here, not whenever the garbage collector frees it (a connection and its statement
    # cache are a cycle): its close checkpoints the WAL into the file, which, landing after
    # `before` was read, looked like the refusal had written to it (seen in a make test run).
    con.close()
    before = path.read_bytes()
    with pytest.raises(EmberError, match="schema version 99 is newer"):
        store.connect(path)
    assert path.read_bytes() == before


def test_not_a_database_is_a_clear_error(tmp_path):
    path = tmp_path / "l.db"
    path.write_text("not sqlite at all " * 100)
    with pytest.raises(EmberError, match="cannot be opened"):
        store.connect(path)


def test_attempts_that_died_without_saying_are_closed_as_killed(tmp_path):
    con = store.connect(tmp_path / "l.db")
    store.register_run(con, "r1", tmp_path, "r1", "d", {}, 10)
    store.start_attempt(con, "r1", 1, 100.0, "h", 1, "cpu", None)
    store.Ledger(con, "r1", 1, print).seen(104.0)
    store.start_attempt(con, "r1", 2, 110.0, "h", 2, "cpu", 5)
    store.Ledger(con, "r1", 2, print).finish("completed")
    assert store.close_dead_attempts(con, "r1", {1: 107.5}) == 1
    rows = store.attempts(con, "r1")
    assert (rows[0].outcome, rows[0].end) == ("killed", 107.5)  # the last step seen, not the heartbeat
    assert rows[1].outcome == "completed"


WRITER = """
import sys
from pathlib import Path
from ember.ledger import database as store
con = store.connect(Path(sys.argv[1]))
run = sys.argv[2]
store.register_run(con, run, Path(run), run, "d", {}, 1)
store.start_attempt(con, run, 1, 0.0, "h", 1, "cpu", None)
ledger = store.Ledger(con, run, 1, lambda m: sys.exit("ledger warned: " + m))
for i in range(400):
    ledger.event("checkpoint", float(i), float(i) + 0.5, step=i)
"""


def test_concurrent_writers_and_a_reader_never_corrupt_it(tmp_path):
    path = tmp_path / "l.db"
    store.connect(path)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"run{i}"]) for i in range(3)]
    reader = sqlite3.connect(path)
    while any(p.poll() is None for p in procs):
        reader.execute("SELECT count(*) FROM events").fetchone()  # reads while they write
    assert [p.wait() for p in procs] == [0, 0, 0]
    assert reader.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    counts = dict(reader.execute("SELECT run_id, count(*) FROM events GROUP BY run_id").fetchall())
    assert counts == {"run0": 400, "run1": 400, "run2": 400}
