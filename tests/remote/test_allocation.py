"""What an allocation's end means (ember.remote.allocation.decide), for every way the training
can end under the signals the allocation passes on. Seen in tests/remote/test_slurm.py under
load: the allocation's USR1 reached a training as it exited after its last step, srun reported
138, and the job was recorded as failed though every step was done; now it is requeued (a
resume from the newest checkpoint finishes it), and the training no longer dies of a late
signal (tests/e2e/test_resume.py::test_a_stop_signal_after_the_last_step_leaves_the_run_completed)."""

from __future__ import annotations

import signal

import pytest

from ember.remote.allocation import decide

USR1, TERM = int(signal.SIGUSR1), int(signal.SIGTERM)


@pytest.mark.parametrize("code, reason, budget_left, ending", [
    (0, "", True, "completed"),
    (0, "allocation-end", True, "completed"),            # the signal came as it finished: it finished
    (75, "allocation-end", True, "requeue"),
    (75, "allocation-end", False, "limit"),
    (75, "limit", True, "limit"),
    (75, "terminated", True, "interrupted"),
    (1, "terminated", True, "interrupted"),              # however srun ended after Slurm's TERM
    (128 + USR1, "allocation-end", True, "requeue"),     # srun: the task killed by the USR1 passed on
    (-USR1, "allocation-end", True, "requeue"),
    (128 + TERM, "limit", True, "limit"),
    (128 + USR1, "", True, "failed"),                    # a USR1 we did not pass on
    (75, "", True, "failed"),                            # it stopped with nobody asking
    (1, "allocation-end", True, "failed"),
    (70, "allocation-end", True, "failed"),
])
def test_each_ending(code, reason, budget_left, ending):
    assert decide(code, reason, budget_left) == ending

