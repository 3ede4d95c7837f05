"""The commit protocol: atomic, verified, retained, and safe against kills and full disks."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ember.ckpt.store import MANIFEST, CheckpointStore
from ember.errors import EmberError


def writer(payload: bytes):
    def write(folder: Path) -> None:
        (folder / "a.bin").write_bytes(payload)
        (folder / "b.bin").write_bytes(payload[::-1])
    return write


def test_commit_writes_manifest_with_sizes_and_hashes_and_verifies(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    ck = store.save(3, writer(b"x" * 1000), meta={"k": 1})
    assert ck.path.name == "step-000000003"
    manifest = json.loads((ck.path / MANIFEST).read_text())
    assert manifest["files"]["a.bin"]["bytes"] == 1000 and manifest["meta"] == {"k": 1}
    assert store.verify(ck.path)["step"] == 3
    assert not [p for p in store.root.iterdir() if p.name.startswith(".")]


def test_retention_keeps_the_newest_and_deletes_only_after_commit(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    for step in (1, 2, 3, 4):
        store.save(step, writer(bytes([step]) * 10), meta={})
    assert [s for s, _ in store.committed()] == [3, 4]


def test_retention_keeps_the_best_checkpoint_the_newest_manifest_names(tmp_path):
    """The best held-out loss was at step 2: retention keeps it beyond keep_last while the newest
    commit names it, also in a store opened afresh (a resume), and lets it go once a newer
    commit names another."""
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    for step in (1, 2, 3, 4, 5):
        store.save(step, writer(bytes([step]) * 10), meta={"best_step": 2 if step >= 2 else 1})
    store.settle()
    assert [s for s, _ in store.committed()] == [2, 4, 5]
    assert json.loads((store.committed()[-1][1] / MANIFEST).read_text())["meta"]["best_step"] == 2
    resumed = CheckpointStore(tmp_path / "ck", keep_last=2)
    resumed.save(6, writer(b"6" * 10), meta={"best_step": 2})
    resumed.settle()
    assert [s for s, _ in resumed.committed()] == [2, 5, 6]
    resumed.save(7, writer(b"7" * 10), meta={"best_step": 7})
    resumed.settle()
    assert [s for s, _ in resumed.committed()] == [6, 7]


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing_file", "no_manifest", "bad_manifest"])
def test_damaged_newest_is_quarantined_and_the_previous_is_used(tmp_path, damage):
    store = CheckpointStore(tmp_path / "ck", keep_last=3)
    store.save(1, writer(b"one" * 100), meta={})
    newest = store.save(2, writer(b"two" * 100), meta={}).path
    target = newest / "a.bin"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[10] ^= 0x80
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    elif damage == "missing_file":
        target.unlink()
    elif damage == "no_manifest":
        (newest / MANIFEST).unlink()
    else:
        (newest / MANIFEST).write_text("{not json")
    warnings = []
    ck = store.load_latest(warnings.append)
    assert ck is not None and ck.step == 1
    assert len(warnings) == 1 and "step-000000002 is damaged" in warnings[0]
    assert [p.name.split(".")[0] for p in store.root.glob("corrupt-*")] == ["corrupt-step-000000002"]


def test_sweep_removes_uncommitted_and_retired_folders_only(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    store.save(1, writer(b"a"), meta={})
    (store.root / ".tmp-step-000000002.123").mkdir()
    (store.root / ".del-step-000000000").mkdir()
    assert sorted(store.sweep()) == [".del-step-000000000", ".tmp-step-000000002.123"]
    assert [s for s, _ in store.committed()] == [1]


KILL_SCRIPT = """
import sys
from pathlib import Path
from ember.ckpt.store import CheckpointStore
store = CheckpointStore(Path(sys.argv[1]), keep_last=1)
for step in (1, 2):
    store.save(step, lambda d: (d / "w.bin").write_bytes(bytes([step]) * 4096), meta={})
