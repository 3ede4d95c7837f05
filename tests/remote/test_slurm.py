"""The Slurm backend against a real Slurm (tests/slurm_cluster.sh): jobs submitted through the
gate, requeued mid-run and at their allocation's time limit, cancelled, stopped at their own
limits, and their results brought back into the local ledger and run folder, bit-identical to an
uninterrupted local run. `sbatch` is reached through a PATH wrapper that records every call, so
a refused job is shown never to reach it.

Jobs are slowed by a data delay (EMBER_FAULT_DATA_DELAY, which changes nothing they compute) so
that there is time to act while they train."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ember.ledger import remote_rows as remote_rows
from ember.ledger import database as store
from ember.policy.registry import register
from tests.helpers import GENESIS, assert_same_result, run_ember, wait_until, write_recipe
from tests.remote.targets import LIMITS, target_toml

pytestmark = pytest.mark.e2e



@dataclass
class Site:
    root: Path
    recipe: Path
    data: Path
    baseline: Path
    calls: Path          # one line per sbatch call, written by the PATH wrapper

    def ember(self, *args: str, delay: float = 0.0, timeout: float = 600) -> subprocess.CompletedProcess:
        """The ember command with this site's registry, targets and ledger, sbatch behind the wrapper."""
        env = {"PATH": f"{self.root / 'bin'}:{os.environ['PATH']}"}
        if delay:
            env["EMBER_FAULT_DATA_DELAY"] = str(delay)
        return run_ember(*args, env=env, timeout=timeout)

    def submit(self, name: str, target: str, *limits: str, delay: float = 0.0) -> subprocess.CompletedProcess:
        return self.ember("submit", self.recipe, "--target", target, *(limits or LIMITS), "--name", name, "--out",
                          self.root / "results" / name, *self.files(), delay=delay)

    def files(self) -> tuple[str, ...]:
        return ("--registry", str(self.root / "datasets.toml"), "--targets", str(self.root / "targets.toml"),
                "--ledger", str(self.root / "ledger.db"))

    def job(self, name: str) -> remote_rows.RemoteJobRow:
        con = store.connect(self.root / "ledger.db")
        try:
            (job,) = remote_rows.find(con, name)
            return job
        finally:
            con.close()

    def remote_steps(self, name: str) -> int:
        metrics = self.root / "stage" / name / name / "metrics.jsonl"
        return metrics.read_text().count("\n") if metrics.exists() else 0

    def sbatch_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture(scope="module")
def site(slurm, tmp_path_factory) -> Site:
    root = tmp_path_factory.mktemp("remote")
    data = root / "data" / "genesis.jsonl"
    data.parent.mkdir()
    data.write_bytes(GENESIS.read_bytes())
    recipe = write_recipe(root / "project", data={"files": [str(data)]})
    # 'short': one-minute allocations, warned 10 s before their end (Slurm's warning comes 0-30 s
    # earlier still: its time-limit check runs every ~30 s), so a longer job meets its time limit.
    (root / "targets.toml").write_text(
        target_toml("local", "slurm", root / "stage", signal_seconds=15, allocation_minutes=0)
        + target_toml("short", "slurm", root / "stage", signal_seconds=10, allocation_minutes=1))
    register(root / "datasets.toml", "genesis", [data], "alice", "CC0-1.0", "public", ["local", "short"], "")
    (root / "bin").mkdir()
    wrapper = root / "bin" / "sbatch"
    wrapper.write_text(f"#!/bin/sh\necho \"$*\" >> {root / 'sbatch-calls'}\nexec {shutil.which('sbatch')} \"$@\"\n")
    wrapper.chmod(0o755)
    done = run_ember("run", recipe, "--out", root / "baseline", "--no-ledger")
    assert done.returncode == 0, done.stderr
    return Site(root, recipe, data, root / "baseline", root / "sbatch-calls")


def slurm_field(job_id: str, key: str) -> str:
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return next(t.split("=", 1)[1] for t in line.split() if t.startswith(key + "="))


def test_a_refused_job_never_reaches_sbatch(site):
    """Missing limits, and a dataset file changed after it was registered: refused, every
    reason printed, audited, and the sbatch wrapper never called."""
    done = site.submit("refused-1", "local", "--max-wall-hours", "0.5")
    assert done.returncode == 1
    assert "missing-limit: max_device_hours, max_cost, max_nodes not stated" in done.stderr
    original = site.data.read_bytes()
    site.data.write_bytes(original.replace(b"God", b"god", 1))  # one byte, same size
    try:
        done = site.submit("refused-2", "local")
        assert done.returncode == 1
        assert "fingerprint: dataset 'genesis' changed since it was registered" in done.stderr
        verify = site.ember("data", "verify", "--registry", str(site.root / "datasets.toml"))
        assert verify.returncode == 1 and "genesis: FAILED: changed since it was registered" in verify.stdout
    finally:
        site.data.write_bytes(original)
    assert site.sbatch_calls() == []
    assert not (site.root / "stage" / "refused-1").exists() and not (site.root / "stage" / "refused-2").exists()
    audit = site.ember("policy", "audit", "--verify", "--json", "--ledger", str(site.root / "ledger.db"))
    rows = json.loads(audit.stdout)["rows"]
    assert [(r["action"], r["decision"]) for r in rows[-2:]] == [("submit", "refused"), ("submit", "refused")]
    assert [x["code"] for x in rows[-1]["reasons"]] == ["fingerprint"]


