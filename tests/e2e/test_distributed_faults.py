"""Two ranks on this CPU, and the ways a distributed run fails: a rank SIGKILLed at a fixed point
and at random moments (DDP and FSDP), and a rank that hangs; each time the supervisor restarts
the group and the run ends bit-for-bit where the uninterrupted one did."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from tests.distributed_harness import ember_run, make_baselines, rank_pid
from tests.helpers import assert_same_result, losses, run_ember, start_ember


@pytest.fixture
def baselines():
    return make_baselines()


def test_a_rank_killed_mid_step_resumes_bit_for_bit(baselines, tmp_path):
    """SIGKILL of rank 1 inside step 7; the supervisor restarts the group from step 5."""
    out = tmp_path / "run"
    env = {"EMBER_FAULT": "train.micro_batch@7", "EMBER_FAULT_RANK": "1", "EMBER_FAULT_ONCE": str(tmp_path / "once")}
    done = run_ember("run", baselines["recipe"], "--out", out, "--no-ledger", "--nproc", "2", "--restarts", "2", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 failed first (killed by SIGKILL)" in done.stderr
    assert_same_result(out, baselines["ddp"])


# A pipeline's random kills (~2 min each) run in `make soak` only; `make test` kills a pipeline
# group mid-step in tests/e2e/test_pipeline.py and a pp+ddp group in tests/e2e/test_pipeline_ddp.py.
# pp+ddp: 2 stages x 2 replicas on 4 ranks, grad_accum 4 (two micro-batches per pipeline: 1F1B
# needs one per stage).
LAYOUTS = {"ddp": ("2", ()), "fsdp": ("2", ()), "pp": ("2", ()), "pp+ddp": ("4", ("train.grad_accum=4",))}
SOAK_ONLY = [pytest.mark.soak, pytest.mark.soak_only]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", pytest.param("pp", marks=SOAK_ONLY),
                                      pytest.param("pp+ddp", marks=SOAK_ONLY)])
def test_ranks_killed_at_random_moments_resume_bit_for_bit(baselines, tmp_path, strategy):
    """SIGKILL of a random rank at random moments (seeded: the same in every run of the suite),
    twice; the supervisor restarts the group each time from its last durable checkpoint."""
    rng = random.Random(12)
    nproc, extra = LAYOUTS[strategy]
    sets = [x for item in (f"distributed.strategy={strategy}", *extra) for x in ("--set", item)]
    base = baselines["ddp"]
    if strategy != "ddp":
        base = tmp_path / "base"
        ember_run(baselines["recipe"], base, "--nproc", nproc, *sets)
    out = tmp_path / "run"
    # Slowed input (it does not change what is computed): unslowed, the 12 steps took 0.2 s on a
    # quiet machine and the first kill landed after the run had completed.
    proc = start_ember("run", baselines["recipe"], "--out", out, "--no-ledger", "--nproc", nproc, "--restarts", "4",
                       *sets, env={"EMBER_FAULT_DATA_DELAY": "0.2"}, warm=True)
    try:
        for kill in range(2):
            deadline = time.monotonic() + 180
            while proc.poll() is None and time.monotonic() < deadline and len(losses_or_none(out)) < 2 + 4 * kill:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere in a step, a checkpoint, or between them
            if proc.poll() is None:
                os.kill(rank_pid(proc.pid, str(rng.randrange(int(nproc)))), signal.SIGKILL)
        out_text, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert err.count("failed first (killed by SIGKILL)") >= 1, err[-3000:]
    assert_same_result(out, base)


def losses_or_none(run: Path) -> list:
    try:
        return losses(run)
    except (OSError, ValueError, KeyError):
        return []


def test_a_hung_rank_is_named_and_the_group_restarts(baselines, tmp_path):
    """Rank 1 sleeps inside step 7 (a deadlocked loader, say): the watchdog calls it past its
    bound (here 2 s), names rank 1, dumps the stacks, and the supervisor restarts the group."""
    out = tmp_path / "run"
    env = {"EMBER_FAULT": "train.micro_batch@7", "EMBER_FAULT_RANK": "1", "EMBER_FAULT_HANG": "600",
           "EMBER_FAULT_ONCE": str(tmp_path / "once")}
    t0 = time.monotonic()
    done = run_ember("run", baselines["recipe"], "--out", out, "--no-ledger", "--nproc", "2", "--restarts", "1",
                     "--set", "distributed.hang_min_seconds=2", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - t0 < 300  # not the 600 s the rank slept for
    assert ("hang: rank 1 never arrived at all_reduce (loop.py:" in done.stderr
            and "in step 7; rank 0 waited there" in done.stderr), done.stderr[-3000:]
    assert "attempt 1 crashed (exit 70)" in done.stderr and "rank 0 failed first" not in done.stderr
    assert "rank 1: last step 6; step 7: not in a collective: faults.py" in done.stderr
    assert "rank 0: last step 6; step 7: in a collective" in done.stderr
    assert "Thread" in (out / "hang-rank1.txt").read_text()  # faulthandler's dump of every thread
    assert_same_result(out, baselines["ddp"])


def test_a_hung_rank_0_is_named_and_the_run_exits_70(baselines, tmp_path):
    """Rank 0, which writes the hang report, is itself the one stuck: it names itself, and the
    run ends 70 (unsupervised), saying what was saved."""
    out = tmp_path / "run"
    env = {"EMBER_FAULT": "train.micro_batch@7", "EMBER_FAULT_RANK": "0", "EMBER_FAULT_HANG": "600"}
    done = run_ember("run", baselines["recipe"], "--out", out, "--no-ledger", "--nproc", "2",
                     "--set", "distributed.hang_min_seconds=2", env=env)
    assert done.returncode == 70, done.stderr[-3000:]
    assert re.fullmatch(r"warning: hang: rank 0 never arrived at all_reduce \(loop\.py:\d+ train_step\) in step 7; "
                        r"rank 1 waited there [\d.]+ s; the group was stopped, exit 70; saved: checkpoint step 5, "
                        r"the newest committed, where a resume continues",
                        done.stderr.strip().splitlines()[-1]), done.stderr[-3000:]
    assert "failed first" not in done.stderr


def test_a_rank_that_dies_is_one_line(baselines, tmp_path):
    """SIGKILL of rank 1 inside step 7, unsupervised: one line names it and what was saved; the
    rank whose collective failed under it prints no traceback and promises no checkpoint."""
    out = tmp_path / "run"
    env = {"EMBER_FAULT": "train.micro_batch@7", "EMBER_FAULT_RANK": "1"}
    done = run_ember("run", baselines["recipe"], "--out", out, "--no-ledger", "--nproc", "2", env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    after = done.stderr.split("step 6/12")[1].strip().splitlines()[1:]  # what follows step 6's line
    assert len(after) == 1 and re.fullmatch(
        r"warning: rank 1 failed first \(killed by SIGKILL\); the group was torn down \(rank 0 (left when its "
        r"collective failed|stopped)\); saved: checkpoint step 5, the newest committed, where a resume continues",
        after[0]), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "with a checkpoint" not in done.stderr
