"""A real `ember serve` in a child process with its own EMBER_HOME, and the jobs it started,
stopped by PID (the service, and every job's process tree) at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil

from tests import warm
from tests.helpers import ROOT, ember_cmd, run_ember, wait_until, warm_children_env, with_cpu_peak


class Serve:
    def __init__(self, home: Path, owner: str, devices: str | None = None, env: dict | None = None):
        """The jobs' training processes and the service's plans are forked from the pytest run's
        warm process (tests/warm_jobs/sitecustomize.py), unless `env` sets PYTHONPATH itself. A
        forked training process is not under its supervisor: an owner rule that counts ember's
        own processes by the service's process tree (a CPU rule without [cpu] cgroup, programs,
        foreign processes on a GPU) would count it as another's; such a test passes a
        PYTHONPATH of its own, for fresh jobs."""
        self.home, self.devices = home, devices
        home.mkdir(parents=True, exist_ok=True)
        with_cpu_peak(home)
        (home / "owner.toml").write_text(owner)
        self.env = {**os.environ, "EMBER_HOME": str(home), **(env or {})}
        if "PYTHONPATH" not in (env or {}):
            self.env.update(warm_children_env(self.env))
        self.proc: subprocess.Popen | None = None
        self.http: httpx.Client | None = None
        self.seen: dict[int, psutil.Process] = {}  # job processes, known with their start time

    def start(self, timeout: float = 60) -> Serve:
        (self.home / "serve" / "serve.json").unlink(missing_ok=True)
        argv = ember_cmd("serve", "--port", "0") + (["--devices", self.devices] if self.devices else [])
        self.log = open(self.home / f"serve-{time.time():.0f}.log", "a")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                info = json.loads((self.home / "serve" / "serve.json").read_text())
                if info["pid"] == self.proc.pid:
                    break
            except (OSError, ValueError, KeyError):
                pass
            assert self.proc.poll() is None, self.output()
            time.sleep(0.1)
        else:
            raise AssertionError(f"the service did not start: {self.output()}")
        self.url = info["url"]
        self.token = (self.home / "serve" / "token").read_text().strip()
        if self.http is not None:
            self.http.close()
        # One client for the tests' requests and polls: each httpx.get() builds a client, whose TLS
        # context (certifi's bundle) cost 21 CPU-ms a request here; polled ten times a second while
        # a test waits, that was a fifth of a core (bench: none; measured in tests/README.md).
        self.http = httpx.Client(base_url=self.url, verify=False)
        return self

    def output(self) -> str:
        return "".join(p.read_text() for p in sorted(self.home.glob("serve-*.log")))

    @property
    def auth(self) -> dict[str, str]:
        """The token, as the commands send it and as OpenAI clients send their API key."""
        return {"Authorization": f"Bearer {self.token}"}

    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 120) -> httpx.Response:
        return self.http.request(method, path, json=body, timeout=timeout, headers=self.auth)

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`ember ARGS` against this service, forked warm (tests.helpers.run_ember): the commands
        that talk to the service import no torch, but a fresh interpreter still costs ~0.3 CPU-s
        a call, and the tests make a few dozen (tests/test_startup.py starts them fresh)."""
        return run_ember(*args, env=self.env, timeout=timeout)

    def jobs(self) -> dict[str, dict]:
        jobs = {j["name"]: j for j in self.api("GET", "/api/jobs").json()}
        for pid in filter(None, map(self.job_pid, jobs)):
            if pid not in self.seen:
                try:
                    self.seen[pid] = psutil.Process(pid)
                except psutil.Error:
                    pass
        return jobs

    def job_pid(self, name: str) -> int | None:
        import sqlite3
        con = sqlite3.connect(self.home / "ledger.db")
        try:
            row = con.execute("SELECT pid FROM jobs WHERE name = ?", (name,)).fetchone()
        finally:
            con.close()
        return row[0] if row else None

    def trainer(self, name: str, timeout: float = 120) -> psutil.Process:
        """The training process of job `name`, which runs: its supervisor's child, or with warm
        jobs the command that child stands in for (known once the warm process forked it)."""
        pid = self.job_pid(name)
        assert pid is not None, f"job {name} has no process: {self.jobs().get(name)}"
        child = wait_until(f"job {name}'s supervisor's child", lambda: psutil.Process(pid).children(),
                           timeout, every=0.02)[0]
        if "EMBER_TEST_WARM_JOBS" not in self.env:
            return child
        return psutil.Process(wait_until(f"the command of job {name}'s stand-in {child.pid}",
                                         lambda: warm.command_of(child.pid), timeout, every=0.02))

    def wait(self, what, timeout: float = 180, every: float = 0.1):
        """Poll `what(jobs)` until it returns something truthy; bounded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = what(self.jobs())
            if got:
                return got
            time.sleep(every)
        raise AssertionError(f"timed out; jobs: {json.dumps(self.jobs(), indent=1)}\n{self.output()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the service alone (its jobs run in their own sessions and go on)."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """Stop the service (SIGTERM: it preempts its jobs), then anything of ours still alive."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for proc in self.seen.values():  # job processes this test's service started, and all under them
            if not proc.is_running():  # gone, or its PID now names another process (start time differs)
                continue
            for p in [proc, *warm.tree(proc.pid)[1:]]:  # with warm jobs, the commands under their stand-ins too
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
        if self.http is not None:
            self.http.close()
        self.log.close()
