"""The one job state machine (ember.ledger.job_states): its states' stored values, the remote
machine declared in the docstring, `move` on both tables of a real ledger, and a ledger written
before remote jobs named their backend, migrated with its rows kept."""

from __future__ import annotations

import sqlite3

import pytest

import ember.ledger.job_states as job_states
from ember.errors import EmberError
from ember.ledger import database as store
from ember.ledger import job_rows, remote_rows
from ember.ledger.job_states import LOCAL, REMOTE, JobState, move

REMOTE_JOB = {"name": "j", "target": "hpc", "audit_id": 1, "audit_hash": "h", "host": "", "ssh_options": [],
              "python": "python", "recipe": "/r.toml", "out": "/o", "remote_dir": "/s/j", "limits": {},
              "prediction": {}}


def test_the_states_values_are_the_ones_ledgers_hold():
    """The values are stored in SQLite: renaming one would strand every row in it."""
    assert [s.value for s in JobState] == ["queued", "starting", "running", "soft-paused", "preempting", "staging",
                                           "pending", "requeued", "completed", "stopped", "failed", "cancelled"]
    assert set(LOCAL.states) | set(REMOTE.states) == set(JobState)
    assert JobState.SOFT_PAUSED == "soft-paused" and f"{JobState.SOFT_PAUSED}" == "soft-paused"


def test_every_remote_state_is_declared_with_its_transitions_in_the_docstring():
    remote = job_states.__doc__.split("Remote jobs")[1]
    for src, dsts in REMOTE.transitions.items():
        assert src in remote
        for dst in dsts:
            assert dst in REMOTE.states and REMOTE.allowed(src, dst) and dst in remote
    assert not REMOTE.allowed("completed", "staging") and not REMOTE.allowed("staging", "running")


def test_move_changes_either_table_through_its_own_machine(tmp_path):
    con = store.connect(tmp_path / "ledger.db")
    local = job_rows.insert(con, "l", "/r.toml", "/o", [], 0, {"memory": 1}, "queued")
    remote = remote_rows.insert(con, REMOTE_JOB, "staging")
    assert remote.backend == "slurm" and remote.backend_id is None  # the column's default
    started = move(con, local, JobState.STARTING, "admitted", pid=1)
    assert (started.state, started.pid) == ("starting", 1)
    pending = move(con, remote, "pending", "submitted", backend_id="42")
    assert (pending.state, pending.backend_id) == ("pending", "42")
    assert remote_rows.find(con, "42") == [pending]
    # Each table has its own machine: a local state is no remote job's, and the reverse.
    with pytest.raises(EmberError, match="remote job j: cannot go from pending to queued"):
        move(con, pending, "queued", "no")
    with pytest.raises(EmberError, match="job l: cannot go from starting to pending"):
        move(con, started, "pending", "no")
    # Compare-and-set: a row read before another change moved it is not moved.
    assert move(con, local, "cancelled", "stale") is None and job_rows.get(con, local.id).state == "starting"
    assert move(con, remote, "failed", "stale") is None and remote_rows.get(con, remote.id).state == "pending"
    assert [t[1:3] for t in remote_rows.transitions(con, remote.id)] == [(None, "staging"), ("staging", "pending")]


def test_a_ledger_from_before_backends_opens_with_its_remote_jobs_kept(tmp_path):
    """Schema 5 named the column slurm_id: migrated, the id is the job's backend id and its backend
    is Slurm, and it is found by that id as before."""
    path = tmp_path / "ledger.db"
    old = sqlite3.connect(path)
    for script in store.MIGRATIONS[:5]:
        old.executescript(script)
    old.executescript("CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (5);")
    old.execute("INSERT INTO remote_jobs (name, target, slurm_id, state, submitted, updated, audit_id, audit_hash, "
                "host, ssh_options, python, recipe, out, remote_dir, limits, prediction, cost) "
                "VALUES ('old', 'hpc', '81234', 'completed', 1.0, 2.0, 1, 'h', '', '[]', 'python', '/r.toml', "
                "'/o', '/s/old', '{\"max_cost\": 3}', '{}', 2.5)")
    old.commit()
    old.close()
    con = store.connect(path)
    assert con.execute("SELECT version FROM schema_version").fetchone()[0] == store.SCHEMA_VERSION
    (job,) = remote_rows.find(con, "81234")
    assert (job.name, job.backend, job.backend_id, job.state, job.cost) == ("old", "slurm", "81234", "completed", 2.5)
    assert remote_rows.month_spend(con, "hpc", 0.0, job_states.REMOTE_FINAL) == 2.5


def test_a_job_held_as_the_ledger_is_upgraded_stops_ageing_from_its_hold(tmp_path):
    """Schema 7 wrote no row for a hold: a job held by hand before the upgrade and released after
    it would have counted its whole hold as waiting. Migrated, it has a row from its last change
    (when it was held), and ages only while it could start."""
    path = tmp_path / "ledger.db"
    old = sqlite3.connect(path)
    for script in store.MIGRATIONS[:7]:
        old.executescript(script)
    old.executescript("CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (7);")
    for job_id, name, hold in ((1, "held", "user"), (2, "free", None)):
        old.execute("INSERT INTO jobs (id, name, recipe, out, overrides, priority, state, hold, submitted, updated, "
                    "request) VALUES (?, ?, '/r.toml', ?, '[]', 0, 'queued', ?, 1000.0, 1600.0, '{}')",
                    (job_id, name, f"/runs/{name}", hold))
        old.execute("INSERT INTO job_transitions VALUES (?, 1000.0, NULL, 'queued', 'submitted')", (job_id,))
    old.commit()
    old.close()
    con = store.connect(path)
    held, free = job_rows.get(con, 1), job_rows.get(con, 2)
    assert job_rows.waited_seconds(con, held, 5000.0) == pytest.approx(600.0)  # queued 1000 -> held 1600
    assert job_rows.waited_seconds(con, free, 5000.0) == pytest.approx(4000.0)  # never held: no row added
    assert [t["why"] for t in job_rows.transitions(con, 2)] == ["submitted"]
    released = move(con, held, "queued", "resumed by hand", hold=None)
    assert job_rows.waited_seconds(con, released, released.updated + 100) == pytest.approx(700.0)
