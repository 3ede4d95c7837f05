"""LoRA on two ranks with the shipped recipe's LoRA settings (examples/smollm2-lora.toml: r, alpha,
dropout 0.05, target modules) on a tiny model whose head is tied to its embeddings, as SmolLM2's
is: dropout that does not depend on the world size, checkpoints that hold the adapters alone,
and exact resume at the same world size and within the tolerance at another."""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.artifacts import shared
from tests.distributed_harness import ember_run
from tests.e2e.test_distributed import close
from tests.helpers import ROOT, assert_same_result, losses, run_ember, write_recipe

STEPS = 12


def tied_tiny_model(folder: Path) -> Path:
    """builtin:tiny with tie_word_embeddings, as a model folder (byte tokenizer)."""
    from transformers import LlamaForCausalLM

    from ember.models import tiny_config
    from ember.data.tokenizer import ByteTokenizer
    config = tiny_config()
    config.tie_word_embeddings = True
    folder.mkdir()
    LlamaForCausalLM(config).save_pretrained(folder)
    ByteTokenizer().save(folder)
    return folder


def make_lora_baselines() -> dict:
    """One process and two ranks of FSDP, uninterrupted (built once; read-only)."""
    def build(folder: Path) -> None:
        method = tomllib.loads((ROOT / "examples" / "smollm2-lora.toml").read_text())["method"]
        r = write_recipe(folder, model={"path": str(tied_tiny_model(folder / "model"))}, method=method,
                         train={"max_steps": STEPS, "grad_accum": 2}, checkpoint={"every_steps": 5, "keep_last": 2})
        ember_run(r, folder / "one")
        ember_run(r, folder / "fsdp", "--nproc", "2", "--set", "distributed.strategy=fsdp")
    folder = shared("distributed-lora-baselines", STEPS, build)
    return {"recipe": folder / "recipe.toml", "one": folder / "one", "fsdp": folder / "fsdp"}


def test_the_shipped_lora_dropout_trains_the_same_on_one_process_and_two_ranks():
    """Dropout 0.05, as shipped: the masks follow the sample, not the rank that computes it (it
    was 2e-4 apart in the loss, twenty times the tolerance)."""
    b = make_lora_baselines()
    assert "dropout = 0.05" in b["recipe"].read_text()
    close(b["fsdp"], b["one"])


def test_fsdp_lora_checkpoints_hold_the_adapters_and_their_optimizer_state_alone():
    """Not the frozen head tied to the embeddings (it was in every checkpoint under FSDP, 127.6 MB
    of SmolLM2's where the adapters and their Adam state take 11.2 MB); the same tensors as a
    one-process checkpoint holds."""
    b = make_lora_baselines()
    step = b["fsdp"] / "checkpoints" / f"step-{STEPS:09d}"
    names = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    model = {k.removeprefix("model.") for k in names if k.startswith("model.")}
    single = load_file(b["one"] / "checkpoints" / f"step-{STEPS:09d}" / "model.safetensors")
    assert model == set(single) and all("lora_" in k for k in model)
    optim = {k.removeprefix("optim.state.") for k in names if k.startswith("optim.state.")}
    assert optim == {f"{n}.{s}" for n in model for s in ("step", "exp_avg", "exp_avg_sq")}


def test_lora_resumes_exactly_on_two_ranks_and_within_the_tolerance_on_one(tmp_path):
    """Rank 1 SIGKILLed inside step 7; the run resumed from step 5 on two ranks ends bit for bit
    as the uninterrupted one, and resumed on one process (DCP reshards) within the tolerance."""
    b = make_lora_baselines()
    for name, then in [("two", ["--nproc", "2", "--set", "distributed.strategy=fsdp"]), ("one", [])]:
        out = tmp_path / name
        crashed = run_ember("run", b["recipe"], "--out", out, "--no-ledger", "--nproc", "2",
                            "--set", "distributed.strategy=fsdp",
                            env={"EMBER_FAULT": "train.micro_batch@7", "EMBER_FAULT_RANK": "1"})
        assert crashed.returncode == 1 and losses(out)[-1][0] == 6, crashed.stderr[-2000:]
        ember_run(b["recipe"], out, *then)
        if name == "two":
            assert_same_result(out, b["fsdp"])
        else:
            close(out, b["one"])
