"""LoRA under tensor parallelism on two ranks, with the shipped recipe's LoRA settings (dropout
0.05) on the tiny tied model of tests/e2e/test_distributed_lora.py: the adapters split with the
projections they wrap (ember/parallel/tp.py), yet train what one process trains, checkpoint
through DCP like the base weights, resume bit for bit after the whole group is SIGKILLed, reshard
onto one process, and export whole."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.artifacts import shared
from tests.distributed_harness import ember_run
from tests.e2e.test_distributed import close
from tests.e2e.test_distributed_lora import STEPS, make_lora_baselines
from tests.helpers import ROOT, assert_same_result, losses, run_ember

TP = ("--nproc", "2", "--set", "distributed.strategy=tp")


def make_tp_lora_baseline() -> dict:
    """Two ranks of TP+LoRA, uninterrupted (built once; read-only), beside the one-process run."""
    b = make_lora_baselines()
    folder = shared("distributed-tp-lora-baseline", STEPS, lambda f: ember_run(b["recipe"], f / "tp", *TP))
    return {**b, "tp": folder / "tp"}


def test_tp_lora_on_two_ranks_trains_what_one_process_trains():
    """Losses and the final adapter within RTOL of one process's; the adapter file holds whole
    tensors (the split lora_B/lora_A gathered), the same names and shapes as one process's."""
    b = make_tp_lora_baseline()
    close(b["tp"], b["one"])
    for f in (b["one"] / "final").glob("*.safetensors"):
        mine, one = load_file(b["tp"] / "final" / f.name), load_file(f)
        assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in one.items()}


def test_fsdp_tp_lora_on_four_ranks_trains_what_one_process_trains(tmp_path):
    """fsdp+tp, pairs of TP ranks sharded across the pairs (which read different rows): the
    adapters split as under tp, then sharded; losses and final adapter within RTOL of one
    process's (measured on the shipped tiny recipe: 8.6e-8 relative, 1.5e-8 absolute)."""
    b = make_tp_lora_baseline()
    ember_run(b["recipe"], tmp_path / "four", "--nproc", "4", "--set", "distributed.strategy=fsdp+tp")
    close(tmp_path / "four", b["one"])


def test_tp_lora_checkpoints_hold_the_adapters_split_as_their_base():
    """The DCP checkpoint holds the adapters and their Adam state alone (not the frozen base),
    each under the name and whole shape a one-process checkpoint gives it."""
    b = make_tp_lora_baseline()
    step = f"step-{STEPS:09d}"
    names = dcp.FileSystemReader(b["tp"] / "checkpoints" / step).read_metadata().state_dict_metadata
    single = load_file(b["one"] / "checkpoints" / step / "model.safetensors")
    model = {k.removeprefix("model."): names[k].size for k in names if k.startswith("model.")}
    assert model == {k: v.shape for k, v in single.items()} and all("lora_" in k for k in model)
    optim = {k.removeprefix("optim.state.") for k in names if k.startswith("optim.state.")}
    assert optim == {f"{n}.{s}" for n in model for s in ("step", "exp_avg", "exp_avg_sq")}


def crashed_at_step_7(recipe: Path, out: Path, *launch: str) -> None:
    """SIGKILL of every process at the 13th micro-batch (inside step 7; checkpoint at step 5)."""
    crashed = run_ember("run", recipe, "--out", out, "--no-ledger", *launch, env={"EMBER_FAULT": "train.micro_batch@13"})
    assert crashed.returncode != 0 and losses(out)[-1][0] == 6, crashed.stderr[-2000:]


def test_tp_lora_killed_whole_resumes_bit_for_bit_and_reshards_onto_one_process(tmp_path):
    """Both ranks SIGKILLed inside step 7: resumed on two TP ranks, every loss and adapter weight
    equals the uninterrupted run's; resumed on one process (DCP gathers the split adapters),
    within RTOL of the one-process run."""
    b = make_tp_lora_baseline()
    for name, then in [("two", TP), ("one", ())]:
        out = tmp_path / name
        crashed_at_step_7(b["recipe"], out, *TP)
        ember_run(b["recipe"], out, *then)
        if name == "two":
            assert_same_result(out, b["tp"])
        else:
            close(out, b["one"])


def test_a_one_process_lora_checkpoint_resumes_on_two_tp_ranks(tmp_path):
    """The reverse: one process killed inside step 7, resumed on two TP ranks (DCP splits the
    adapters its checkpoint holds whole): within RTOL of the one-process run."""
    b = make_tp_lora_baseline()
    crashed_at_step_7(b["recipe"], tmp_path / "run")
    ember_run(b["recipe"], tmp_path / "run", *TP)
    close(tmp_path / "run", b["one"])


def test_the_readmes_tp_lora_command_runs_its_shipped_recipe(tmp_path):
    """`ember run examples/tiny-lora-tp.toml --out runs/tplora --nproc 2` as the README writes it
    (LoRA with dropout on all seven projections, strategy tp in the recipe) trains what the same
    recipe trains in one process, within the stated tolerance."""
    assert "ember run examples/tiny-lora-tp.toml --out runs/tplora --nproc 2" in (ROOT / "README.md").read_text()
    recipe = ROOT / "examples" / "tiny-lora-tp.toml"
    ember_run(recipe, tmp_path / "two", "--nproc", "2")
    ember_run(recipe, tmp_path / "one")
    close(tmp_path / "two", tmp_path / "one")
    world = json.loads((tmp_path / "two" / "run.json").read_text())["manifest"]["world"]
    assert (world["ranks"], world["strategy"]) == (2, "tp")
