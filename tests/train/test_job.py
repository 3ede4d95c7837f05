"""What a run records of its inputs when it begins, and what a resume refuses."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ember.errors import EmberError
from ember.events import Events
from ember.recipe import load_recipe
from ember.runfolder import RunDir
from ember.train.job import _record_inputs
from tests.helpers import write_recipe


def test_a_resume_over_changed_eval_files_is_refused_like_changed_training_data(tmp_path, monkeypatch):
    """The data fingerprint covers [data] files alone: a resume over an edited [eval] file went on
    without a word, its held-out losses (the best checkpoint, [eval] patience) now on other data."""
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"text": "In the beginning"}) + "\n")
    recipe = load_recipe(write_recipe(tmp_path, eval={"files": [str(held)]}))
    run = RunDir.open(tmp_path / "run", recipe, False, Events(None))
    try:
        bundle = SimpleNamespace(source={"kind": "builtin"})
        _record_inputs(run, bundle, "f1", 1, dict, False, Events(None))  # the run begins
        monkeypatch.setattr(run, "has_checkpoints", lambda: True)
        _record_inputs(run, bundle, "f1", 1, dict, False, Events(None))  # a resume over the same files
        held.write_text(json.dumps({"text": "And the earth was without form"}) + "\n")
        with pytest.raises(EmberError, match=r"the data or tokenizer changed since this run began \(\[eval\] files: "
                                             r".*held\.jsonl\).*--allow-recipe-change"):
            _record_inputs(run, bundle, "f1", 1, dict, False, Events(None))
        _record_inputs(run, bundle, "f1", 1, dict, True, Events(None))  # allowed: recorded, and the new files kept
        assert run.record["recipe_changes"][-1]["eval_files"][1] == {str(held): run.record["eval_files"][str(held)]}
        _record_inputs(run, bundle, "f1", 1, dict, False, Events(None))
    finally:
        run.lock.release()
