"""The Slurm command-line client, in its parsable formats: `sbatch --parsable`, `squeue -h -o` with
a separator, `sacct -n -P` and `scontrol show job -o`. Commands run through a Shell (this machine
or an SSH host); parsing is pure. squeue and scontrol know a job while it is queued or running
(and for MinJobAge after); sacct knows it from the accounting database, a few seconds late, for
ever: `observe` asks scontrol first and sacct when scontrol no longer knows the job."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ember.errors import EmberError
from ember.remote.shell import Shell

SQUEUE_FORMAT = "%i|%T|%r|%M|%l|%N"
SACCT_FIELDS = "JobID,State,ExitCode,Elapsed,Start,End,NodeList"
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


def requeue(shell: Shell, job_id: str) -> None:
    shell.run(["scontrol", "requeue", job_id])
