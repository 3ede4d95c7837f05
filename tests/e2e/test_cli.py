"""Bad input through the real CLI: a clear message, no traceback, the right exit code, and every
committed checkpoint left intact."""

from __future__ import annotations

import json
import shutil

from ember.ckpt.store import CheckpointStore
from tests.helpers import GENESIS, run_ember, write_recipe


def assert_clean_error(result, *fragments: str, code: int = 1) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_missing_model_path(tmp_path):
    recipe = write_recipe(tmp_path, model={"path": "no/such/model"})
    assert_clean_error(run_ember("run", recipe, "--out", tmp_path / "o"),
                       "[model] path = 'no/such/model'", "no such file or folder")


def test_malformed_toml_and_missing_recipe(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 3\n")
    assert_clean_error(run_ember("run", bad, "--out", tmp_path / "o"), "bad.toml", "not valid TOML")
    assert_clean_error(run_ember("run", tmp_path / "none.toml", "--out", tmp_path / "o"),
                       "recipe file not found")


def test_bad_override_and_bad_usage(tmp_path):
    recipe = write_recipe(tmp_path)
    assert_clean_error(run_ember("run", recipe, "--out", tmp_path / "o", "--set", "train.seed=-1"),
                       "[train] seed = -1", "must be >= 0")
    assert_clean_error(run_ember("run", recipe), "--out", code=2)  # argparse: usage error


def test_empty_dataset(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    recipe = write_recipe(tmp_path, data={"files": [str(empty)]})
    assert_clean_error(run_ember("run", recipe, "--out", tmp_path / "o"),
                       f"{empty} holds no records (it is empty, or blank)")
    short = tmp_path / "short.jsonl"  # records, but not one sequence's worth of tokens
    short.write_text('{"text": "hi"}\n')
    recipe = write_recipe(tmp_path, data={"files": [str(short)]})
    assert_clean_error(run_ember("run", recipe, "--out", tmp_path / "o2"),
                       "fewer than one sequence of seq_len = 32")


def test_seq_len_beyond_the_model_context(tmp_path):
    recipe = write_recipe(tmp_path, data={"seq_len": 4096})
    assert_clean_error(run_ember("run", recipe, "--out", tmp_path / "o"),
                       "[data] seq_len = 4096", "beyond the model's context of 1024")


def test_out_folder_that_is_not_a_run(tmp_path):
    recipe = write_recipe(tmp_path)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("mine")
    assert_clean_error(run_ember("run", recipe, "--out", tmp_path / "o"),
                       "is not an ember run folder")
    assert (tmp_path / "o" / "notes.txt").read_text() == "mine"


def test_changed_recipe_is_refused_then_allowed_and_recorded(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 6})
    out = tmp_path / "o"
    assert run_ember("run", recipe, "--out", out).returncode == 0
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    result = run_ember("run", recipe, "--out", out, "--set", "train.max_steps=10",
                       "--set", "optimizer.lr=0.002")
    assert_clean_error(result, "belongs to a run with a different recipe", "train.max_steps: 6 -> 10",
                       "optimizer.lr: 0.001 -> 0.002", "--allow-recipe-change")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    # Operational keys may change freely.
    assert run_ember("run", recipe, "--out", out, "--set", "checkpoint.keep_last=3").returncode == 0
    result = run_ember("run", recipe, "--out", out, "--set", "train.max_steps=10",
                       "--allow-recipe-change")
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "run.json").read_text())
    assert record["recipe"]["train"]["max_steps"] == 10
    assert record["recipe_changes"][-1]["keys"]["train.max_steps"] == [6, 10]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] \
        == list(range(1, 11))


def test_changed_data_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    shutil.copy(GENESIS, data)
    recipe = write_recipe(tmp_path, data={"files": [str(data)]}, train={"max_steps": 3})
    out = tmp_path / "o"
    assert run_ember("run", recipe, "--out", out).returncode == 0
    data.write_text(data.read_text() + json.dumps({"text": "And more."}) + "\n")
    assert_clean_error(run_ember("run", recipe, "--out", out), "the data or tokenizer changed")


def test_completed_run_run_again_changes_nothing(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 4})
    out = tmp_path / "o"
    assert run_ember("run", recipe, "--out", out).returncode == 0
    weights = (out / "final" / "model.safetensors").read_bytes()
    metrics = (out / "metrics.jsonl").read_text()
    result = run_ember("run", recipe, "--out", out)
    assert result.returncode == 0 and "completed 4 steps" in result.stdout
    assert (out / "final" / "model.safetensors").read_bytes() == weights
    assert (out / "metrics.jsonl").read_text() == metrics


def test_full_disk_during_a_checkpoint_exits_1_and_keeps_the_committed_one(tmp_path, small_disk):
    disk = small_disk("3m")  # room for two checkpoints of the tiny model (~1.5 MB each), not three
    recipe = write_recipe(tmp_path, train={"max_steps": 20}, checkpoint={"every_steps": 5,
                                                                        "keep_last": 2})
    result = run_ember("run", recipe, "--out", disk / "o")
    # Caught before writing (free space below the last checkpoint's size) or while writing (ENOSPC).
    assert_clean_error(result, "stopping: the last committed checkpoint", "Free disk space")
    assert "not started" in result.stderr or "No space left on device" in result.stderr
    store = CheckpointStore(disk / "o" / "checkpoints", keep_last=2)
    assert store.committed()
    for _, path in store.committed():
        store.verify(path)
    assert not list(store.root.glob(".tmp-*"))


def test_disk_guard_keeps_training_within_the_loss_budget(tmp_path, small_disk):
    disk = small_disk("3m")
    recipe = write_recipe(tmp_path, train={"max_steps": 30},
                          checkpoint={"every_steps": 5, "keep_last": 2, "loss_budget_seconds": 3600})
    result = run_ember("run", recipe, "--out", disk / "o")
    # Checkpoints stop fitting after the first two; the final weights (a third of one) still do.
    assert result.returncode == 0, result.stderr
    assert "training on: the last committed checkpoint" in result.stderr
    assert "within [checkpoint] loss_budget_seconds = 3600" in result.stderr
    assert (disk / "o" / "final" / "model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (disk / "o" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 30  # it trained past the checkpoints that did not fit
    store = CheckpointStore(disk / "o" / "checkpoints", keep_last=2)
    for _, path in store.committed():
        store.verify(path)
    assert not list(store.root.glob(".tmp-*"))
