"""Pipeline parallelism (strategy 'pp') on two ranks of this CPU: the tiny model's two decoder
layers on two stages. It trains what one process trains within the stated tolerance, LoRA too;
the whole group SIGKILLed mid-step resumes bit-for-bit; what it cannot do is refused before
launch."""

from __future__ import annotations

import json
import math
import re

import pytest

from ember.errors import EmberError
from ember.recipe import load_recipe
from ember.train.sharding import check_distributed
from tests.artifacts import shared
from tests.distributed_harness import STEPS, ember_run, make_baselines, recipe
from tests.e2e.test_distributed import close
from tests.helpers import ROOT, assert_same_result, losses, run_ember

PP = ("--nproc", "2", "--set", "distributed.strategy=pp")


@pytest.fixture
def pipeline() -> dict:
    """The one-process baseline and an uninterrupted 2-stage run (1F1B) of the same recipe."""
    def build(folder):
        ember_run(recipe(folder), folder / "pp", *PP)
    one = make_baselines()
    return {**one, "pp": shared("pipeline-baseline", STEPS, build) / "pp"}


def test_two_stages_train_what_one_process_trains(pipeline):
    """Same layers, same order of sums within a micro-batch: the losses and final weights agree
    with one process's within RTOL (1e-5; the clipping norm, summed over the stages in float64,
    differs in its last bits: measured at most 2.4e-7 on a loss of ~5)."""
    close(pipeline["pp"], pipeline["one"])
    record = json.loads((pipeline["pp"] / "run.json").read_text())
    assert record["manifest"]["world"] == {"ranks": 2, "strategy": "pp", "backend": "gloo"}
    assert len(losses(pipeline["pp"])) == STEPS and all(math.isfinite(x) for _, x in losses(pipeline["pp"]))
    ckpt = pipeline["pp"] / "checkpoints" / f"step-{STEPS:09d}"
    assert {p.name for p in ckpt.iterdir()} >= {"__0_0.distcp", "__1_0.distcp"}  # each stage its own


