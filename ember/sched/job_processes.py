"""The service's job processes: one supervised `ember run` per job (ember.sched.process), its log
in `serve/jobs/ID.log` and its soft-pause control folder in `serve/control/ID/` (ember.control),
both outside the run folder. A job's process is known by the PID and start time its ledger row
keeps, so one the service adopted after a restart is signalled and reaped like its own children.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

from ember import control
from ember.ledger.job_rows import JobRow
from ember.sched import process
from ember.sched.resources import Device

RESTARTS = 3  # crashes a job's supervisor restarts within an hour before the job fails
ADOPTED_EXIT = -1  # the exit code of an adopted process that ended: not ours to read


class JobProcesses:
    """Starts, signals, kills and reaps the jobs' processes; writes their control requests."""

    def __init__(self, folder: Path, ledger: Path):
        self.dir = folder          # the service's folder ($EMBER_HOME/serve)
        self.ledger = ledger       # the ledger the jobs' runs record into
        self.popens: dict[int, subprocess.Popen] = {}   # job -> the child this service started

    def ctl(self, job: JobRow) -> Path:
        """The job's soft-pause control folder (ember.control), outside its run folder."""
        folder = self.dir / "control" / str(job.id)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def log_path(self, job: JobRow) -> Path:
        """Where the job's output goes (`ember logs`)."""
        return self.dir / "jobs" / f"{job.id}.log"

    def logs(self, job: JobRow, offset: int) -> tuple[bytes, int]:
        """Up to 1 MiB of the job's output from `offset`, and the offset after it."""
        path = self.log_path(job)
        if not path.exists():
            return b"", 0
        with open(path, "rb") as f:
            f.seek(max(0, offset))
            data = f.read(1 << 20)
        return data, max(0, offset) + len(data)

    def start(self, job: JobRow, devices: tuple[Device, ...]) -> process.Spawned:
        """`ember run` for the job on `devices`, its control requests cleared."""
        indices = ",".join(str(d.index) for d in devices)
        env = {"EMBER_JOB": str(job.id), "EMBER_JOB_DEVICES": indices,
               "EMBER_JOB_DEVICE_NAMES": ",".join(d.name for d in devices),  # the ledger's attempt row
               control.ENV: str(self.ctl(job))}
        if all(d.kind == "cuda" for d in devices):
            env["CUDA_VISIBLE_DEVICES"] = indices
        control.clear(self.ctl(job))
        Path(job.out).parent.mkdir(parents=True, exist_ok=True)
        argv = process.run_argv(job.recipe, job.out, job.overrides, self.ledger, RESTARTS)
        spawned = process.spawn(argv, self.log_path(job), env)
        self.popens[job.id] = spawned.popen
        return spawned

    def exit_code(self, job: JobRow) -> int | None:
        """None while the job's process runs; its exit code once it ended (ADOPTED_EXIT for one
        this service did not start)."""
        popen = self.popens.get(job.id)
        if popen is not None:
            return popen.poll()
        return None if process.alive(job.pid, job.pid_start) else ADOPTED_EXIT

    def alive(self, job: JobRow) -> bool:
        """Whether the job's process (the one its row names) still runs."""
        return process.alive(job.pid, job.pid_start)

    def reaped(self, job: JobRow) -> None:
        """The job's process ended: forget it and clear its control requests."""
        self.popens.pop(job.id, None)
        control.clear(self.ctl(job))

    def terminate(self, job: JobRow) -> None:
        """SIGTERM: the job checkpoints at its next step boundary and exits 75."""
        if job.state == "soft-paused":
            control.request(self.ctl(job), None)  # let the loop reach its stop check
        process.signal_job(job.pid, job.pid_start, signal.SIGTERM)

    def kill(self, job: JobRow) -> bool:
        """SIGKILL the job's process tree; False when it was gone already."""
        return process.kill_tree(job.pid, job.pid_start)

    def ask(self, job: JobRow, reason: str | None, lease: float | None) -> None:
        """Ask the job to soft-pause for `reason` (None: to go on). An inference pause is a lease,
        written again at each call; the others are written only when they change."""
        folder = self.ctl(job)
        if reason is not None and lease is not None:
            control.request(folder, reason, lease)
        elif control.requested(folder) != reason:
            control.request(folder, reason)

    def requested(self, job: JobRow) -> str | None:
        """The soft pause asked of the job now, if any."""
        return control.requested(self.ctl(job))

    def acknowledged(self, job: JobRow) -> dict | None:
        """What the job's loop last acknowledged: {state: paused|running, time}."""
        return control.acknowledged(self.ctl(job))

    def settle(self, job: JobRow) -> None:
        """Clear the control requests of a job found dead at a service start (leases included)."""
        control.clear(self.ctl(job))

    def remove_files(self, job: JobRow) -> None:
        """Purge: the job's log and control folder (never its run folder)."""
        self.log_path(job).unlink(missing_ok=True)
        shutil.rmtree(self.ctl(job))
