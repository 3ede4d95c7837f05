"""RunState: its field list is pinned, and it round-trips through torch.save with every RNG."""

from __future__ import annotations

import dataclasses
import io
import random

import numpy as np
import torch

from ember.ckpt.state import DataCursor, RunState


def test_runstate_fields_are_pinned():
    """Adding state that must survive a restart is a deliberate change: update this list."""
    assert [f.name for f in dataclasses.fields(RunState)] == [
        "step", "tokens_seen", "cursor", "train_seconds", "recipe_digest", "rng", "loss_window",
        "skip_batches", "bad_steps", "lr_scale", "bad_streak", "best_eval_loss", "best_step",
        "evals_since_best"]
    assert [f.name for f in dataclasses.fields(DataCursor)] == ["epoch", "offset"]


def test_roundtrip_restores_every_rng_stream():
    device = torch.device("cpu")
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = RunState(step=7, tokens_seen=896, cursor=DataCursor(1, 5), train_seconds=1.5,
                     recipe_digest="abc")
    state.capture_rng(device)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    buf = io.BytesIO()
    torch.save(state.to_dict(), buf)
    buf.seek(0)
    loaded = RunState.from_dict(torch.load(buf, weights_only=True))  # no pickled code
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    loaded.restore_rng(device)
    assert loaded.step == 7 and loaded.cursor == DataCursor(1, 5) and loaded.recipe_digest == "abc"
    assert random.random() == expected[0]
    assert np.random.rand() == expected[1]
    assert torch.equal(torch.rand(3), expected[2])