def test_requeued_then_time_limited_job_resumes_and_ends_bit_identical(site):
    """`scontrol requeue` mid-run, then the allocation's time limit (1 minute on target 'short'):
    the run checkpoints on Slurm's TERM and on its USR1, is requeued each time, resumes, and its
    results come back bit-identical to the uninterrupted local run, with every attempt accounted."""
    # 3 s a step: after our requeue (at step 3 or a little later on a busy machine) the 24-step run
    # needs over a minute more, so its next allocation always meets the time limit (at 2 s a step a
    # requeue that landed late left under a minute: the job then completed without it).
    done = site.submit("requeue", "short", delay=3.0)
    assert done.returncode == 0, done.stderr
    assert len(site.sbatch_calls()) == 1  # the wrapper sees an allowed submission
    job = site.job("requeue")
    wait_until("step 3 on the cluster", lambda: site.remote_steps("requeue") >= 3, 120)
    subprocess.run(["scontrol", "requeue", job.backend_id], check=True, capture_output=True)
    status = site.ember("remote", "status", job.backend_id, "--wait", "--timeout", "500", "--json", *site.files()[4:],
                        timeout=600)
    assert status.returncode == 0, status.stderr
    (st,) = json.loads(status.stdout)
    assert st["job"]["state"] == "completed", st
    out = Path(st["job"]["out"])
    assert_same_result(out, site.baseline)
    assert int(slurm_field(job.backend_id, "Restarts")) >= 2  # ours, then the time limit's
    log = site.ember("remote", "logs", job.backend_id, *site.files()[4:]).stdout
    assert "checkpointed before the allocation's end; requeueing job" in log
    assert len(site.sbatch_calls()) == 1  # requeues are Slurm's, never a second sbatch
    report = json.loads(site.ember("report", str(out), "--json", "--ledger", str(site.root / "ledger.db")).stdout)
    outcomes = [a["outcome"] for a in report["attempts"]]
    assert len(outcomes) >= 3 and outcomes[-1] == "completed" and set(outcomes[:-1]) <= {"interrupted", "killed"}
    assert report["run"]["status"] == "completed" and report["cost"]["total"] > 0
    assert 0 < report["goodput"]["goodput"] < 1
    compare = site.ember("compare", str(out), str(site.baseline), "--ledger", str(site.root / "ledger.db"))
    assert compare.returncode == 0 and "identical" in compare.stdout


def test_remote_cancel_checkpoints_and_brings_the_run_back_and_continue_resumes_it(site):
    """Cancelled at step 2 or later: checkpointed, brought back. Submitting it again is refused with
    the way on; `ember remote continue` goes through the gate again (refused without limits,
    audited either way) and resumes it from its checkpoint to the same result as the
    uninterrupted run; then it exports."""
    done = site.submit("cancel", "local", delay=0.5)
    assert done.returncode == 0, done.stderr
    job = site.job("cancel")
    wait_until("step 2 on the cluster", lambda: site.remote_steps("cancel") >= 2, 120)
    done = site.ember("remote", "cancel", job.backend_id, *site.files()[4:])
    assert done.returncode == 0, done.stderr
    assert "cancelled" in done.stdout
    assert site.job("cancel").state == "cancelled"
    out = site.root / "results" / "cancel"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 2 <= steps[-1] < 24
    assert (out / "checkpoints" / f"step-{steps[-1]:09d}").is_dir()  # checkpointed on Slurm's TERM
    con = sqlite3.connect(site.root / "ledger.db")
    outcomes = [r[0] for r in con.execute("SELECT a.outcome FROM attempts a JOIN runs r ON r.id = a.run_id "
                                          "WHERE r.path = ?", (str(out.resolve()),))]
    assert outcomes == ["interrupted"]

    done = site.submit("cancel", "local")
    assert done.returncode == 1 and "`ember remote continue cancel` with new limits resume" in done.stderr
    done = site.ember("export", str(out), "--format", "hf")
    assert done.returncode == 1 and "`ember remote continue cancel` with new limits resumes it" in done.stderr
    calls = len(site.sbatch_calls())
    done = site.ember("remote", "continue", "cancel", *site.files())
    assert done.returncode == 1 and "missing-limit" in done.stderr
    assert len(site.sbatch_calls()) == calls and site.job("cancel").state == "cancelled"
    done = site.ember("remote", "continue", "cancel", *LIMITS, *site.files())
    assert done.returncode == 0, done.stderr
    job = site.job("cancel")
    assert job.state == "pending" and job.limits["spent_before"] > 0 and len(site.sbatch_calls()) == calls + 1
    status = site.ember("remote", "status", "cancel", "--wait", "--timeout", "240", "--json", *site.files()[4:])
    (st,) = json.loads(status.stdout)
    assert st["job"]["state"] == "completed", st
    assert_same_result(out, site.baseline)
    outcomes = [r[0] for r in con.execute("SELECT a.outcome FROM attempts a JOIN runs r ON r.id = a.run_id "
                                          "WHERE r.path = ? ORDER BY a.attempt", (str(out.resolve()),))]
    assert outcomes == ["interrupted", "completed"]
    rows = json.loads(site.ember("policy", "audit", "--verify", "--json", "--ledger",
                                 str(site.root / "ledger.db")).stdout)["rows"]
    assert [(r["action"], r["decision"]) for r in rows[-2:]] == [("continue", "refused"), ("continue", "allowed")]
    assert job.audit_id == rows[-1]["id"]
    done = site.ember("export", str(out), "--format", "hf")
    assert done.returncode == 0, done.stderr
    assert (out / "export" / "hf" / "model.safetensors").is_file()


