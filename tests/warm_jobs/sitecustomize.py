"""Loaded (PYTHONPATH, tests.helpers.warm_children_env) by every interpreter of a service a test
starts (tests.serve_harness.Serve: the service, its jobs' supervisors and what they start), and of
bench/gpu.py under tests/bench/test_gpu_script.py. Each `python -m ember ...` such a process
starts, but a job's supervisor (`--restarts`), starts the warm process's stand-in instead
(tests/warm.py), which has the command forked from the warm process of the pytest run: a
supervisor's training child, the service's `ember plan` child, the script's runs. They skip ~2.7 s
of imports each, as the tests' own commands do.

The supervisor stays a fresh interpreter, as the service starts it: the service signals it, kills
its tree, and adopts it after a restart by PID and start time. Its child is the stand-in, a real
process under it that passes the supervisor's signals on and dies with the command; what walks the
tree below it sees through it with tests.warm.tree. Inert without $EMBER_TEST_WARM_JOBS: only
subprocess is imported."""

import os
import sys

_STAND_IN = os.environ.get("EMBER_TEST_WARM_JOBS")
if _STAND_IN:
    import subprocess

    _init = subprocess.Popen.__init__

    def _forked(self, args, *rest, **kwargs):
        if isinstance(args, (list, tuple)) and [str(a) for a in args[:3]] == [sys.executable, "-m", "ember"] \
                and "--restarts" not in map(str, args):
            args = [_STAND_IN, *args[3:]]
        _init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = _forked
