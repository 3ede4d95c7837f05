"""The warm start of `run_ember` (tests/warm.py) is only honest while ember reads no environment
variable at import time, and while a forked command behaves as a fresh one."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ember.runfolder import LOCK_FILE
from tests import warm
from tests.helpers import ROOT, ember_cmd, wait_for_step, wait_until, write_recipe


def _import_time_nodes(tree: ast.Module):
    """The nodes Python evaluates when the module is imported: all but function bodies."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            stack.extend([*args.defaults, *(d for d in args.kw_defaults if d)])
            stack.extend(getattr(node, "decorator_list", []))
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def test_ember_reads_no_environment_variable_at_import_time():
    found = []
    for path in sorted((ROOT / "ember").rglob("*.py")):
        for node in _import_time_nodes(ast.parse(path.read_text())):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.id if isinstance(node, ast.Name) else None)
            if name in {"environ", "getenv", "environb"}:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"read at import time, which a warm start would not see: {found}"


def test_a_warm_command_has_its_own_arguments_environment_folder_and_exit(tmp_path):
    """The same command, fresh and forked from the warm process: same output, same exit status."""
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home"), "COLUMNS": "77"}
    (tmp_path / "bad.toml").write_text("[model]\npath = 3\n")
    for args in (["--help"], ["plan", str(tmp_path / "bad.toml")], ["plan", "missing.toml"],
                 ["submit", "x.toml", "--name", "a/b"]):
        cold = subprocess.run(ember_cmd(*args), capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=120)
        forked = warm.run(args, env, ROOT, timeout=120)
        assert (forked.returncode, forked.stdout, forked.stderr) == \
               (cold.returncode, cold.stdout, cold.stderr), args
    assert cold.returncode == 2 and "a/b" in cold.stderr


def test_a_timed_out_warm_command_is_killed(tmp_path):
    """As subprocess.run does on a timeout: the command is killed, not left running."""
    recipe = write_recipe(tmp_path, train={"max_steps": 100_000})
    out = tmp_path / "run"
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home")}
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run(["run", str(recipe), "--out", str(out)], env, ROOT, timeout=8)
    pid = int((out / LOCK_FILE).read_text())  # the command's own PID, written by its run lock
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"the timed-out command (PID {pid}) still runs after 60 s"


@pytest.mark.parametrize("leaves", ["at once", "with the PID unread"])
def test_a_command_whose_client_left_before_it_learned_the_pid_is_killed(tmp_path, leaves):
    """A client that sends its request and goes away (a pytest worker killed, a stand-in SIGKILLed
    just after it asked) leaves no command running: at once, before the warm process could send
    the PID; or after the PID line came, unread (its socket is then reset, not closed). The
    command runs in a folder of its own, by which it is found."""
    conn, folder = _ask_for_a_long_run(warm._instance().path, tmp_path)
    try:
        if leaves == "with the PID unread":
            assert select.select([conn], [], [], 120)[0], "no PID line from the warm process within 120 s"
    finally:
        conn.close()  # before reading the answer
    assert warm.run(["--version"], dict(os.environ), ROOT, timeout=120).returncode == 0  # served after the one above
    _none_left_in(folder, "their client left")


def test_a_command_ends_with_the_warm_process_that_forked_it(tmp_path):
    """The warm process dies with the pytest run that started it; its commands die with it rather
    than train on with no one to answer or stop them (a run of 100,000 steps here, its client
    still connected). A warm process of this test's own, SIGKILLed."""
    own = warm._Warm.start()
    try:
        own.wait_ready()
        conn, folder = _ask_for_a_long_run(own.path, tmp_path)
        with conn:
            assert b"pid" in conn.makefile("rb").readline()  # forked
            os.kill(own.pid, signal.SIGKILL)
            _none_left_in(folder, "the warm process was killed")
    finally:
        own.close()


def _ask_for_a_long_run(path: str, tmp_path: Path) -> tuple[socket.socket, Path]:
    """Connected to the warm process at `path`, asked for a run of 100,000 steps whose working
    folder is its own (returned, with the connection, by which the test finds its processes);
    its stdio is /dev/null, this process's copies closed once sent."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    recipe = write_recipe(tmp_path, train={"max_steps": 100_000})
    request = json.dumps({"argv": ["run", str(recipe), "--out", str(tmp_path / "run")], "cwd": str(folder),
                          "env": {**os.environ, "EMBER_HOME": str(tmp_path / "home")}})
    stdio = [os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY), os.open(os.devnull, os.O_WRONLY)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        socket.send_fds(conn, [request.encode() + b"\n"], stdio)
    except BaseException:
        conn.close()
        raise
    finally:
        for fd in stdio:
            os.close(fd)
    return conn, folder


def _none_left_in(folder, since: str) -> None:
    """No process but zombies has `folder` as its working folder, at the latest 60 s from now."""
    import psutil

    def in_folder() -> list[int]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.cwd() == str(folder) and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p.pid)
        return found
    deadline = time.monotonic() + 60
    while (left := in_folder()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes still running in {folder} 60 s after {since}: {left}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_command_started_by_a_warm_one_ends_as_a_fresh_one_would(tmp_path):
    """The stand-in for `python -m ember` (a rank, a supervised child) has the command forked and
    leaves its parent the same ending: its exit code, death by its own signal, a signal passed
    on to it (SIGTERM: checkpoint and exit 75), and the command gone when the stand-in is killed."""
    stand_in = warm.stand_in_path()
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home")}
    assert subprocess.run([stand_in, "plan", "missing.toml"], env=env, cwd=ROOT, capture_output=True).returncode == 1
    recipe = write_recipe(tmp_path, train={"max_steps": 100_000})
    killed = subprocess.run([stand_in, "run", str(recipe), "--out", str(tmp_path / "a")], cwd=ROOT, timeout=300,
                            env={**env, "EMBER_FAULT": "train.micro_batch@2"}, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    for sig, code in ((signal.SIGTERM, 75), (signal.SIGKILL, -signal.SIGKILL)):
        out = tmp_path / sig.name
        proc = subprocess.Popen([stand_in, "run", str(recipe), "--out", str(out)], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for_step(proc, out / "metrics.jsonl", 2)
        assert proc.poll() is None, "test setup: the run ended before the signal"
        pid = int((out / LOCK_FILE).read_text())  # the forked command's own PID
        proc.send_signal(sig)
        assert proc.wait(timeout=300) == code, proc.stderr.read()[-2000:]
        wait_until(f"the command (PID {pid}) gone after {sig.name} to its stand-in", lambda: not _alive(pid), 60, 0.05)


def test_one_warm_process_serves_the_whole_pytest_run():
    """Started once by the pytest process that starts the workers (conftest.py), not once per
    worker: its imports cost ~4.5 CPU-s, paid once per run on two cores."""
    if os.environ.get("EMBER_TEST_COLD"):
        pytest.skip("EMBER_TEST_COLD=1: every command is a fresh interpreter, there is no warm process")
    folder = os.environ.get(warm.SHARED)
    assert folder, f"${warm.SHARED} unset: each pytest worker would start a warm process of its own"
    assert warm.stand_in_path().startswith(folder + os.sep)
    import psutil
    with open(os.path.join(folder, "pid")) as f:
        process = psutil.Process(int(f.read()))
    starter = psutil.Process(os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid())
    assert process.ppid() == starter.pid, (process.cmdline(), starter.cmdline())
    assert os.path.exists(os.path.join(folder, warm.READY))