def test_a_failed_sbatch_leaves_no_staged_data(site):
    """sbatch refuses the job (a partition the cluster does not have): its staged folder is removed,
    the job is failed with sbatch's words, and there is nothing to continue."""
    text = target_toml("nopart", "slurm", site.root / "stage", signal_seconds=15, allocation_minutes=0) + 'partition = "nosuch"\n'
    (site.root / "targets.toml").write_text((site.root / "targets.toml").read_text() + text)
    register(site.root / "datasets.toml", "genesis", [site.data], "alice", "CC0-1.0", "public",
             ["local", "short", "nopart"], "")
    done = site.submit("no-partition", "nopart")
    assert done.returncode == 1 and "sbatch" in done.stderr and "partition" in done.stderr, done.stderr
    assert not (site.root / "stage" / "no-partition").exists()
    assert site.job("no-partition").state == "failed"
    done = site.ember("remote", "continue", "no-partition", *LIMITS, *site.files())
    assert done.returncode == 1 and "never reached Slurm" in done.stderr


def test_a_job_stops_itself_at_its_own_limit(site):
    """max 0.015 wall-hours (54 s): 15 s before, the job checkpoints and stops on its own (Slurm's
    time limit is minutes later), and is not requeued."""
    limits = ("--max-wall-hours", "0.015", "--max-device-hours", "0.5", "--max-cost", "0.5", "--max-nodes", "1")
    done = site.submit("limit", "local", *limits, delay=2.0)
    assert done.returncode == 0, done.stderr
    job = site.job("limit")
    status = site.ember("remote", "status", job.backend_id, "--wait", "--timeout", "240", "--json", *site.files()[4:])
    (st,) = json.loads(status.stdout)
    assert st["job"]["state"] == "stopped", st
    assert "its limits reached" in st["job"]["detail"]
    assert int(slurm_field(job.backend_id, "Restarts")) == 0
    out = site.root / "results" / "limit"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < steps[-1] < 24
    assert (out / "checkpoints" / f"step-{steps[-1]:09d}").is_dir()
    held = json.loads((site.root / "stage" / "limit" / "allocations.json").read_text())
    (start, end), = held.values()
    assert end - start < 54  # stopped within its budget


def test_a_target_reached_over_ssh(site, sshd):
    """The same job through an SSH target (sshd on 127.0.0.1): every Slurm command, the staging
    and the results' return go through `ssh`; the run comes back bit-identical."""
    options = json.dumps(sshd)
    text = target_toml("ssh", "slurm", site.root / "stage-ssh", signal_seconds=15, allocation_minutes=0)
    text += f'host = "root@127.0.0.1"\nssh_options = {options}\npython = "{sys.executable}"\n'
    (site.root / "targets.toml").write_text((site.root / "targets.toml").read_text() + text)
    register(site.root / "datasets.toml", "genesis", [site.data], "alice", "CC0-1.0", "public",
             ["local", "short", "ssh"], "")
    done = site.submit("over-ssh", "ssh")
    assert done.returncode == 0, done.stderr
    job = site.job("over-ssh")
    assert (job.host, job.ssh_options) == ("root@127.0.0.1", sshd)
    # 18 s on a quiet machine; every Slurm command and the staging go through ssh, so it waits as
    # long as the requeue test does, and a failure says what the command said (it once died of a
    # race in bringing the job's ledger rows back, ember.ledger.remote_rows.import_run).
    status = site.ember("remote", "status", "over-ssh", "--wait", "--timeout", "500", "--json", *site.files()[4:])
    assert status.returncode == 0 and status.stdout, (status.returncode, status.stdout[-2000:], status.stderr[-3000:])
    (st,) = json.loads(status.stdout)
    assert st["job"]["state"] == "completed", st
    assert_same_result(Path(st["job"]["out"]), site.baseline)
    log = site.ember("remote", "logs", "over-ssh", *site.files()[4:]).stdout
    assert "completed: max_steps reached" in log
