"""The jobs' processes alone (ember.sched.job_processes.JobProcesses): a job's own `ember run`
started and reaped with its exit code and its log; an adopted process known by PID and start
time, signalled only while it is that process; its tree killed; the soft-pause requests written
to its control folder; its files removed by a purge. Every process here is one this test started."""

import dataclasses
import json
import signal
import sys

import psutil
import pytest

from ember import control
from ember.ledger.job_rows import JobRow
from ember.sched import process
from ember.sched.job_processes import ADOPTED_EXIT, JobProcesses
from ember.hardware import Device
from ember.paths import Home
from tests.helpers import wait_until


def job(tmp_path, id: int = 7, state: str = "running", **kw) -> JobRow:
    return JobRow(id=id, name=f"j{id}", recipe=str(tmp_path / "missing.toml"), out=str(tmp_path / "runs" / f"j{id}"),
                  overrides=[], priority=0, state=state, submitted=0.0, updated=0.0, request={"memory": 1}, **kw)


@pytest.fixture
def procs(tmp_path):
    return JobProcesses(Home(tmp_path), tmp_path / "ledger.db")


def sleeper(tmp_path, argv=("sleep", "60")) -> process.Spawned:
    """A process this test owns, in a session of its own as a job's would be."""
    return process.spawn(list(argv), tmp_path / "sleeper.log", {})


def test_a_started_job_is_its_own_ember_run_reaped_with_its_exit_code_and_log(procs, tmp_path):
    j = job(tmp_path)
    spawned = procs.start(j, (Device(1, "sim:1", "sim", 1 << 30, 1 << 30),))
    j = dataclasses.replace(j, pid=spawned.pid, pid_start=spawned.start)  # as the service's row says after the start
    code = wait_until("ember run to refuse the missing recipe", lambda: procs.exit_code(j), timeout=120)
    assert code == 1
    log = procs.log_path(j).read_text()
    assert f"{tmp_path / 'missing.toml'}: recipe file not found" in log, log
    data, end = procs.logs(j, 0)
    assert data.decode() == log and procs.logs(j, end) == (b"", end)
    procs.reaped(j)
    assert procs.popens == {}
    assert procs.exit_code(j) == ADOPTED_EXIT  # no child of ours now: the row's process is gone


def test_an_adopted_process_is_signalled_only_while_it_is_that_process(procs, tmp_path):
    s = sleeper(tmp_path)
    try:
        adopted = job(tmp_path, pid=s.pid, pid_start=s.start)
        assert procs.exit_code(adopted) is None and procs.alive(adopted)
        reused = job(tmp_path, pid=s.pid, pid_start="1")  # the same PID, another start: not the job
        assert procs.exit_code(reused) == ADOPTED_EXIT
        procs.terminate(reused)
        assert s.popen.poll() is None  # not signalled
        procs.terminate(adopted)
        assert s.popen.wait(timeout=30) == -signal.SIGTERM
        assert procs.exit_code(adopted) == ADOPTED_EXIT and not procs.alive(adopted)
    finally:
        if s.popen.poll() is None:
            s.popen.kill()
            s.popen.wait()


def test_kill_takes_the_whole_process_tree(procs, tmp_path):
    s = sleeper(tmp_path, (sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"))
    try:
        root = psutil.Process(s.pid)
        child = wait_until("the grandchild to start", lambda: root.children(recursive=True), timeout=60)[0]
        adopted = job(tmp_path, pid=s.pid, pid_start=s.start)
        assert procs.kill(adopted)
        assert s.popen.wait(timeout=30) == -signal.SIGKILL
        wait_until("the grandchild to be gone", lambda: not child.is_running() or
                   child.status() == psutil.STATUS_ZOMBIE, timeout=30)
        assert not procs.kill(adopted)  # gone already
    finally:
        if s.popen.poll() is None:
            s.popen.kill()
            s.popen.wait()


def test_pause_requests_are_written_once_and_an_inference_lease_is_renewed(procs, tmp_path):
    j = job(tmp_path)
    folder = procs.ctl(j)
    assert folder == tmp_path / "serve" / "control" / "7" and folder.is_dir()
    procs.ask(j, "owner", None)
    first = (folder / control.CONTROL).read_text()
    procs.ask(j, "owner", None)
    assert (folder / control.CONTROL).read_text() == first and procs.requested(j) == "owner"  # not rewritten
    procs.ask(j, "inference", 0.001)  # a lease: asked again at each call, renewed once half of it passed
    leased = json.loads((folder / control.CONTROL).read_text())
    assert leased["pause"] == "inference" and "until" in leased

    def renewed() -> bool:
        procs.ask(j, "inference", 0.001)
        return json.loads((folder / control.CONTROL).read_text())["until"] > leased["until"]
    wait_until("the lease to be renewed", renewed, timeout=30, every=0.01)
    procs.ask(j, None, None)
    assert procs.requested(j) is None
    procs.ask(j, "user", None)
    procs.terminate(job(tmp_path, state="soft-paused"))  # lifted so its loop reaches the stop check
    assert procs.requested(j) is None


def test_a_purge_removes_the_jobs_log_and_control_folder_only(procs, tmp_path):
    j = job(tmp_path)
    procs.log_path(j).parent.mkdir(parents=True)
    procs.log_path(j).write_text("its output\n")
    procs.ask(j, "owner", None)
    (tmp_path / "runs" / "j7").mkdir(parents=True)
    procs.remove_files(j)
    assert not procs.log_path(j).exists() and not (tmp_path / "serve" / "control" / "7").exists()
    assert (tmp_path / "runs" / "j7").is_dir()
