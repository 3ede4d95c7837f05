"""Pipeline parallelism x DDP (strategy 'pp+ddp') on four ranks of this CPU: 2 replicas of a
pipeline of the tiny model's 2 decoder layers on 2 stages, each replica reading half of every
step's rows. It trains what one process trains within the stated tolerance; the whole process
group SIGKILLed mid-run resumes bit for bit on the same layout, and its checkpoint resumes on one
pipeline of 2 stages (DCP reshards) within the tolerance."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from tests.artifacts import copy_of, shared
from tests.distributed_harness import ember_run
from tests.e2e.test_distributed import close
from tests.e2e.test_group_signals import signal_group_and_reap, start_group
from tests.helpers import assert_same_result, losses, run_ember, wait_for_step, write_recipe

pytestmark = pytest.mark.e2e

STEPS = 8
PP_DDP = ("--nproc", "4", "--set", "distributed.strategy=pp+ddp")  # pp_size 2: 2 stages x 2 replicas


def recipe(folder: Path) -> Path:
    """grad_accum 4 micro-batches of 4 rows: 2 for each replica's pipeline (1F1B needs one per stage)."""
    return write_recipe(folder, train={"max_steps": STEPS, "grad_accum": 4},
                        checkpoint={"every_steps": 3, "keep_last": 2})


@pytest.fixture
def runs() -> dict:
    """One process and the uninterrupted 2 x 2 run of the same recipe (built once; read-only)."""
    def build(folder: Path) -> None:
        r = recipe(folder)
        ember_run(r, folder / "one")
        ember_run(r, folder / "2x2", *PP_DDP)
    folder = shared("pipeline-ddp-baselines", STEPS, build)
    return {"recipe": folder / "recipe.toml", "one": folder / "one", "2x2": folder / "2x2"}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 x 2 run whose whole process group (ours) was SIGKILLed after step 4 (checkpoint step 3
    committed): every micro-batch is slowed by 0.25 s (EMBER_FAULT_DATA_DELAY: it computes the
    same), so the kill lands seconds before the run would end, not after it."""
    folder = tmp_path_factory.mktemp("killed")
    out = folder / "run"
    proc = start_group("run", recipe(folder), "--out", out, "--no-ledger", *PP_DDP,
                       env={"EMBER_FAULT_DATA_DELAY": "0.25"})
    try:
        wait_for_step(proc, out / "metrics.jsonl", 4, timeout=300)
        assert proc.poll() is None, f"the run ended before the kill: {proc.communicate()[1][-2000:]}"
    finally:
        code, err = signal_group_and_reap(proc, signal.SIGKILL)
    assert code == -signal.SIGKILL, err[-2000:]
    assert 4 <= losses(out)[-1][0] < STEPS and (out / "checkpoints" / "step-000000003").is_dir()
    return out


def test_two_pipelines_of_two_stages_train_what_one_process_trains(runs):
    """Each replica's pipeline runs 2 of the step's 4 micro-batches; each stage's gradients are
    averaged over its 2 replicas. Losses and final weights within RTOL (1e-5) of one process's:
    the gradients sum in another order (per replica, then across the two; the clipping norm over
    the stages in float64): measured at most 2.3e-8 in a loss of ~5, 1.3e-7 in a weight."""
    close(runs["2x2"], runs["one"])
    record = json.loads((runs["2x2"] / "run.json").read_text())
    assert record["manifest"]["world"] == {"ranks": 4, "strategy": "pp+ddp", "backend": "gloo"}
    ranks = json.loads((runs["2x2"] / "ranks.json").read_text())
    assert ranks["bubble_predicted"] == pytest.approx(1 / 3)  # (2-1)/(2+2-1): 2 micro-batches per pipeline
    shown = run_ember("report", runs["2x2"])
    assert shown.returncode == 0 and "33.3% predicted" in shown.stdout and ", rank 3 " in shown.stdout, \
        shown.stdout[-2000:] + shown.stderr[-2000:]


def test_each_stage_is_written_once_though_two_replicas_hold_it(runs):
    """DCP's planner writes a tensor that several ranks hold under one name once (dedup_save_plans):
    every byte of the files is an entry of the metadata, one per name (a replica's second copy
    would be bytes no entry points to), and both stages' layers are there."""
    ckpt = runs["2x2"] / "checkpoints" / f"step-{STEPS:09d}"
    stored = dcp.FileSystemReader(ckpt).read_metadata().storage_data
    names = [index.fqn for index in stored]
    assert sum(p.stat().st_size for p in ckpt.glob("*.distcp")) == sum(info.length for info in stored.values())
    assert len(names) == len(set(names))
    assert all(any(n.startswith(f"model.model.layers.{i}.") for n in names) for i in (0, 1)), names


def test_the_whole_group_killed_mid_run_resumes_bit_for_bit_on_its_layout(runs, killed, tmp_path):
    out = copy_of(killed, tmp_path / "run")
    ember_run(runs["recipe"], out, *PP_DDP)
    assert_same_result(out, runs["2x2"])


@pytest.mark.parametrize("args, layout", [
    (("--nproc", "2", "--set", "distributed.strategy=pp"), (2, "pp")),
    ((), (1, None)),  # one process: no ranks, no strategy in its attempt
], ids=["one-pipeline", "one-process"])
def test_its_checkpoint_resumes_on_other_layouts_within_the_tolerance(runs, killed, tmp_path, args, layout):
    """2 stages x 2 replicas -> 2 stages x 1 replica ('pp' on 2 ranks), and -> one process: DCP
    loads each stage by name; the rest of the run sums its gradients in another order: within
    RTOL of one process's (measured in the losses: 7.2e-8 on one pipeline, 4.8e-8 in one process)."""
    out = copy_of(killed, tmp_path / "run")
    ember_run(runs["recipe"], out, *args)
    close(out, runs["one"])
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert [(a.get("ranks", 1), a.get("strategy")) for a in attempts] == [(4, "pp+ddp"), layout]


def test_lora_on_two_pipelines_trains_what_one_process_trains(runs, tmp_path):
    """peft's adapters in the stages' layers; LoRA's dropout (0.1) keyed by each row's place in the
    stream, whichever replica computes it: losses and the adapter within RTOL of one process's
    (measured: losses equal, the adapter within 2.6e-8)."""
    lora = ("--set", "method.kind=lora", "--set", "method.dropout=0.1", "--set", "train.max_steps=3")
    ember_run(runs["recipe"], tmp_path / "one", *lora)
    ember_run(runs["recipe"], tmp_path / "2x2", *PP_DDP, *lora)
    close(tmp_path / "2x2", tmp_path / "one")
    assert (tmp_path / "2x2" / "final" / "adapter_model.safetensors").exists()
