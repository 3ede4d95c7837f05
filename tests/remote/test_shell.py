"""Copies to and from a target (ember.remote.shell.Shell), on this machine: no engine running."""

from __future__ import annotations

import threading

import pytest

from ember.errors import EmberError
from ember.remote.shell import Shell


def test_a_run_folder_copied_while_its_metrics_grow_comes_back_as_far_as_it_was_read(tmp_path):
    """`ember remote status` brings back a running job's folder, and its run appends to
    metrics.jsonl meanwhile. tar then says "file changed as we read it" and exits 1, and the
    copy was refused as failed: the status command ended with that error (seen once in
    remote/test_slurm.py's job over ssh). The copy is the file as far as it was read; the next
    one completes it."""
    run = tmp_path / "run"
    run.mkdir()
    line = b'{"step": 1, "loss": 2.5, "padding": "' + b"x" * 200 + b'"}\n'
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(line * 200_000)  # ~45 MB: tar reads it for long enough to see it grow
    (run / "run.json").write_text('{"id": "r"}\n')
    stop = threading.Event()

    def append() -> None:
        with open(metrics, "ab") as f:
            while not stop.is_set():
                f.write(line)
                f.flush()
                stop.wait(0.001)
    writer = threading.Thread(target=append)
    writer.start()
    try:
        for i in range(3):
            Shell().get(str(run), tmp_path / f"copy{i}")
    finally:
        stop.set()
        writer.join()
    whole = metrics.read_bytes()
    for i in range(3):
        got = (tmp_path / f"copy{i}" / "metrics.jsonl").read_bytes()
        assert len(got) >= 200_000 * len(line) and whole.startswith(got)
        assert (tmp_path / f"copy{i}" / "run.json").read_text() == '{"id": "r"}\n'


def test_a_copy_that_fails_otherwise_is_still_refused(tmp_path):
    """Only tar's "file changed as we read it" is let through: a folder that is not there fails."""
    with pytest.raises(EmberError, match="copying from .*no-such-folder.* failed"):
        Shell().get(str(tmp_path / "no-such-folder"), tmp_path / "copy")