def test_each_stage_records_its_bubble_beside_the_schedules(pipeline):
    """Every step's phases hold the stage's bubble (its wait inside the schedule); ranks.json each
    stage's median share and the schedule's (2-1)/(2+2-1); `ember report` says both. Not a
    DDP step's. (Values are timings: only their arithmetic is asserted.)"""
    rows = [json.loads(x) for x in (pipeline["pp"] / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        ph = r["phases"]
        assert ph["bubble"] >= 0 and ph["forward"] > 0 and ph["backward"] > 0
        assert sum(v for k, v in ph.items() if k != "checkpoint") <= r["step_seconds"] * 1.001 + 1e-5, r  # the save before it: not its time
    ddp = json.loads((pipeline["ddp"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert "bubble" not in ddp["phases"]
    ranks = json.loads((pipeline["pp"] / "ranks.json").read_text())
    assert ranks["bubble_predicted"] == pytest.approx(1 / 3)
    assert all(0 <= r["bubble"] < 1 for r in ranks["ranks"])
    assert ranks["bubble"] == pytest.approx(sum(r["bubble"] for r in ranks["ranks"]) / 2)
    shown = run_ember("report", pipeline["pp"])
    assert shown.returncode == 0 and "pipeline bubble: " in shown.stdout and "33.3% predicted" in shown.stdout, \
        shown.stdout[-2000:] + shown.stderr[-2000:]


def test_the_whole_group_killed_mid_step_resumes_bit_for_bit_under_either_schedule(pipeline, tmp_path):
    """SIGKILL of both stages at the 13th micro-batch (inside step 7; checkpoint at step 5), then a
    resume: every loss and final weight equal to the uninterrupted run's. Under GPipe, against
    the 1F1B baseline: both schedules compute the same gradients in the same order."""
    out = tmp_path / "run"
    gpipe = ("--set", "distributed.schedule=gpipe")
    crashed = run_ember("run", pipeline["recipe"], "--out", out, "--no-ledger", *PP, *gpipe,
                        env={"EMBER_FAULT": "train.micro_batch@13"})
    assert crashed.returncode != 0 and losses(out)[-1][0] == 6, crashed.stderr[-2000:]
    assert "killed by SIGKILL" in crashed.stderr
    ember_run(pipeline["recipe"], out, *PP, *gpipe)
    assert_same_result(out, pipeline["pp"])


def test_lora_on_two_stages_trains_what_one_process_trains(pipeline, tmp_path):
    """peft's adapters in the stages' layers; LoRA's dropout (0.1) keyed by each row's place in
    the stream, which the schedule hands each stage's forward: the losses and the adapter agree
    with one process's (measured bit for bit; asserted within RTOL)."""
    lora = ("--set", "method.kind=lora", "--set", "method.dropout=0.1", "--set", "train.max_steps=4")
    ember_run(pipeline["recipe"], tmp_path / "one", *lora)
    ember_run(pipeline["recipe"], tmp_path / "pp", *PP, *lora)
    close(tmp_path / "pp", tmp_path / "one")
    assert (tmp_path / "pp" / "final" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("ranks, sets, said", [
    (3, [], "3 stages (one per rank) for the model's 2 decoder layers"),
    (2, ["method.kind=lora", "method.dropout=0.1", "train.activation_checkpointing=true"],
     "LoRA's dropout with [train] activation_checkpointing"),
    (2, ["eval.holdout=0.1"], "the held-out evaluation runs the whole model's forward"),
    (2, ["precision.mode=fp16"], "the schedule runs backward itself on the unscaled loss"),
    (2, ["train.grad_accum=1"], "schedule '1f1b' runs at least one micro-batch per stage, and grad_accum = 1 "
                                "gives each pipeline 1 for 2 stages; set [train] grad_accum = 2"),
])
def test_what_a_pipeline_cannot_do_is_refused_with_the_fix(tmp_path, ranks, sets, said):
    r = load_recipe(recipe(tmp_path), ["distributed.strategy=pp", *sets])
    with pytest.raises(EmberError) as e:
        check_distributed(r, ranks, "recipe.toml")
    assert str(e.value).startswith("recipe.toml: [distributed] strategy = 'pp'") and said in str(e.value)
    assert "use " in str(e.value) or "set " in str(e.value)  # and what to do instead


def test_more_stages_than_layers_is_refused_before_launch(tmp_path):
    done = run_ember("run", ROOT / "examples" / "tiny.toml", "--out", tmp_path / "run", "--nproc", "3",
                     "--set", "distributed.strategy=pp", "--set", "train.grad_accum=3")
    assert done.returncode != 0 and "the model's 2 decoder layers" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()



def test_a_one_process_checkpoint_is_refused_on_pipeline_stages_by_name(pipeline, tmp_path):
    """A one-process checkpoint keys its optimizer state by the whole model's parameter order,
    which a stage does not hold: resuming it on stages is refused, naming the checkpoint and the
    ways on (before: an IndexError traceback from every rank, when the crash let its
    asynchronous checkpoint commit first)."""
    out = tmp_path / "run"
    crashed = run_ember("run", pipeline["recipe"], "--out", out, "--no-ledger", "--set", "checkpoint.async=false",
                        env={"EMBER_FAULT": "train.micro_batch@13"})  # synchronous: step 5's is committed
    assert crashed.returncode != 0 and losses(out)[-1][0] == 6, crashed.stderr[-2000:]
    assert (out / "checkpoints" / "step-000000005").is_dir()
    refused = run_ember("run", pipeline["recipe"], "--out", out, "--no-ledger", "--set", "checkpoint.async=false",
                        *PP)
    assert refused.returncode != 0, refused.stderr[-2000:]
    assert "cannot be resumed on pipeline stages yet" in refused.stderr and "step-000000005" in refused.stderr
    assert "IndexError" not in refused.stderr, refused.stderr[-2000:]


def test_a_stage_killed_mid_step_is_named_and_its_lost_step_is_accounted(pipeline, tmp_path):
    """SIGKILL of stage 1 inside step 7's schedule (its 14th forward: the first step runs one more,
    the schedule's shape inference; step 5's checkpoint written synchronously): the launcher names the rank with its stage and layers, the supervisor restarts
    the group, the run ends bit-for-bit where the uninterrupted one did, and the goodput buckets
    hold the recomputed step 6 as wasted progress, as they do for DDP."""
    out = tmp_path / "run"
    env = {"EMBER_FAULT": "pipeline.stage_forward@14", "EMBER_FAULT_RANK": "1",
           "EMBER_FAULT_ONCE": str(tmp_path / "once")}
    done = run_ember("run", pipeline["recipe"], "--out", out, *PP, "--restarts", "1",
                     "--set", "checkpoint.async=false", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 (pipeline stage 1 of 2, layer 1) failed first (killed by SIGKILL)" in done.stderr, \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert_same_result(out, pipeline["pp"])
    shown = run_ember("report", out, "--json")
    assert shown.returncode == 0, shown.stderr[-2000:]
    report = json.loads(shown.stdout)
    g = report["goodput"]
    lost = [json.loads(line) for line in (out / "metrics.lost.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lost] == [6] and g["lost_steps"] == 1
    assert g["buckets"]["wasted_progress"] == pytest.approx(lost[0]["step_seconds"])
    assert sum(g["buckets"].values()) == pytest.approx(g["wall_seconds"], rel=0.01)
    assert [a["outcome"] for a in report["attempts"]][-1] == "completed" and len(report["attempts"]) == 2


def test_a_stalled_stage_is_named_with_its_stage_by_the_watchdog(pipeline, tmp_path):
    """Stage 1 sleeps inside step 7's first forward (its 14th, as above): stage 0 waits in the schedule's send/receive;
    the watchdog calls the step hung past its bound (here 2 s) and names the stalled rank with its
    stage; the run ends 70 (unsupervised), saying what was saved."""
    out = tmp_path / "run"
    env = {"EMBER_FAULT": "pipeline.stage_forward@14", "EMBER_FAULT_RANK": "1", "EMBER_FAULT_HANG": "600"}
    done = run_ember("run", pipeline["recipe"], "--out", out, "--no-ledger", *PP,
                     "--set", "distributed.hang_min_seconds=2", env=env)
    assert done.returncode == 70, done.stderr[-3000:]
    assert re.fullmatch(r"warning: hang: rank 1 \(pipeline stage 1 of 2, layer 1\) never arrived at the "
                        r"pipeline's send/receive between stages \(stages\.py:\d+ step\) in step 7; rank 0 "
                        r"waited there [\d.]+ s; the group was stopped, exit 70; saved: checkpoint step 5, "
                        r"the newest committed, where a resume continues",
                        done.stderr.strip().splitlines()[-1]), done.stderr[-3000:]
    assert "rank 1 (pipeline stage 1 of 2, layer 1): last step 6; step 7: not in a collective: faults.py" \
        in done.stderr, done.stderr[-3000:]
    assert "pipeline stage 1 of 2" in (out / "hang-rank1.txt").read_text()
