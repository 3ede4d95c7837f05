"""Bringing a remote job's ledger rows here (ember.ledger.remote_rows.import_run), at every poll."""

from __future__ import annotations

import sqlite3

from ember.ledger import database as store
from ember.ledger.remote_rows import import_run


def test_a_job_ledger_without_its_tables_yet_is_a_run_not_there_yet(tmp_path):
    """A poll that lands after the remote run wrote run.json and before its ledger has tables
    finds an empty database (the snapshot's sqlite3.connect creates one): before the fix,
    `ember remote status --wait` died there with "no such table: runs"."""
    con = store.connect(tmp_path / "here.db")
    src = sqlite3.connect(tmp_path / "job.db")  # what the snapshot of a ledger not yet written is
    src.row_factory = sqlite3.Row
    assert import_run(con, src, "r1", tmp_path / "run") is False
    store.connect(tmp_path / "job.db").close()  # the run's ledger, now with its tables, no run yet
    src = sqlite3.connect(tmp_path / "job.db")
    src.row_factory = sqlite3.Row
    assert import_run(con, src, "r1", tmp_path / "run") is False
