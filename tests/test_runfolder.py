"""The run folder's record (ember.runfolder): a run.json that is JSON but not a record is refused
by name, and nothing in the folder is rewritten."""

from __future__ import annotations

import pytest

from ember.errors import EmberError
from ember.events import Events
from ember.recipe import load_recipe
from ember.runfolder import RunDir, completed, read_record
from tests.helpers import write_recipe


@pytest.mark.parametrize("text", ["[]", "null", "3", '"run"', "{}", '{"id": "r", "recipe": null}'])
def test_a_run_json_that_is_not_an_object_is_refused_and_left_as_it_is(tmp_path, text):
    """`ember run`, `report` and `export` on such a folder once ended in an AttributeError or
    TypeError traceback (record.get, record["recipe"]); an object without its recipe, in a
    KeyError one."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_text(text)
    with pytest.raises(EmberError, match=r"run\.json: not a run record \((a JSON object|its \"recipe\" is not an object)\)"):
        read_record(out)
    assert completed(out) is None
    with pytest.raises(EmberError, match=r"run\.json: not a run record"):
        RunDir.open(out, load_recipe(write_recipe(tmp_path)), False, Events())
    assert (out / "run.json").read_text() == text