"""


@pytest.mark.parametrize("fault", ["ckpt.files_written@2", "ckpt.manifest_written@2",
                                   "ckpt.renamed@2", "ckpt.retired@1"])
def test_kill_inside_commit_never_loses_the_committed_checkpoint(tmp_path, fault):
    root = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(root)],
                          env={**os.environ, "EMBER_FAULT": fault}, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = CheckpointStore(root, keep_last=1)
    store.sweep()
    ck = store.load_latest(pytest.fail)  # nothing found damaged
    committed_second = fault in ("ckpt.renamed@2", "ckpt.retired@1")
    assert ck is not None and ck.step == (2 if committed_second else 1)
    assert (ck.path / "w.bin").read_bytes() == bytes([ck.step]) * 4096


def test_full_disk_during_checkpoint_leaves_the_previous_one_intact(small_disk):
    store = CheckpointStore(small_disk("1m") / "ck", keep_last=1)
    store.save(1, writer(b"a" * 200_000), meta={})
    with pytest.raises(EmberError) as info:
        store.save(2, writer(b"b" * 600_000), meta={})
    message = str(info.value)
    assert "checkpoint at step 2 could not be written" in message
    assert "No space left on device" in message and "step-000000001, is intact" in message
    assert "free disk space" in message
    assert [s for s, _ in store.committed()] == [1]
    assert store.verify(store.root / "step-000000001")
    assert not [p for p in store.root.iterdir() if p.name.startswith(".tmp")]  # space given back


@pytest.mark.parametrize("name", ["step-²", "step-٣", "step-000000002²", "step-"])
def test_a_step_folder_whose_number_is_not_ascii_digits_is_no_checkpoint_and_is_left_alone(tmp_path, name):
    """`checkpoints/step-²` (str.isdigit, yet no int) ended every reader of the checkpoints
    (`ember run`'s resume and retention, `ember report`, `ember export`, the served models' list)
    in a ValueError traceback; `step-٣` was taken for a committed checkpoint at step 3."""
    store = CheckpointStore(tmp_path / "ck", keep_last=1)
    store.save(1, writer(b"a"), meta={})
    (store.root / name).mkdir()
    assert [s for s, _ in store.committed()] == [1]
    assert CheckpointStore.newest_step(store.root) == 1
    for step in (2, 3):
        store.save(step, writer(bytes([step])), meta={})
    store.settle()
    assert [s for s, _ in store.committed()] == [3]
    assert (store.root / name).is_dir()  # not ours: never retired, quarantined or deleted
    assert store.load_latest(pytest.fail).step == 3


def test_a_rollback_that_finds_every_checkpoint_damaged_moves_none_of_them(tmp_path):
    """load_latest (a loss spike's rollback) set the only checkpoint, damaged, aside as corrupt-*
    although no older one verified: the run stopped, and the same command run again found no
    committed checkpoint and trained from step 0 without a word, where a run whose checkpoints
    all fail verification stops and moves nothing (README, Damaged checkpoints)."""
    store = CheckpointStore(tmp_path / "ck", keep_last=3)
    store.save(1, writer(b"one" * 100), meta={})
    newest = store.save(2, writer(b"two" * 100), meta={}).path
    for _, path in store.committed():
        (path / "a.bin").write_bytes(b"x")
    warnings = []
    assert store.load_latest(warnings.append) is None
    assert [s for s, _ in store.committed()] == [1, 2] and not list(store.root.glob("corrupt-*"))
    assert len(warnings) == 2 and f"{newest.name} is damaged" in warnings[0]


def test_a_manifest_nested_past_the_recursion_limit_is_damage_not_a_traceback(tmp_path):
    """A MANIFEST.json replaced by 100,000 '[' (JSON, but deeper than the parser recurses) ended
    `ember run`'s resume, `ember export --checkpoint` and the served checkpoint in a
    RecursionError traceback instead of naming the checkpoint as damaged."""
    store = CheckpointStore(tmp_path / "ck", keep_last=3)
    store.save(1, writer(b"one"), meta={})
    newest = store.save(2, writer(b"two"), meta={}).path
    (newest / MANIFEST).write_text("[" * 100_000)
    with pytest.raises(ValueError, match="manifest unreadable"):
        store.verify(newest)
    warnings = []
    assert store.load_latest(warnings.append).step == 1
    assert "step-000000002 is damaged" in warnings[0]


def test_a_small_file_written_on_a_full_disk_leaves_no_temp_file_and_names_itself(small_disk):
    """write_durable (run.json, the launch spec, the ledger's side files) left its temp file
    behind when the disk was full, one more per try, in the run folder; the error said only
    '[Errno 28] No space left on device', without the file."""
    from ember.durable import write_durable
    folder = small_disk("64k")
    (folder / "filler").write_bytes(b"\0" * (60 << 10))
    target = folder / "run.json"
    for _ in range(3):
        with pytest.raises(OSError) as e:
            write_durable(target, "x" * (32 << 10))
        assert e.value.errno == errno.ENOSPC and str(target) in str(e.value), e.value
    assert sorted(p.name for p in folder.iterdir()) == ["filler"]
