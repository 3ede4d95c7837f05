"""$EMBER_HOME/scratch keeps no folder of a dead process (ember.scratch): a launcher, doctor or
preflight SIGKILLed inside its working folder left it there for good before; the next folder
made now removes it, and never one whose owner lives, that was only just made, or that another
host made (a $EMBER_HOME shared over NFS)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from ember.scratch import STALE_AFTER, UNLOCKED_AFTER, scratch
from tests.helpers import ROOT, ember_cmd, write_recipe

# Makes a scratch folder, says where, and waits inside it until its stdin closes (or it is killed).
OWNER = """
import sys
from ember.scratch import scratch
with scratch("owner-") as folder:
    (folder / "work").write_text("x")
    print(folder, flush=True)
    sys.stdin.read()
"""


def owner(home) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "EMBER_HOME": str(home)})
    return proc, proc.stdout.readline().strip()


def aged(folder: str, seconds: float) -> None:
    """As if nothing in `folder` had changed for `seconds`."""
    then = time.time() - seconds
    os.utime(folder, (then, then))


def test_the_folder_of_a_killed_owner_goes_with_the_next_one_made(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    killed, killed_folder = owner(tmp_path)
    just_killed, just_killed_folder = owner(tmp_path)
    living, living_folder = owner(tmp_path)
    try:
        for proc in (killed, just_killed):
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        aged(killed_folder, STALE_AFTER + 5)
        aged(living_folder, STALE_AFTER + 5)  # an owner that has been at it a while
        no_lock = tmp_path / "scratch" / "ranks-older-ember"  # made by an ember before ember.scratch
        no_lock.mkdir()
        recent_no_lock = tmp_path / "scratch" / "doctor-older-ember"
        recent_no_lock.mkdir()
        aged(str(no_lock), UNLOCKED_AFTER + 5)
        aged(str(recent_no_lock), STALE_AFTER + 5)  # may still be in use by that older ember
        # Another node's, through a $EMBER_HOME on NFS whose flocks this host may not see.
        other_host = tmp_path / "scratch" / "ranks-x1y2z3.another-node"
        other_host.mkdir()
        (other_host / ".lock").write_text("4242\n")
        aged(str(other_host), UNLOCKED_AFTER + 5)

        with scratch("next-") as mine:
            assert mine.is_dir() and mine.parent == tmp_path / "scratch"
            assert not os.path.exists(killed_folder), "a dead owner's folder was kept"
            assert not no_lock.exists(), "a day-old folder with no lock was kept"
            assert os.path.exists(just_killed_folder), "a free folder changed a moment ago was removed"
            assert os.path.exists(f"{living_folder}/work"), "a living owner's folder was removed"
            assert recent_no_lock.is_dir(), "an unlocked folder younger than a day was removed"
            assert other_host.is_dir(), "another host's folder was judged from here"
        assert not mine.exists(), "the block's own folder was left"
    finally:
        living.stdin.close()
        living.wait(60)
    assert not os.path.exists(living_folder), "an owner that ended normally left its folder"


def test_a_killed_runs_loader_workers_leave_their_folders_to_scratch_not_to_tmp(tmp_path, monkeypatch, request):
    """A run's data-loader workers each get a folder from multiprocessing (pymp-*) for the socket
    their batches are handed over by. A run SIGKILLed takes its workers along, and nothing removed
    those folders: every such kill left two in /tmp for good. They are made in the run's scratch
    folder now, which the next folder made under $EMBER_HOME removes once it is free."""
    # A short $EMBER_HOME: the workers' sockets are bound in it, and a socket's path holds at
    # most 107 bytes (under a longer one they stay in tempfile's folder, as before).
    home = Path(tempfile.mkdtemp(prefix="ember-home-"))
    monkeypatch.setenv("EMBER_HOME", str(home))
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    recipe = write_recipe(tmp_path, data={"workers": 2}, train={"max_steps": 100_000},
                          checkpoint={"every_steps": 0})
    run = subprocess.Popen(ember_cmd("run", recipe, "--out", tmp_path / "run", "--no-ledger"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "EMBER_HOME": str(home)}, start_new_session=True)
    workers, sockets = [], []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and run.poll() is None and len(sockets) < 2:
            workers = [p for p in psutil.Process(run.pid).children(recursive=True) if p.name() == "pt_data_worker"]
            sockets = [c.laddr for w in workers for c in listening(w)]
            time.sleep(0.05)
        assert len(sockets) >= 2, (f"waited for the run's two loader workers to listen; saw workers "
                                   f"{[w.pid for w in workers]}, sockets {sockets}, the run's exit code "
                                   f"{run.poll()}")
        outside = [s for s in sockets if not Path(s).is_relative_to(home / "scratch")]
        assert not outside, f"loader workers' sockets outside $EMBER_HOME/scratch: {outside}"
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the group this test made: the run and its workers
        run.wait(60)
    psutil.wait_procs(workers, timeout=60)
    folders = {Path(s).parents[1] for s in sockets}  # scratch/loader-*.HOST/pymp-*/listener-*
    assert all(f.is_dir() for f in folders), folders
    for f in folders:
        aged(str(f), STALE_AFTER + 5)
    with scratch("next-"):
        left = [f for f in folders if f.exists()]
        assert not left, f"the killed run's loader folders were kept: {left}"


def listening(p: psutil.Process) -> list:
    try:
        return [c for c in p.net_connections(kind="unix") if c.laddr]
    except psutil.Error:  # gone meanwhile
        return []


# A process's lifelong scratch folder, and a forked child's (which exits through atexit, as a
# forked `ember` command of the tests' warm process does).
LIFELONG = """
import os, sys
from ember.scratch import for_this_process
mine = for_this_process("life-")
assert for_this_process("life-") == mine
pid = os.fork()
if pid == 0:
    print(for_this_process("life-"), flush=True)
    sys.exit(0)
os.waitpid(pid, 0)
print(mine, mine.is_dir(), flush=True)
"""


def test_a_lifelong_folder_is_the_process_own_and_goes_at_its_exit_not_at_a_forked_childs(tmp_path):
    done = subprocess.run([sys.executable, "-c", LIFELONG], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "EMBER_HOME": str(tmp_path)}, timeout=120)
    assert done.returncode == 0, done.stderr
    child, parent = done.stdout.splitlines()
    mine, there = parent.rsplit(" ", 1)
    assert child != mine, "a forked child was handed its parent's folder"
    assert there == "True", "a forked child's exit removed its parent's folder"
    assert not os.path.exists(mine) and not os.path.exists(child), "a folder was left at exit"
