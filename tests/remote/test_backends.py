"""The registry of remote backends: each kind is a class that implements the RemoteBackend
protocol, a target of a kind ember does not know is refused naming the kinds it does, and nothing
in ember.remote but a backend's own module speaks an engine's commands."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from ember.errors import EmberError
from ember.policy.targets import load_targets
from ember.remote.backend import RemoteBackend
from ember.remote.backends import BACKENDS, backend_for, title
from ember.remote.slurm import SlurmBackend
from tests.remote.test_cli import TARGET

REMOTE = Path(__file__).resolve().parents[2] / "ember" / "remote"
METHODS = ("submit", "resubmit", "status", "logs", "cancel", "fetch")


def test_every_backend_implements_the_protocol_under_its_own_kind():
    assert BACKENDS["slurm"] is SlurmBackend and title("slurm") == "Slurm"
    assert sorted(n for n, f in vars(RemoteBackend).items() if inspect.isfunction(f) and n[0] != "_") == \
        sorted(METHODS)
    for kind, cls in BACKENDS.items():
        assert cls.kind == kind and cls.title
        for name in METHODS:
            want = list(inspect.signature(getattr(RemoteBackend, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (kind, name)
    backend = backend_for("slurm", "login.hpc", ["-p", "2222"])
    assert isinstance(backend, SlurmBackend) and backend.shell.where() == "login.hpc"


def test_an_unknown_kind_is_refused_naming_the_known_ones(tmp_path):
    f = tmp_path / "targets.toml"
    f.write_text(TARGET.replace('kind = "slurm"', 'kind = "kubernetes"'))
    with pytest.raises(EmberError, match=r"\[targets.lab\] kind = 'kubernetes': not a remote backend ember knows; "
                                         r"known kinds: 'slurm'"):
        load_targets(BACKENDS, f)
    f.write_text(TARGET)
    assert load_targets(BACKENDS, f)["lab"].kind == "slurm"
    with pytest.raises(EmberError, match="remote backend kind 'kubernetes': ember knows 'slurm'"):
        backend_for("kubernetes", "", [])


def test_only_a_backends_module_runs_its_engines_commands():
    """submit, tracking, stage and the registry speak the protocol: no sbatch, squeue, sacct,
    scontrol or scancel outside slurm.py (the batch script and the allocation process are the job
    Slurm runs)."""
    engine = re.compile(r"[\"'](sbatch|squeue|sacct|scontrol|scancel)[\"']")
    for path in sorted(REMOTE.glob("*.py")):
        if path.name not in ("slurm.py", "allocation.py", "script.py"):
            assert not engine.search(path.read_text()), path.name
