"""The job state machine (ember.ledger.job_states): one declared table per kind of job, one module
that changes states, local and remote, and a service that never imports torch (each job is its
own process)."""

import subprocess
import sys
from pathlib import Path

from ember.ledger.job_states import LOCAL
from tests.helpers import callers_of

FINAL, STATES, TRANSITIONS, allowed = LOCAL.final, LOCAL.states, LOCAL.transitions, LOCAL.allowed

EMBER = Path(__file__).resolve().parents[2] / "ember"


def test_every_state_is_declared_with_its_transitions_in_the_docstring():
    import ember.ledger.job_states as jobs
    assert set(TRANSITIONS) == set(STATES)
    for src, dsts in TRANSITIONS.items():
        assert src in jobs.__doc__
        for dst in dsts:
            assert dst in STATES and allowed(src, dst)
    # Final: only a hand's requeue takes a failed or cancelled job back to the queue (issue 24, item 12).
    assert {s: TRANSITIONS[s] for s in FINAL} == {"completed": (), "failed": ("queued",), "cancelled": ("queued",)}
    assert "requeue" in jobs.__doc__ and "purge" in jobs.__doc__
    assert not allowed("completed", "queued") and not allowed("queued", "running")


def test_only_the_state_machine_module_changes_a_jobs_state():
    """Nothing but ember/ledger/job_states.py calls ember.ledger.job_rows.set_state or removes a
    job's row, or calls ember.ledger.remote_rows.set_state (however imported)."""
    for module, function in (("ember.ledger.job_rows", "set_state"), ("ember.ledger.job_rows", "remove"),
                             ("ember.ledger.remote_rows", "set_state")):
        callers = callers_of(module, function)
        assert callers == ["ledger/job_states.py"], (module, function, callers)


def test_the_service_does_not_import_torch():
    code = ("import sys, ember.web.server, ember.web.api, ember.sched.service, ember.cli.serve; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
