"""The remote backends ember runs jobs on, by the `kind` of a target in targets.toml. A plain dict:
a new engine (Kubernetes, SkyPilot, ...) is one module with a class that implements
ember.remote.backend.RemoteBackend, and one line here."""

from __future__ import annotations

from collections.abc import Callable

from ember.errors import EmberError
from ember.remote.backend import RemoteBackend
from ember.remote.shell import Shell
from ember.remote.slurm import SlurmBackend

BACKENDS: dict[str, Callable[[Shell], RemoteBackend]] = {
    SlurmBackend.kind: SlurmBackend,
}


def backend_for(kind: str, host: str, ssh_options: list[str]) -> RemoteBackend:
    """The backend of `kind`, its client reached on `host` ('' this machine) with `ssh_options`."""
    if kind not in BACKENDS:
        raise EmberError(f"remote backend kind {kind!r}: ember knows {', '.join(map(repr, BACKENDS))}")
    return BACKENDS[kind](Shell(host, ssh_options))


def title(kind: str) -> str:
    """How people name the engine of `kind` ("Slurm", as in "Slurm job 42")."""
    backend = BACKENDS.get(kind)
    return getattr(backend, "title", kind)
