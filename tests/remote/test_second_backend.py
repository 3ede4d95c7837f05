"""A second remote backend, for the tests only: jobs as `ember run` processes on this machine, each
in its folder under the target's stage_dir. Registered in BACKENDS for a test, it goes through
the same gate, submission, state machine, results' return, cancel and continue as Slurm, with no
edit anywhere else: the proof that a new engine is one module and one line in the registry. (The
real engine's proof is tests/remote/test_slurm.py; this one runs where Slurm cannot.)"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from ember.events import Events
from ember.ledger import database as store
from ember.ledger.job_states import JobState
from ember.ledger.remote_rows import RemoteJobRow
from ember.policy.gate import Limits
from ember.policy.registry import register
from ember.policy.targets import Target
from ember.remote import stage
from ember.remote.backend import Launch, Observed
from ember.remote.backends import BACKENDS
from ember.remote.shell import Shell
from ember.remote.submit import RemoteRequest, continue_job, submit
from ember.remote.tracking import cancel_job, job_logs, job_status
from tests.helpers import GENESIS, assert_same_result, run_ember, wait_until, write_recipe
from tests.remote.targets import target_toml


class ProcessBackend:
    """`ember run` started by bash in the job's folder; bash writes its pid, then its exit code."""

    kind = "process"
    title = "Process"
    started: list[subprocess.Popen] = []  # stopped by the test at its end, whatever happened

    def __init__(self, shell: Shell):
        assert not shell.host, "this machine only"

    def submit(self, launch: Launch, target: Target, events: Events) -> str:
        with stage.new_folder(Shell(), launch.folder):
            sums = stage.upload(Shell(), launch.folder, list(launch.datasets), events, launch.digests)
            stage.put_files(Shell(), launch.folder, {"recipe.toml": launch.recipe, "data.sha256": sums})
            return self._start(Path(launch.folder), launch)

    def resubmit(self, launch: Launch, target: Target, events: Events) -> str:
        for name in ("exit", "cancelled", "pid"):
            (Path(launch.folder) / name).unlink(missing_ok=True)
        return self._start(Path(launch.folder), launch)

    def _start(self, folder: Path, launch: Launch) -> str:
        run = shlex.join([launch.python, "-m", "ember", "run", "recipe.toml", "--out", launch.name,
                          "--ledger", "ledger.db"])
        script = f"{run} & echo $! > pid; wait $!; echo $? > exit"
        with open(folder / "output.log", "ab") as log:
            bash = subprocess.Popen(["bash", "-c", script], cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.started.append(bash)
        return str(bash.pid)

    def status(self, job: RemoteJobRow) -> Observed:
        folder = Path(job.remote_dir)
        if not (folder / "exit").is_file():
            return Observed(JobState.RUNNING, "the process runs")
        code = int((folder / "exit").read_text())
        if code == 0:
            return Observed(JobState.COMPLETED, "max_steps reached")
        if (folder / "cancelled").exists():
            return Observed(JobState.CANCELLED, f"cancelled: exit {code}")
        return Observed(JobState.FAILED, f"exit {code}")

    def logs(self, job: RemoteJobRow, offset: int) -> bytes:
        return Shell().read(f"{job.remote_dir}/output.log", offset)

    def cancel(self, job: RemoteJobRow, events: Events) -> None:
        folder = Path(job.remote_dir)
        wait_until("the run's pid", lambda: (folder / "pid").is_file() and (folder / "pid").read_text().strip(), 60)
        (folder / "cancelled").touch()
        os.kill(int((folder / "pid").read_text()), signal.SIGTERM)  # ember run's own: it checkpoints, exits 75

    def fetch(self, job: RemoteJobRow, out: Path, ledger: Path, final: bool) -> bool:
        run = Path(job.remote_dir) / job.name
        if not (run / "run.json").is_file():
            return False
        Shell().get(str(run), out, exclude=("./checkpoints", "./.lock") if not final else ("./.lock",))
        src, dst = sqlite3.connect(Path(job.remote_dir) / "ledger.db"), sqlite3.connect(ledger)
        src.backup(dst)
        src.close()
        dst.close()
        return True




@pytest.fixture
def process_backend(monkeypatch):
    """ProcessBackend registered for one test; the process groups it started stopped after it."""
    monkeypatch.setitem(BACKENDS, ProcessBackend.kind, ProcessBackend)
    yield
    for bash in ProcessBackend.started:
        if bash.poll() is None:
            os.killpg(bash.pid, signal.SIGKILL)
            bash.wait()
    ProcessBackend.started.clear()


def test_a_second_backend_runs_cancels_and_continues_a_job_through_the_protocol(tmp_path, monkeypatch,
                                                                                 process_backend):
    monkeypatch.setenv("EMBER_FAULT_DATA_DELAY", "0.5")  # time to cancel while it trains
    data = tmp_path / "genesis.jsonl"
    data.write_bytes(GENESIS.read_bytes())
    recipe = write_recipe(tmp_path / "project", data={"files": [str(data)]})
    (tmp_path / "targets.toml").write_text(target_toml("box", "process", tmp_path / "stage"))
    register(tmp_path / "datasets.toml", "genesis", [data], "alice", "CC0-1.0", "public", ["box"], "")
    ledger = tmp_path / "ledger.db"
    req = RemoteRequest(recipe, "box", Limits(0.5, 0.5, 0.5, 1), out=tmp_path / "results", name="job",
                        registry=tmp_path / "datasets.toml", targets=tmp_path / "targets.toml", ledger=ledger)

    job = submit(req, Events()).job
    assert (job.backend, job.state) == ("process", "pending") and job.backend_id
    metrics = tmp_path / "stage" / "job" / "job" / "metrics.jsonl"
    wait_until("step 2 in the job's folder", lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2, 120)
    cancelled = cancel_job(ledger, "job", None, 120, Events())
    assert cancelled.job.state == "cancelled" and 2 <= cancelled.steps < 24
    assert (tmp_path / "results" / "checkpoints").is_dir()  # brought back: it checkpointed on TERM

    monkeypatch.delenv("EMBER_FAULT_DATA_DELAY")
    again = continue_job("job", req, Events()).job
    assert again.state == "pending" and again.backend_id != job.backend_id
    (done,) = job_status(ledger, "job", None, True, 300, Events())
    assert done.job.state == "completed" and done.steps == done.max_steps == 24
    transitions = [(t[1], t[2]) for t in done.transitions]
    assert transitions[0] == (None, "staging") and ("cancelled", "staging") in transitions
    log, ended = job_logs(ledger, "job", None, 0)
    assert ended and log
    baseline = run_ember("run", recipe, "--out", tmp_path / "baseline", "--no-ledger")
    assert baseline.returncode == 0, baseline.stderr
    assert_same_result(tmp_path / "results", tmp_path / "baseline")
    con = store.connect(ledger)
    outcomes = [r[0] for r in con.execute("SELECT outcome FROM attempts WHERE run_id = ? ORDER BY attempt",
                                          (done.job.run_id,))]
    con.close()
    assert outcomes == ["interrupted", "completed"]
    assert json.loads((tmp_path / "results" / "run.json").read_text())["id"] == done.job.run_id
