"""Remote targets: `targets.toml`, where a job may go, what it costs there, and the caps on what
one job, and one month of jobs, may spend.

    [targets.cluster]
    kind = "slurm"                   # the backend (ember.remote.backends: a kind it does not know is refused)
    host = ""                        # "": the Slurm client runs on this machine; else an SSH host
    ssh_options = []                 # e.g. ["-p", "2222", "-i", "/home/alice/.ssh/cluster"]
    partition = "gpu"
    account = "proj-42"
    device = "H100"                  # the device type, for the plan ("cpu" for CPU nodes)
    devices_per_node = 4
    peak_tflops = 989.0              # one device's peak at the recipe's precision (0: ember's table)
    device_hour_price = 2.5
    currency = "USD"
    max_nodes = 2                    # caps: a job's limits must be within them
    max_wall_hours = 24
    max_device_hours = 100
    max_cost_per_job = 250
    max_cost_per_month = 2000
    allowed_classifications = ["public", "internal"]
    stage_dir = "/scratch/alice/ember"   # on the cluster: staged data, the job's run folder
    python = "/opt/ember/bin/python"     # on the cluster: a Python with ember ("": this one, local only)
    allocation_minutes = 240         # the partition's longest allocation: a longer job is requeued
    signal_seconds = 300             # warn the job this long before an allocation ends

Read like the registry, by the config engine (ember.config): `./targets.toml` and
`$EMBER_HOME/targets.toml` (a name in both is refused), or `--targets FILE` alone. Every cap is
required: a target without one is refused, never given a default. docs/targets.md is generated
from the fields below (`ember settings targets --markdown`).
The caller names the kinds it can run (the remote layer's backends: policy sits below it).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from ember.config import build_entries, derived, read_toml, reference, rows, setting
from ember.errors import EmberError
from ember.paths import home
from ember.policy.registry import CLASSIFICATIONS, distinct

CAPS = ("max_nodes", "max_wall_hours", "max_device_hours", "max_cost_per_job", "max_cost_per_month")


@dataclass
class Target:
    kind: str = setting("slurm", "The remote backend that runs its jobs (ember.remote.backends: 'slurm').")
    host: str = setting("", "'' when the backend's client (Slurm's sbatch) runs on this machine; else the "
                        "SSH host (user@login-node) where it does.")
    ssh_options: list[str] = setting(list, "Options for ssh to that host, e.g. ['-p', '2222', '-i', "
                                     "'/home/me/.ssh/cluster'] (BatchMode is always on).", factory=True)
    partition: str = setting("", "Slurm partition ('' = the cluster's default).")
    account: str = setting("", "Slurm account ('' = the user's default).")
    device: str = setting("cpu", "Device type of a node ('cpu' for CPU nodes).")
    devices_per_node: int = setting(1, "Devices a job uses on each node (its ranks per node).", min=1)
    peak_tflops: float = setting(0.0, "One device's peak TFLOP/s at the recipe's precision, for the plan "
                                 "(0: ember's table, or this machine's measured CPU peak).", min=0)
    device_hour_price: float | None = setting(None, "Price of one device for one hour.", min=0, required=True)
    currency: str = setting("USD", "Currency of the price and the cost caps.")
    max_nodes: int | None = setting(None, "Cap: nodes one job may take.", min=1, required=True)
    max_wall_hours: float | None = setting(None, "Cap: wall-clock hours one job may hold.", min=0,
                                           exclusive_min=True, required=True)
    max_device_hours: float | None = setting(None, "Cap: device-hours one job may use.", min=0,
                                             exclusive_min=True, required=True)
    max_cost_per_job: float | None = setting(None, "Cap: what one job may cost.", min=0, required=True)
    max_cost_per_month: float | None = setting(None, "Cap: what this month's jobs here may cost together.",
                                               min=0, required=True)
    allowed_classifications: list[str] = setting(list, "Dataset classifications allowed here; none: "
                                                 "no dataset may go.", factory=True)
    stage_dir: str = setting("", "Absolute folder on the cluster for staged data and run folders.",
                             required=True)
    python: str = setting("", "The Python with ember installed on the cluster ('' = this one; local "
                          "controller only).")
    allocation_minutes: int = setting(0, "Longest allocation the partition grants; a longer job runs as "
                                      "requeued allocations (0 = the job's whole wall-time limit).", min=0)
    signal_seconds: int = setting(120, "Slurm signals the job this long before an allocation ends, so it "
                                  "checkpoints (arrives up to 60 s earlier).", min=10, max=65535)
    gres: str = setting("", "Generic resources per node, e.g. 'gpu:4' ('' = none).")
    sbatch_args: list[str] = setting(list, "Further sbatch options, e.g. ['--qos=high'].", factory=True)
    name: str = derived("set from the table name")

    def interpreter(self) -> str:
        return self.python or sys.executable

    @property
    def price(self) -> float:
        return self.device_hour_price or 0.0


Targets = dict[str, Target]


def load_targets(kinds: Collection[str], explicit: Path | None = None) -> Targets:
    """Every target, validated, each of a backend `kinds` names; missing files are none (unless
    named explicitly)."""
    if explicit is not None and not explicit.is_file():
        raise EmberError(f"--targets {explicit}: no such file")
    # the project's and the machine's: once, when they are the same file (run from $EMBER_HOME)
    files = [explicit] if explicit is not None else distinct([Path("targets.toml"), home().targets_toml])
    out: Targets = {}
    sources: dict[str, Path] = {}
    for path in files:
        for name, t in _read(path, kinds).items():
            if name in out:
                raise EmberError(f"{path}: target '{name}' is also defined in {sources[name]}; keep one")
            out[name], sources[name] = t, path
    return out


def _read(path: Path, kinds: Collection[str]) -> Targets:
    if not path.is_file():
        return {}
    raw, source = read_toml(path)
    out = build_entries(Target, raw, "targets", source,
                        "every cap, the price and stage_dir must be stated (a missing limit is a refusal, "
                        "never a default)")
    for name, t in out.items():
        at = source.where
        if t.kind not in kinds:
            raise EmberError(f"{at('targets', name, 'kind')} = {t.kind!r}: not a remote backend ember knows; "
                             f"known kinds: {', '.join(map(repr, kinds))}")
        bad = [c for c in t.allowed_classifications if c not in CLASSIFICATIONS]
        if bad:
            raise EmberError(f"{at('targets', name, 'allowed_classifications')}: {bad[0]!r} is not one of "
                             f"{', '.join(CLASSIFICATIONS)}")
        if not os.path.isabs(t.stage_dir):
            raise EmberError(f"{at('targets', name, 'stage_dir')} = {t.stage_dir!r}: write an absolute folder "
                             f"on the cluster")
        if t.host and not t.python:
            raise EmberError(f"{at('targets', name, 'host')} = {t.host!r}: python is required with an SSH host "
                             f"(set python to the Python with ember there)")
        if t.host and not re.fullmatch(r"[A-Za-z0-9_.@:-]+", t.host):
            raise EmberError(f"{at('targets', name, 'host')} = {t.host!r}: write an SSH destination, user@host")
        t.name = name
    return out


HEADER = """# Remote targets (`targets.toml`)

Generated by `ember settings targets --markdown > docs/targets.md` from `ember/policy/targets.py`.
Where a job may go with `ember submit --target NAME`, what it costs there, and the caps on what
one job, and one month of jobs, may spend. Read from `./targets.toml` and
`$EMBER_HOME/targets.toml` (a name in both is refused), or `--targets FILE` alone. Each target is
a table `[targets.NAME]` (NAME: letters, digits, '_', '.', '-'). A key marked `required` must be
stated: a missing cap is a refusal, never a default. An error names the file, the line and the key.
"""


def targets_reference() -> str:
    """docs/targets.md: every key of a target with its type, default, range and meaning."""
    return reference(HEADER, rows({"targets.NAME": Target}))
