"""What a remote backend is: the engine that runs a job away from this machine (Slurm first). The
rest of ember.remote (submission through the gate, the job's state, bringing results back, the
commands) talks to this protocol only, never to an engine's own commands; ember.remote.backends
maps a target's `kind` to the class.

A backend reaches its engine through a Shell (this machine, or an SSH host) and keeps each job in
a folder there, `stage_dir/NAME`: the staged datasets, the recipe the job runs, its run folder
(named as the job) and its own ledger (`ledger.db`). What a backend must do:

    submit      stage the job's datasets into its new folder (verified on arrival), write what
                runs it there, queue it; the id the engine gave it. A failure leaves no folder.
    resubmit    queue it again in its folder under new limits (ember remote continue): its staged
                data and recipe stay, its run resumes from its newest checkpoint; the new id
    status      what the engine (and the job's own word about how it ended) says now, read as
                the state of the remote machine (ember.ledger.job_states) it puts the job in
    logs        the job's output from a byte offset, every allocation's
    cancel      ask the engine to end it (the run checkpoints first)
    fetch       copy its run folder back (less checkpoints; the newest once it ended) and a
                consistent copy of its ledger
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ember.events import Events
from ember.ledger.job_states import JobState
from ember.ledger.remote_rows import RemoteJobRow
from ember.policy.registry import Dataset
from ember.policy.targets import Target


@dataclass(frozen=True)
class Launch:
    """One job as a backend starts it, or starts it again."""
    name: str
    folder: str                          # its folder where the engine runs it
    python: str                          # the Python with ember there
    nodes: int
    budget_seconds: float                # the wall-clock it may hold over all its allocations (its limits)
    recipe: str = ""                     # a new job: the recipe it runs (its data at the staged copies)
    datasets: tuple[Dataset, ...] = ()   # a new job: the datasets to stage
    digests: Mapping[str, str] = field(default_factory=dict)  # a new job: each file's SHA-256 as the
                                         # gate read it; staging sends those bytes or nothing


@dataclass(frozen=True)
class Observed:
    """What the engine says of a job, read as the state it puts the job in."""
    state: JobState              # the job's current state when the engine does not know it (yet)
    why: str
    seen: Any = None             # the engine's own record of the job (a dataclass), for --json


class RemoteBackend(Protocol):
    """The engine behind targets of one `kind` (module docstring: what each method must do)."""

    kind: ClassVar[str]          # its `kind` in targets.toml
    title: ClassVar[str]         # how people name it: "Slurm" (as in "Slurm job 42")

    def submit(self, launch: Launch, target: Target, events: Events) -> str:
        """Stage, write and queue a new job; its id."""
        ...

    def resubmit(self, launch: Launch, target: Target, events: Events) -> str:
        """Queue a job again in its folder under new limits; its new id."""
        ...

    def status(self, job: RemoteJobRow) -> Observed:
        """The state the engine's view puts `job` in now."""
        ...

    def logs(self, job: RemoteJobRow, offset: int) -> bytes:
        """The job's output from byte `offset` (b'' when there is none yet)."""
        ...

    def cancel(self, job: RemoteJobRow, events: Events) -> None:
        """Ask the engine to end the job (it checkpoints first)."""
        ...

    def fetch(self, job: RemoteJobRow, out: Path, ledger: Path, final: bool) -> bool:
        """Copy the run folder into `out` and its ledger to file `ledger`; False before the run exists."""
        ...
