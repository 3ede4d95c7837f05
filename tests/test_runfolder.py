"""The run folder's record (ember.runfolder): a run.json that is JSON but not a record is refused
by name, and nothing in the folder is rewritten."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ember.errors import EmberError
from ember.events import Events
from ember.recipe import load_recipe
from ember.runfolder import RunDir, completed, make_folder, read_record
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


@pytest.mark.parametrize("target", ["loop", "missing"])
def test_an_out_that_is_a_symbolic_link_to_nothing_is_refused_by_name(tmp_path, target):
    """`--out` a link to itself, or to a folder that is not there (a disk not mounted), ended in
    '[Errno 17] File exists: ...; committed checkpoints are intact: ... run the same command to
    resume', which no rerun fixes, and `ember run` said nothing of the link."""
    out = tmp_path / "o"
    out.symlink_to(out if target == "loop" else tmp_path / "unmounted" / "runs")
    with pytest.raises(EmberError, match=r"--out .*o: a symbolic link to .*(o|runs), which (loops|is not there)"):
        make_folder(out)
    assert out.is_symlink() and not (tmp_path / "unmounted").exists()


def test_a_run_json_nested_past_the_recursion_limit_is_refused_by_name(tmp_path):
    """A run.json of 100,000 '[' ended `ember run`, `report` and `export` in a RecursionError
    traceback instead of naming the damaged record."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_text("[" * 100_000)
    with pytest.raises(EmberError, match=r"run\.json: unreadable"):
        read_record(out)
    assert completed(out) is None


def test_final_weights_are_replaced_whatever_an_earlier_killed_replacement_left(tmp_path):
    """A process killed while deleting the replaced final/ leaves .del-final.PID; a later completion
    under the same PID (a container's entrypoint is PID 1 each time) failed with '[Errno 39]
    Directory not empty' renaming final/ onto it, after the whole run had trained, at every rerun."""
    out = tmp_path / "o"
    run = RunDir.open(out, load_recipe(write_recipe(tmp_path)), False, Events())
    try:
        run.write_final(lambda folder: (folder.mkdir(), (folder / "w").write_text("1")))
        left = out / f".del-final.{os.getpid()}"
        left.mkdir()
        (left / "w").write_text("0")  # what the killed deletion did not get to
        final = run.write_final(lambda folder: (folder.mkdir(), (folder / "w").write_text("2")))
    finally:
        run.lock.release()
    assert (final / "w").read_text() == "2"
    assert not list(out.glob(".del-final*")) and not list(out.glob(".tmp-final*"))


def test_a_run_in_the_current_folder_is_named_by_it(tmp_path, monkeypatch):
    """`ember run r.toml --out .` gave the run the id '-e54b86' (the name of '.'), which `ember
    report` and `compare` took for an option unless written after `--`."""
    from ember.runfolder import new_run_id
    (tmp_path / "demo").mkdir()
    monkeypatch.chdir(tmp_path / "demo")
    assert re.fullmatch(r"demo-[0-9a-f]{6}", new_run_id(Path("."))), new_run_id(Path("."))
    assert re.fullmatch(r"run-[0-9a-f]{6}", new_run_id(Path("/")))
