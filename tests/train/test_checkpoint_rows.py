"""The ledger row of a committed checkpoint (ember.train.saving.record_persisted): the seconds
`ember report --json` shows as blocked_seconds and durable_seconds, for each kind of persist."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from ember.ckpt import contents
from ember.ckpt.store import CheckpointStore
from ember.ckpt.writer import CheckpointWriter
from ember.events import Events
from ember.ledger import database
from ember.train.saving import record_persisted
from tests.ckpt.test_format import training_state


@pytest.mark.parametrize("background", [False, True])
def test_the_recorded_seconds_run_from_the_checkpoints_start_to_its_commit(tmp_path, background):
    model, opt, sched, scaler, state = training_state()
    con = database.connect(tmp_path / "ledger.db")
    notices: list = []
    job = SimpleNamespace(store=CheckpointStore(tmp_path / "ck", keep_last=2), events=Events(notices.append),
                          ledger=database.Ledger(con, "r", 1, print))
    job.writer = CheckpointWriter(job.store, background=background)
    snap = contents.snapshot(model, opt, sched, scaler, state, copy=background)
    t0 = time.time()
    job.writer.submit(7, snap, meta={}, blocked=0.25)  # 0.25 s of waiting and snapshot before the hand-over
    job.writer.wait()
    elapsed = time.time() - t0  # the persist and then some: an upper bound of its own seconds
    record_persisted(job)
    [row] = database.checkpoints(con, "r")
    assert 0.25 < row["durable_seconds"] <= 0.25 + elapsed  # counted once, from before the hand-over
    # training waits for a synchronous persist: blocked is all of it; else only the 0.25 s before
    assert row["blocked_seconds"] == (0.25 if background else row["durable_seconds"])
    assert f"blocked {row['blocked_seconds']:.2f} s" in notices[-1].message
