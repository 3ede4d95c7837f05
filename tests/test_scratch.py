"""$EMBER_HOME/scratch keeps no folder of a dead process (ember.scratch): a launcher, doctor or
preflight SIGKILLed inside its working folder left it there for good before; the next folder
made now removes it, and never one whose owner lives, that was only just made, or that another
host made (a $EMBER_HOME shared over NFS)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ember.scratch import STALE_AFTER, UNLOCKED_AFTER, scratch
from tests.helpers import ROOT

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
