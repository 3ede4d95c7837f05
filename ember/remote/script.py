"""What a remote job is on the cluster: its spec (`job.json` in its folder), the batch script
sbatch runs, and the command each node runs. Pure: text from dataclasses.

The batch script `exec`s ember's allocation process (ember.remote.allocation), so the signal
`--signal=B:USR1@S` sends to the batch shell reaches ember itself; that process starts the
training under `srun` (one task per node; torchrun's launcher inside each for its ranks), which
forwards signals to the tasks.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPEC_FILE = "job.json"
SCRIPT_FILE = "job.sh"
OUTCOME_FILE = "outcome.json"
ALLOCATIONS_FILE = "allocations.json"
DATA_SUMS = "data.sha256"


@dataclass
class JobSpec:
    name: str
    dir: str                      # the job's folder on the cluster
    python: str                   # the Python with ember there
    nodes: int
    nproc: int                    # ranks per node
    budget_seconds: float         # wall-clock the job may hold over all its allocations (its limits)
    time_minutes: int             # one allocation's --time
    signal_seconds: int           # --signal=B:USR1@this: checkpoint before the allocation ends
    partition: str = ""
    account: str = ""
    gres: str = ""
    sbatch_args: list[str] = field(default_factory=list)

    @property
    def recipe(self) -> str:
        return f"{self.dir}/recipe.toml"

    @property
    def out(self) -> str:
        return run_folder(self.dir, self.name)

    @property
    def ledger(self) -> str:
        return f"{self.dir}/ledger.db"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def read(cls, folder: Path) -> JobSpec:
        return cls(**json.loads((folder / SPEC_FILE).read_text()))


def run_folder(job_dir: str, name: str) -> str:
    """The job's run folder on the cluster, named as the job (a run's id starts with its folder's name)."""
    return f"{job_dir}/{name}"


def time_minutes(budget_seconds: float, signal_seconds: int, partition_minutes: int) -> int:
    """One allocation's --time. The job stops itself at its budget (ember.remote.allocation), so
    Slurm's limit is a backstop: the budget plus a grace long enough that Slurm's warning, which may
    come 60 s early, never comes before the job's own stop. When the partition's longest allocation
    is shorter, that: the job checkpoints at each allocation's end and requeues itself."""
    own = math.ceil((budget_seconds + 60 + signal_seconds) / 60) + 1
    return min(own, partition_minutes) if partition_minutes else own


def batch_script(spec: JobSpec) -> str:
    """The batch script for `sbatch --parsable`."""
    options = [f"--job-name=ember-{spec.name}", f"--nodes={spec.nodes}", "--ntasks-per-node=1",
               f"--time={spec.time_minutes}", f"--signal=B:USR1@{spec.signal_seconds}", "--requeue",
               "--open-mode=append", f"--output={spec.dir}/slurm-%j.out", f"--chdir={spec.dir}"]
    options += [f"--partition={spec.partition}"] * bool(spec.partition)
    options += [f"--account={spec.account}"] * bool(spec.account)
    options += [f"--gres={spec.gres}"] * bool(spec.gres)
    options += spec.sbatch_args
    lines = ["#!/bin/bash"] + [f"#SBATCH {o}" for o in options] + [
        f"# ember remote job {spec.name}, written by `ember submit --target`. The allocation's process is",
        "# ember's own (exec), so Slurm's USR1 before the time limit reaches it; it checkpoints, then",
        "# requeues the job while its limits allow (ember.remote.allocation).",
        f"exec {shlex.quote(spec.python)} -m ember remote _allocation {shlex.quote(spec.dir)}", ""]
    return "\n".join(lines)


def node_command(spec: JobSpec, rdzv: str) -> list[str]:
    """What `srun` starts on every node: `ember run` of the staged recipe into the job's run folder,
    with its ledger; across nodes each task adds its --node-rank from SLURM_NODEID."""
    run = [spec.python, "-m", "ember", "run", spec.recipe, "--out", spec.out, "--ledger", spec.ledger]
    if spec.nproc > 1 or spec.nodes > 1:
        run += ["--nproc", str(spec.nproc)]
    srun = ["srun", f"--nodes={spec.nodes}", f"--ntasks={spec.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if spec.nodes == 1:
        return srun + run
    run += ["--nnodes", str(spec.nodes), "--rdzv", rdzv]
    return srun + ["sh", "-c", 'exec "$@" --node-rank "$SLURM_NODEID"', "ember-node"] + run
