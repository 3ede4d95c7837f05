"""Kill -9, run it again (issue 26): the README's promise as a user tries it. The same command,
started the instant after a SIGKILL, resumes (a child of the dead run that still lives does
not keep the folder locked) and ends bit-for-bit where the uninterrupted run ends; a console
that goes away, a hang-up, or a retired checkpoint that cannot be deleted does not end it."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time

import psutil
import pytest

from tests.e2e.test_resume import uninterrupted
from tests.helpers import (
    ROOT,
    assert_same_result,
    ember_cmd,
    losses,
    run_ember,
    start_ember,
    stop,
    wait_for_step,
    wait_until,
    write_recipe,
)

pytestmark = pytest.mark.e2e


def trainer_of(run, supervised: bool) -> psutil.Process:
    """The process that trains: the command itself, or the supervisor's child."""
    top = psutil.Process(run.pid)
    if not supervised:
        return top
    return psutil.Process(wait_until("the supervisor's training process",
                                     lambda: [p.pid for p in top.children() if "ember" in " ".join(p.cmdline())],
                                     120, every=0.05)[0])


@pytest.mark.parametrize("supervised", [False, True], ids=["plain", "supervised"])
def test_a_rerun_right_after_kill_9_resumes_though_a_loader_worker_lives_on(supervised, tmp_path):
    """The run's data-loader worker (forked) is held stopped, as one is that has not yet noticed
    its parent's death (torch looks every 5 s); the run's processes are SIGKILLed and the same
    command runs again at once: it resumes instead of "in use by another ember process"."""
    recipe = write_recipe(tmp_path, data={"workers": 1}, train={"max_steps": 30})
    out = tmp_path / "run"
    restarts = ["--restarts", "1"] if supervised else []
    first = start_ember("run", recipe, "--out", out, *restarts, env={"EMBER_FAULT_DATA_DELAY": "0.2"})
    held: list[psutil.Process] = []
    try:
        wait_for_step(first, out / "metrics.jsonl", 6, timeout=180)
        wait_until("the first checkpoint", lambda: (out / "checkpoints" / "step-000000005").is_dir(), 120, 0.05)
        trainer = trainer_of(first, supervised)
        held = wait_until("the loader worker", lambda: trainer.children(recursive=True), 60, every=0.05)
        for p in held:
            p.send_signal(signal.SIGSTOP)
        assert first.poll() is None, "test setup: the run ended before it was killed"
        trainer.send_signal(signal.SIGKILL)
        if supervised:
            first.send_signal(signal.SIGKILL)
        first.wait(60)
        again = run_ember("run", recipe, "--out", out, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "resuming from" in again.stderr
    finally:
        for p in held:
            with contextlib.suppress(psutil.Error):
                p.kill()
        stop(first)


KILLS = (2, 12)  # (make test, make soak)
DELAY = {"EMBER_FAULT_DATA_DELAY": "0.01"}  # s per micro-batch: a run long enough to be killed in


def promise(kills: int) -> dict:
    """The recipe: about 100 steps per kill (an attempt trains up to 1.5 s before its kill)."""
    return {"data": {"workers": 1}, "train": {"max_steps": 100 * kills},
            "checkpoint": {"every_steps": 4, "keep_last": 2}}


@pytest.mark.soak
def test_kill_9_at_a_random_moment_and_rerun_at_once_ends_bit_identical(tmp_path, soak):
    """As the README says: `ember run` (the command, started cold), kill -9 at a random moment
    while it trains, the same command again with no pause; at the end, losses and weights equal
    the uninterrupted run's."""
    rng = random.Random(20261203)
    sections = promise(KILLS[soak])
    recipe = write_recipe(tmp_path, **sections)
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    kills = 0
    while kills < KILLS[soak]:
        run = start_ember("run", recipe, "--out", out, env=DELAY, warm=True)
        try:
            before = metrics.read_text().count("\n") if metrics.exists() else 0
            wait_for_step(run, metrics, before + 1, timeout=180)  # it trains: start-up is not the target
            time.sleep(rng.uniform(0, 1.5))
            if run.poll() is None:
                run.send_signal(signal.SIGKILL)
            _, err = run.communicate(timeout=120)
            if run.returncode == 0:
                break  # it finished before the kill landed
            assert run.returncode == -signal.SIGKILL, f"attempt {kills + 1}: exit {run.returncode}: {err[-2000:]}"
            kills += 1
        finally:
            stop(run)
    last = run_ember("run", recipe, "--out", out, timeout=300)
    assert last.returncode == 0, last.stderr[-2000:]
    assert kills >= KILLS[soak] - 1, f"only {kills} kills landed"
    assert_same_result(out, uninterrupted(f"promise-{KILLS[soak]}", sections))


@pytest.mark.parametrize("how", ["stdout", "both", "both+SIGHUP"])
def test_a_console_that_goes_away_does_not_end_the_run(how, tmp_path):
    """`ember run ... | head -1` (stdout), `... 2>&1 | head -1` (both), and the same followed by
    a hang-up (an SSH session that dropped): the run trains on, its output continues in the run
    folder's console.log; it completes (exit 0), or on SIGHUP checkpoints and exits 75. Before,
    the first write after the reader's end raised BrokenPipeError into the run (a crash), and
    SIGHUP killed it."""
    hang_up = how.endswith("SIGHUP")
    recipe = write_recipe(tmp_path, train={"max_steps": 400 if hang_up else 30})
    out = tmp_path / "run"
    both = how.startswith("both")
    run = subprocess.Popen(ember_cmd("run", recipe, "--out", out), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT if both else subprocess.DEVNULL, cwd=ROOT, env=os.environ)
    try:
        if both:
            assert run.stdout.readline()  # the reader takes one line, then is gone
        run.stdout.close()
        if hang_up:
            wait_for_step(run, out / "metrics.jsonl", 3, timeout=180)
            run.send_signal(signal.SIGHUP)
            assert run.wait(180) == 75
            stopped = losses(out)[-1][0]
            assert (out / "checkpoints" / f"step-{stopped:09d}").is_dir()  # checkpointed where it stopped
        else:
            assert run.wait(300) == 0
            assert [step for step, _ in losses(out)] == list(range(1, 31))
        log = (out / "console.log").read_text()
        assert "went away (Broken pipe); its output continues here" in log, log
        assert ("SIGHUP: newest committed checkpoint" in log) if hang_up else ("completed 30 steps" in log), log
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()


RETIRE = {"train": {"max_steps": 24}, "checkpoint": {"every_steps": 5, "keep_last": 1, "loss_budget_seconds": 0}}


def chattr(flag: str, path) -> bool:
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_a_retired_checkpoint_that_cannot_be_deleted_does_not_stop_the_run(tmp_path):
    """step-5 holds a file nobody may delete (immutable: as a file held open on NFS, or a folder
    something writes into, cannot be); the run retires step-5 at step 10 and cannot delete it.
    Every committed checkpoint is safe, so it trains on, says why once (the operating system's
    words), and retries at each checkpoint. Before: the next checkpoint stopped the run with
    "Free disk space and run the same command", which frees nothing."""
    recipe = write_recipe(tmp_path, **RETIRE)
    out = tmp_path / "run"
    killed = run_ember("run", recipe, "--out", out, env={"EMBER_FAULT": "ckpt.renamed@1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    pinned = out / "checkpoints" / "step-000000005" / "pinned"
    pinned.touch()
    if not chattr("+i", pinned):
        pytest.skip("cannot make a file immutable here (chattr +i needs root and ext4, xfs or btrfs)")
    try:
        result = run_ember("run", recipe, "--out", out)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Free disk space" not in result.stderr
        warned = [line for line in result.stderr.splitlines() if "could not delete" in line]
        assert len(warned) == 1, result.stderr[-3000:]
        assert ".del-step-000000005: Operation not permitted" in warned[0] and "training goes on" in warned[0]
    finally:
        for leftover in (out / "checkpoints").glob(".del-step-000000005*/pinned"):
            chattr("-i", leftover)
    assert_same_result(out, uninterrupted("retire", RETIRE))


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_console_log_that_is_a_link_is_not_followed(tmp_path, link):
    """A run folder someone else made with `console.log` a link to a file elsewhere (a folder
    holding only console.log is accepted as a run's start): when `ember run`'s console went away,
    its output was appended to whatever file the link named (as root: any file); a hard link too."""
    import errno

    from ember.cli import render
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    if link == "symbolic":
        (tmp_path / "console.log").symlink_to(precious)
    else:  # before, O_NOFOLLOW let it through: the output was appended to the file it shares
        os.link(precious, tmp_path / "console.log")
    render.keep_output_in(tmp_path / "console.log")
    fd = os.open(os.devnull, os.O_WRONLY)  # stands for stdout: console_lost repoints it
    try:
        render.console_lost(fd, OSError(errno.EPIPE, "Broken pipe"))
        os.write(fd, b"step 1 ...\n")
    finally:
        os.close(fd)
        render._lost.pop(fd, None)
        render._fallback.clear()
    assert precious.read_text() == "keep me\n"
