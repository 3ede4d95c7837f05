"""The Slurm backend (ember.remote.backend's protocol, kind "slurm"): a job staged into its folder
and queued with `sbatch`, followed through squeue, scontrol and sacct, cancelled with scancel, its
results copied back; the batch script and each node's command are ember.remote.script, the
process that owns each allocation ember.remote.allocation.

The client in its parsable formats: `sbatch --parsable`, `squeue -h -o` with a separator, `sacct -n
-P` and `scontrol show job -o`. Commands run through a Shell (this machine or an SSH host); parsing
is pure. squeue and scontrol know a job while it is queued or running (and for MinJobAge after);
sacct knows it from the accounting database, a few seconds late, for ever: `observe` asks scontrol
first and sacct when scontrol no longer knows the job. `state_from` reads what Slurm says, with the
outcome the job wrote itself, as a state of the remote job machine (ember.ledger.job_states).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ember.errors import EmberError
from ember.events import Events
from ember.ledger.job_states import JobState
from ember.ledger.remote_rows import RemoteJobRow
from ember.policy.targets import Target
from ember.remote import stage
from ember.remote.backend import Launch, Observed
from ember.remote.script import (ALLOCATIONS_FILE, DATA_SUMS, OUTCOME_FILE, SCRIPT_FILE, SPEC_FILE, JobSpec,
                                 batch_script, run_folder, time_minutes)
from ember.remote.shell import Shell

SQUEUE_FORMAT = "%i|%T|%r|%M|%l|%N"
SACCT_FIELDS = "JobID,State,ExitCode,Elapsed,Start,End,NodeList"
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD")
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT")


@dataclass(frozen=True)
class SlurmJob:
    id: str
    state: str               # Slurm's JOB_STATE, e.g. PENDING, RUNNING, COMPLETED, CANCELLED
    reason: str = ""
    restarts: int = 0        # how many times it was requeued
    exit_code: str = ""      # "code:signal"
    elapsed: str = ""
    nodes: str = ""
    source: str = ""         # which command said so

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


def parse_sbatch(out: str) -> str:
    """`sbatch --parsable` prints 'ID' or 'ID;CLUSTER'."""
    job = out.strip().splitlines()[-1].split(";")[0] if out.strip() else ""
    if not job.isdigit():
        raise EmberError(f"sbatch --parsable answered {out.strip()!r}, not a job id")
    return job


def parse_squeue(out: str, job_id: str) -> SlurmJob | None:
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 6 and parts[0] == job_id:
            return SlurmJob(job_id, parts[1], parts[2], elapsed=parts[3], nodes=parts[5], source="squeue")
    return None


def parse_scontrol(out: str) -> dict[str, str]:
    """`scontrol show job -o`: one line of KEY=VALUE pairs (values may hold spaces only in a few
    keys at the end, such as Command; those are not needed here)."""
    fields = {}
    for token in out.strip().split(" "):
        key, sep, value = token.partition("=")
        if sep and key:
            fields[key] = value
    return fields


def parse_sacct(out: str, job_id: str) -> SlurmJob | None:
    """`sacct -n -P -X --format SACCT_FIELDS`: the allocation's line ('CANCELLED by 0' -> CANCELLED)."""
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 7 and parts[0] == job_id:
            return SlurmJob(job_id, parts[1].split(" ")[0], exit_code=parts[2], elapsed=parts[3], nodes=parts[6],
                            source="sacct")
    return None


def sbatch(shell: Shell, script: str) -> str:
    """Submit the batch script at path `script` (there); the job id."""
    return parse_sbatch(shell.text(["sbatch", "--parsable", script]))


