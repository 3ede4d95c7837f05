"""What a persist's record says training was blocked for (ember.ckpt.writer): the ledger's
blocked_seconds and the "training blocked" of each checkpoint's notice come from it."""

from __future__ import annotations

import pytest

from ember.ckpt import contents
from ember.ckpt.store import CheckpointStore
from ember.ckpt.writer import CheckpointWriter
from tests.ckpt.test_format import training_state


@pytest.mark.parametrize("background", [False, True])
def test_blocked_covers_the_persist_only_when_it_ran_in_the_training_thread(tmp_path, background):
    model, opt, sched, scaler, state = training_state()
    writer = CheckpointWriter(CheckpointStore(tmp_path / "ck", keep_last=2), background=background)
    snap = contents.snapshot(model, opt, sched, scaler, state, copy=background)
    writer.submit(7, snap, meta={}, blocked=0.25)  # 0.25 s of waiting and snapshot before the hand-over
    writer.wait()
    [p] = writer.completed()
    assert p.durable > p.submitted
    assert p.to_durable == pytest.approx(0.25 + p.durable - p.submitted)  # the ledger's durable_seconds
    if background:  # training went on while the thread persisted: blocked is what came before
        assert p.blocked == 0.25
    else:  # synchronous: training waited for the whole persist, until the commit was durable
        assert p.blocked == p.to_durable
