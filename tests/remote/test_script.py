"""The Slurm backend's pure parts: the batch script, each node's command, the --time rule, the
parsers of Slurm's parsable output, and the Slurm backend's reading of them as states of the remote
job state machine (ember.ledger.job_states)."""

from __future__ import annotations

import pytest

from ember.ledger.job_states import CONTINUABLE, REMOTE, REMOTE_FINAL as FINAL
from ember.remote.script import JobSpec, batch_script, node_command, time_minutes
from ember.remote.slurm import SlurmJob, parse_sacct, parse_sbatch, parse_scontrol, parse_squeue, state_from

TRANSITIONS = REMOTE.transitions

SPEC = JobSpec("lora-1", "/scratch/ember/lora-1", "/opt/ember/bin/python", nodes=1, nproc=1, budget_seconds=3600,
               time_minutes=63, signal_seconds=120, partition="gpu", account="proj", gres="gpu:4",
               sbatch_args=["--qos=high"])


def test_the_batch_script_asks_for_the_limits_the_signal_and_requeue_and_execs_ember():
    text = batch_script(SPEC)
    sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == ["--job-name=ember-lora-1", "--nodes=1", "--ntasks-per-node=1", "--time=63",
                      "--signal=B:USR1@120", "--requeue", "--open-mode=append",
                      "--output=/scratch/ember/lora-1/slurm-%j.out", "--chdir=/scratch/ember/lora-1",
                      "--partition=gpu", "--account=proj", "--gres=gpu:4", "--qos=high"]
    # exec: the batch shell becomes ember's allocation process, so B:USR1 reaches it
    assert text.splitlines()[-1] == "exec /opt/ember/bin/python -m ember remote _allocation /scratch/ember/lora-1"


def test_one_node_runs_ember_under_srun_and_several_nodes_add_torchrun_flags():
    one = node_command(SPEC, "node0:29500")
    assert one[:5] == ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert one[5:] == ["/opt/ember/bin/python", "-m", "ember", "run", "/scratch/ember/lora-1/recipe.toml", "--out",
                       "/scratch/ember/lora-1/lora-1", "--ledger", "/scratch/ember/lora-1/ledger.db"]
    two = node_command(JobSpec(**{**SPEC.__dict__, "nodes": 2, "nproc": 4}), "node0:29500")
    assert two[1:3] == ["--nodes=2", "--ntasks=2"]
    # each task adds its own node rank from Slurm's environment
    assert two[5:9] == ["sh", "-c", 'exec "$@" --node-rank "$SLURM_NODEID"', "ember-node"]
    assert two[-6:] == ["--nproc", "4", "--nnodes", "2", "--rdzv", "node0:29500"]


@pytest.mark.parametrize("budget,signal,partition,minutes", [
    (3600, 120, 0, 64),      # the budget, plus the signal and a minute of Slurm's earliness, plus one
    (3600, 120, 30, 30),     # the partition's longest allocation: the job requeues itself
    (10, 10, 0, 3),
])
def test_time_is_the_budget_with_a_grace_or_the_partitions_longest(budget, signal, partition, minutes):
    assert time_minutes(budget, signal, partition) == minutes
    if not partition:  # Slurm's warning, at most 60 s early, never comes before the job's own stop
        assert minutes * 60 - signal - 60 > budget - signal


def test_parsers_read_slurms_parsable_formats():
    assert parse_sbatch("42\n") == "42" and parse_sbatch("42;cluster\n") == "42"
    assert parse_squeue("42|PENDING|BeginTime|0:00|1:00|\n", "42") == SlurmJob("42", "PENDING", "BeginTime",
                                                                              elapsed="0:00", source="squeue")
    assert parse_squeue("", "42") is None
    f = parse_scontrol("JobId=42 JobName=ember-x JobState=RUNNING Reason=None Requeue=1 Restarts=2 "
                       "ExitCode=0:0 RunTime=00:00:07 NodeList=vm\n")
    assert (f["JobState"], f["Restarts"], f["NodeList"]) == ("RUNNING", "2", "vm")
    s = parse_sacct("42|CANCELLED by 0|0:15|00:00:31|2026-12-02T06:42:25|2026-12-02T06:42:56|vm\n", "42")
    assert (s.state, s.exit_code, s.active) == ("CANCELLED", "0:15", False)


@pytest.mark.parametrize("seen,outcome,current,state", [
    (None, None, "pending", "pending"),
    (SlurmJob("1", "PENDING"), None, "pending", "pending"),
    (SlurmJob("1", "RUNNING"), None, "pending", "running"),
    (SlurmJob("1", "PENDING", restarts=1), None, "pending", "requeued"),   # a poll missed the running
    (SlurmJob("1", "PENDING", "BeginTime"), None, "running", "requeued"),
    (SlurmJob("1", "COMPLETED"), {"outcome": "completed"}, "running", "completed"),
    (SlurmJob("1", "COMPLETED"), {"outcome": "limit", "detail": "its limits reached"}, "running", "stopped"),
    (SlurmJob("1", "COMPLETED"), None, "running", "failed"),              # ended without saying how
    (SlurmJob("1", "FAILED", exit_code="1:0"), {"outcome": "failed"}, "running", "failed"),
    (SlurmJob("1", "TIMEOUT"), None, "running", "failed"),
    (SlurmJob("1", "CANCELLED"), None, "requeued", "cancelled"),
])
def test_the_state_a_slurm_view_puts_a_job_in(seen, outcome, current, state):
    got, why = state_from(seen, outcome, current)
    assert got == state and why
    assert got == current or got in TRANSITIONS[current]  # every reading is a declared transition


def test_ended_states_leave_only_through_continue():
    """completed is for ever; stopped, cancelled and failed go back to staging only (ember remote
    continue, through the gate again), never on what Slurm says."""
    assert TRANSITIONS["completed"] == ()
    assert set(CONTINUABLE) | {"completed"} == set(FINAL)
    assert all(TRANSITIONS[s] == ("staging",) for s in CONTINUABLE)