def squeue(shell: Shell, job_id: str) -> SlurmJob | None:
    done = shell.run(["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT], check=False)
    return parse_squeue(done.stdout.decode(errors="replace"), job_id) if done.returncode == 0 else None


def scontrol(shell: Shell, job_id: str) -> SlurmJob | None:
    done = shell.run(["scontrol", "show", "job", "-o", job_id], check=False)
    f = parse_scontrol(done.stdout.decode(errors="replace")) if done.returncode == 0 else {}
    if f.get("JobId") != job_id:
        return None
    return SlurmJob(job_id, f.get("JobState", ""), f.get("Reason", ""), int(f.get("Restarts", "0") or 0),
                    f.get("ExitCode", ""), f.get("RunTime", ""), f.get("NodeList", ""), "scontrol")


def sacct(shell: Shell, job_id: str) -> SlurmJob | None:
    done = shell.run(["sacct", "-n", "-P", "-X", "-j", job_id, f"--format={SACCT_FIELDS}"], check=False)
    return parse_sacct(done.stdout.decode(errors="replace"), job_id) if done.returncode == 0 else None


def observe(shell: Shell, job_id: str) -> SlurmJob | None:
    """What Slurm says about the job now: squeue while it is queued or running (with scontrol's
    restart count), scontrol for a while after it ended, then sacct; None when none knows it."""
    queued, detail = squeue(shell, job_id), scontrol(shell, job_id)
    if queued is not None:
        return replace(queued, restarts=detail.restarts if detail else 0)
    return detail or sacct(shell, job_id)


def scancel(shell: Shell, job_id: str) -> None:
    shell.run(["scancel", job_id])


def state_from(seen: SlurmJob | None, outcome: dict | None, current: str) -> tuple[JobState, str]:
    """The state Slurm's view and the job's own outcome put the job in, and why (pure)."""
    if seen is None:
        return JobState(current), "Slurm does not know the job (yet)"
    said = f"Slurm: {seen.state}" + (f" ({seen.reason})" if seen.reason and seen.reason != "None" else "")
    if seen.state in QUEUED:
        again = seen.restarts > 0 or current in (JobState.RUNNING, JobState.REQUEUED)
        return (JobState.REQUEUED if again else JobState.PENDING), \
            said + (f", requeued {seen.restarts}x" if seen.restarts else "")
    if seen.active:
        return JobState.RUNNING, said
    told = (outcome or {}).get("outcome")
    detail = (outcome or {}).get("detail", "")
    if seen.state == "CANCELLED":
        return JobState.CANCELLED, said
    if seen.state == "COMPLETED":
        if told == "completed":
            return JobState.COMPLETED, detail or said
        if told == "limit":
            return JobState.STOPPED, detail or said
        return JobState.FAILED, detail or f"{said}, but the job did not say how it ended"
    return JobState.FAILED, f"{said}, exit {seen.exit_code}" + (f"; {detail}" if detail else "")


BACKUP = "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(d := sqlite3.connect(sys.argv[2])); d.close()"


class SlurmBackend:
    """Jobs on a Slurm cluster whose client (sbatch, squeue, ...) runs where `shell` reaches."""

    kind = "slurm"
    title = "Slurm"

    def __init__(self, shell: Shell):
        self.shell = shell

    def submit(self, launch: Launch, target: Target, events: Events) -> str:
        """Stage into a new folder, write recipe, job.json and the batch script, sbatch it."""
        spec = job_spec(launch, target)
        with stage.new_folder(self.shell, launch.folder):
            sums = stage.upload(self.shell, launch.folder, list(launch.datasets), events, launch.digests)
            stage.put_files(self.shell, launch.folder, {"recipe.toml": launch.recipe, SPEC_FILE: spec.to_json(),
                                                        SCRIPT_FILE: batch_script(spec), DATA_SUMS: sums})
            return sbatch(self.shell, f"{launch.folder}/{SCRIPT_FILE}")

    def resubmit(self, launch: Launch, target: Target, events: Events) -> str:
        """Write the job's new spec and script in its folder, set its allocations' clock back to
        zero (the earlier ones kept aside: the new limits are for what follows) and sbatch it."""
        spec, folder = job_spec(launch, target), shlex.quote(launch.folder)
        earlier = f"allocations-before-{int(time.time())}.json"
        self.shell.run(["sh", "-c", f"cd {folder} && rm -f {OUTCOME_FILE} && if [ -e {ALLOCATIONS_FILE} ]; then "
                                    f"mv {ALLOCATIONS_FILE} {earlier}; fi"])
        stage.put_files(self.shell, launch.folder, {SPEC_FILE: spec.to_json(), SCRIPT_FILE: batch_script(spec)})
        return sbatch(self.shell, f"{launch.folder}/{SCRIPT_FILE}")

    def status(self, job: RemoteJobRow) -> Observed:
        """squeue, scontrol or sacct; once Slurm has ended the job, the outcome it wrote itself."""
        seen = observe(self.shell, job.backend_id) if job.backend_id else None
        outcome = None
        if seen is not None and not seen.active:
            text = self.shell.read(f"{job.remote_dir}/{OUTCOME_FILE}")
            outcome = json.loads(text) if text.strip() else None
        state, why = state_from(seen, outcome, job.state)
        return Observed(state, why, seen)

    def logs(self, job: RemoteJobRow, offset: int) -> bytes:
        """slurm-ID.out in the job's folder: every allocation's output, appended."""
        if job.backend_id is None:
            return b""
        return self.shell.read(f"{job.remote_dir}/slurm-{job.backend_id}.out", offset)

    def cancel(self, job: RemoteJobRow, events: Events) -> None:
        """scancel: Slurm's TERM reaches the run, which checkpoints within KillWait."""
        scancel(self.shell, job.backend_id)
        events.info(f"scancel {job.backend_id}: the run checkpoints and stops")

    def fetch(self, job: RemoteJobRow, out: Path, ledger: Path, final: bool) -> bool:
        """The run folder less checkpoints (the newest one with `final`), and a SQLite backup of
        the job's ledger taken there, so a run writing meanwhile never tears it."""
        remote_run = run_folder(job.remote_dir, job.name)
        if not self.shell.read(f"{remote_run}/run.json").strip():
            return False  # the run has not written its record yet
        self.shell.get(remote_run, out, exclude=("./checkpoints", "./.lock"))
        if final:
            names = self.shell.text(["sh", "-c", f"ls {shlex.quote(remote_run + '/checkpoints')} 2>/dev/null || true"])
            steps = sorted((int(m.group(1)), n) for n in names.split() if (m := re.fullmatch(r"step-(\d+)", n)))
            if steps:
                newest = steps[-1][1]
                self.shell.get(f"{remote_run}/checkpoints/{newest}", out / "checkpoints" / newest)
        snapshot = f"{job.remote_dir}/.sync"
        here = shlex.quote(snapshot)
        self.shell.run(["sh", "-c", f"mkdir -p {here} && rm -f {here}/ledger.db"])
        self.shell.run([job.python, "-c", BACKUP, f"{job.remote_dir}/ledger.db", f"{snapshot}/ledger.db"])
        with tempfile.TemporaryDirectory(prefix="ember-sync-") as tmp:
            self.shell.get(snapshot, Path(tmp))
            os.replace(Path(tmp) / "ledger.db", ledger)
        return True


def job_spec(launch: Launch, target: Target) -> JobSpec:
    """job.json: the launch with the target's Slurm settings and one allocation's --time."""
    minutes = time_minutes(launch.budget_seconds, target.signal_seconds, target.allocation_minutes)
    return JobSpec(launch.name, launch.folder, launch.python, launch.nodes, target.devices_per_node,
                   launch.budget_seconds, minutes, target.signal_seconds, target.partition, target.account,
                   target.gres, list(target.sbatch_args))
