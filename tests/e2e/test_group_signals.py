"""A stop signal sent to a run's whole process group (systemd, Slurm's `scancel --signal`, a
container runtime, `kill -TERM -PGID`) reaches its worker processes too: the run still stops as
for a signal to the training process alone (a checkpoint where it stopped, exit 75), and takes
its workers along."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil
import pytest

from tests.e2e.test_resume import resume_to_end, uninterrupted
from tests.helpers import GENESIS, ROOT, assert_same_result, ember_cmd, losses, wait_for_step, write_recipe
from tests.e2e.test_orphans import still_running

pytestmark = pytest.mark.e2e

GONE_SECONDS = 60


def start_group(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`ember ...` as the leader of a process group of its own (as a service manager starts it)."""
    return subprocess.Popen(ember_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, cwd=ROOT, start_new_session=True)


def group_members(pgid: int) -> list[str]:
    """The live processes of process group `pgid`: 'PID state command' each (zombies included:
    a worker not reaped is a leftover too)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # stat(5) field 5, counted after "pid (comm)"
            found.append(f"{entry.name} {fields[0]} {command}")
    return found


def signal_group_and_reap(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    """Send `sig` to the group `proc` leads (ours: started with start_new_session); its exit
    status and what it printed on stderr. Then wait for the group, and every process `proc` had
    started by then, to be gone."""
    started = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=300)
    deadline = time.monotonic() + GONE_SECONDS
    while (group_members(proc.pid) or still_running(started)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = group_members(proc.pid) + still_running(started)
    for line in left:  # leave nothing behind for the other tests, whatever the verdict
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, f"still running {GONE_SECONDS} s after the run exited: {left}"
    return proc.returncode, err


def sigterm_group_once(proc: subprocess.Popen, ready: Callable[[], object]) -> tuple[int, str]:
    """Once `ready()` has returned (it waits for the moment itself), SIGTERM the group `proc`
    leads and reap it (signal_group_and_reap); whatever fails, the group is gone afterwards."""
    try:
        ready()
        assert proc.poll() is None, "test setup: the run ended before the signal"
        return signal_group_and_reap(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_sigterm_to_the_group_of_a_run_with_loader_workers_checkpoints_exits_75_and_resumes_bit_exact(tmp_path):
    """Two DataLoader workers: before the fix they died of the SIGTERM and the run crashed (exit 1,
    "DataLoader worker (pid N) is killed by signal: Terminated") instead of stopping."""
    recipe = write_recipe(tmp_path, train={"max_steps": 400}, data={"workers": 2})
    out = tmp_path / "run"
    proc = start_group("run", recipe, "--out", out)
    code, err = sigterm_group_once(proc, lambda: wait_for_step(proc, out / "metrics.jsonl", 5))
    assert code == 75, err[-3000:]
    stopped_at = losses(out)[-1][0]
    assert 5 <= stopped_at < 400
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert (out / "checkpoints" / f"step-{stopped_at:09d}").is_dir(), saved  # checkpointed where it stopped
    # The loader's workers read the data in the same seeded order as the training process would:
    # the uninterrupted 400-step run without workers is the baseline (tests/e2e/test_resume.py's).
    resume_to_end(recipe, out)
    assert_same_result(out, uninterrupted("400", {"train": {"max_steps": 400}}))


def test_sigterm_to_the_group_of_a_distributed_run_with_loader_workers_checkpoints_and_exits_75(tmp_path):
    """Two ranks (torchrun starts each in a session of its own, and its agent forwards the signal
    to each rank's group), two DataLoader workers each: before the fix the workers died of the
    forwarded SIGTERM and the checkpoint failed on it. (The stop and its resume at one step
    are tests/e2e/test_distributed.py's.)"""
    recipe = write_recipe(tmp_path, train={"max_steps": 400}, data={"workers": 2})
    out = tmp_path / "run"
    proc = start_group("run", recipe, "--out", out, "--no-ledger", "--nproc", "2")
    code, err = sigterm_group_once(proc, lambda: wait_for_step(proc, out / "metrics.jsonl", 5, timeout=300))
    assert code == 75, err[-3000:]
    stopped_at = losses(out)[-1][0]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert (out / "checkpoints" / f"step-{stopped_at:09d}").is_dir(), saved


def test_sigterm_to_the_group_during_tokenization_stops_the_run_before_its_first_step(tmp_path):
    """The tokenization pool's workers (held 3 s at each shard) get the group's SIGTERM too: the
    tokenization ends and the run exits 75 before its first step, as for a signal to it alone
    (tests/e2e/test_resume.py), instead of failing on a dead worker."""
    corpus = tmp_path / "big.jsonl"
    texts = [json.loads(line)["text"] for line in GENESIS.read_text().splitlines()]
    with open(corpus, "w") as f:  # over POOL_MIN_BYTES (8 MiB), so that the pool is used
        copy = 0
        while f.tell() < 9 << 20:
            for text in texts:
                f.write(json.dumps({"text": f"{copy}: {text}"}) + "\n")
            copy += 1
    recipe = write_recipe(tmp_path, data={"files": [str(corpus)], "tokenize_workers": 2})
    out = tmp_path / "run"
    home = tmp_path / "home"  # a token cache of its own: this run tokenizes
    proc = start_group("run", recipe, "--out", out,
                       env={"EMBER_HOME": str(home), "EMBER_FAULT": "tokenize.shard", "EMBER_FAULT_HANG": "3"})
    code, err = sigterm_group_once(proc, lambda: _wait_for_the_pool(proc))
    assert code == 75, err[-3000:]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text(), "it trained"
    assert list((home / "cache" / "tokens").glob("*/info.json")), "the tokenization did not end"


def _wait_for_the_pool(proc: subprocess.Popen) -> None:
    """Until two tokenization workers of `proc`'s group run (or it ended), at most 180 s."""
    deadline = time.monotonic() + 180
    while sum("spawn_main" in line for line in group_members(proc.pid)) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline, group_members(proc.pid)
        time.sleep(0.05)
