"""The service's job processes: one supervised `ember run` per job (ember.sched.process), its log
in `serve/jobs/ID.log` and its soft-pause control folder in `serve/control/ID/` (ember.control),
both outside the run folder. A job's process is known by the PID and start time its ledger row
keeps, so one the service adopted after a restart is signalled and reaped like its own children.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ember import control
from ember.ledger.job_rows import JobRow
from ember.sched import process
from ember.hardware import Device
from ember.launchspec import ENV as LAUNCH_ENV
from ember.launchspec import LaunchSpec, PlannedMemory
from ember.paths import Home

RESTARTS = 3  # crashes a job's supervisor restarts within an hour before the job fails
ADOPTED_EXIT = -1  # the exit code of an adopted process that ended: not ours to read


class JobProcesses:
    """Starts, signals, kills and reaps the jobs' processes; writes their control requests."""

    def __init__(self, home: Home, ledger: Path):
        self.home = home           # where the service keeps each job's files (ember.paths)
        self.ledger = ledger       # the ledger the jobs' runs record into
        self.popens: dict[int, subprocess.Popen] = {}   # job -> the child this service started

    def ctl(self, job: JobRow) -> Path:
        """The job's soft-pause control folder (ember.control), outside its run folder."""
        folder = self.home.job_control(job.id)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def log_path(self, job: JobRow) -> Path:
        """Where the job's output goes (`ember logs`)."""
        return self.home.job_log(job.id)

    def logs(self, job: JobRow, offset: int) -> tuple[bytes, int]:
        """Up to 1 MiB of the job's output from `offset`, and the offset after it."""
        path = self.log_path(job)
        if not path.exists():
            return b"", 0
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            at = min(max(0, offset), size)  # past the end: nothing yet (a seek past the file system's largest
            f.seek(at)                       # file size fails), and the offset stays where it was asked
            data = f.read(1 << 20)
        return data, max(0, offset) + len(data)

    def start(self, job: JobRow, devices: tuple[Device, ...]) -> process.Spawned:
        """`ember run` for the job on `devices`, its control requests cleared."""
        env = {control.ENV: str(self.ctl(job))}
        spec = self.launch_spec(job, devices)
        if spec is not None:  # a job queued by an older ember has no snapshot: its run reads the file
            env[LAUNCH_ENV] = str(spec.save(self.home.job_launch(job.id)))
        if all(d.kind == "cuda" for d in devices):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d.index) for d in devices)
        control.clear(self.ctl(job))
        Path(job.out).parent.mkdir(parents=True, exist_ok=True)
        argv = process.run_argv(job.recipe, job.out, job.overrides, self.ledger, RESTARTS)
        spawned = process.spawn(argv, self.log_path(job), env)
        self.popens[job.id] = spawned.popen
        return spawned

    def launch_spec(self, job: JobRow, devices: tuple[Device, ...]) -> LaunchSpec | None:
        """What the job's processes take instead of reading the recipe file and planning again:
        the recipe as admitted, the plan admitted on, the job and its devices (ember.launchspec)."""
        admitted = job.request.get("recipe")
        if admitted is None:
            return None
        first = devices[0]
        plan = PlannedMemory(int(job.request["memory"]), first.name, first.free, True)
        return LaunchSpec(str(Path(job.out).resolve()), admitted, job.request["recipe_digest"], job.recipe,
                          list(job.overrides), plan, job=job.id, devices=[d.index for d in devices],
                          device_names=[d.name for d in devices], restarts=RESTARTS,
                          launched=time.time(), launcher=os.getpid())

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
        """SIGTERM: the job stops between micro-batches, checkpoints its last step and exits 75."""
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
