"""`ember export --checkpoint STEP|best|last`: the weights the run had at that checkpoint, the one
with the lowest held-out loss, or the newest; anything else is refused naming the steps there are.

The runs are the builtin tiny model with a constant learning rate, so a run of 10 steps ends with
the weights a longer run of the same recipe had at its step 10."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ember.ckpt.store import CheckpointStore
from ember.errors import EmberError
from ember.infer.export import export_run
from tests.helpers import run_ember, write_recipe

pytestmark = pytest.mark.e2e
CONSTANT = {"optimizer": {"lr": 1e-2}, "schedule": {"kind": "constant", "warmup_steps": 0},
            "checkpoint": {"every_steps": 10, "keep_last": 3}}
LORA = {"method": {"kind": "lora", "rank": 4, "alpha": 8.0}}


def train(folder: Path, steps: int, **sections) -> Path:
    recipe = write_recipe(folder, train={"max_steps": steps}, **{**CONSTANT, **sections})
    done = run_ember("run", recipe, "--out", folder / "run", "--no-ledger")
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_equal_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("method", ["full", "lora"])
def test_checkpoint_10_exports_what_a_run_stopped_at_10_ends_with(tmp_path, method):
    extra = LORA if method == "lora" else {}
    longer = train(tmp_path / "longer", 20, **extra)
    stopped = train(tmp_path / "stopped", 10, **extra)
    done = run_ember("export", longer, "--format", "hf", "--checkpoint", "10", "--out", tmp_path / "at10")
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(tmp_path / "at10") in done.stdout
    assert_equal_weights(weights(tmp_path / "at10"), weights(Path(export_run(stopped, "hf", tmp_path / "end10").path)))
    final = weights(Path(export_run(longer, "hf", tmp_path / "end20").path))  # step 20 is not step 10
    assert any(not torch.equal(final[k], v) for k, v in weights(tmp_path / "at10").items())


def test_peft_export_of_a_checkpoint_is_its_adapter(tmp_path):
    run = train(tmp_path, 20, **LORA)
    out = Path(export_run(run, "peft", checkpoint="10").path)
    assert out == run / "export" / "peft-step-10"  # the default --out says the step
    ours = load_file(out / "adapter_model.safetensors")
    saved = load_file(run / "checkpoints" / "step-000000010" / "model.safetensors")
    assert len(ours) == len(saved) > 0
    for name, tensor in ours.items():  # peft's names drop the adapter's name ("default")
        assert torch.equal(tensor, saved[name.replace(".weight", ".default.weight")]), name


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full run checkpointed every 4 steps with a held-out evaluation at each, kept whole."""
    folder = tmp_path_factory.mktemp("evaluated")
    recipe = write_recipe(folder, train={"max_steps": 28}, optimizer={"lr": 3e-2},
                          schedule={"kind": "constant", "warmup_steps": 0},
                          checkpoint={"every_steps": 4, "keep_last": 10, "keep_best": False},
                          eval={"holdout": 0.1, "every_steps": 4, "max_batches": 4})
    done = run_ember("run", recipe, "--out", folder / "run", "--no-ledger")
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


def test_best_is_the_checkpoint_of_the_lowest_held_out_loss_and_last_the_newest(evaluated, tmp_path):
    held_out = {r["step"]: r["eval_loss"] for r in map(json.loads, (evaluated / "metrics.jsonl").read_text().splitlines())
                if "eval_loss" in r}
    assert sorted(held_out) == [4, 8, 12, 16, 20, 24, 28]
    best = min(held_out, key=held_out.get)
    assert best != 28, "the run must overshoot for best and last to differ"
    for which, step in (("best", best), ("last", 28)):
        out = Path(export_run(evaluated, "hf", tmp_path / which, checkpoint=which).path)
        assert_equal_weights(weights(out), weights(evaluated / "checkpoints" / f"step-{step:09d}"))


def test_a_checkpoint_that_is_not_there_is_refused_naming_those_that_are(evaluated, tmp_path):
    steps = "4, 8, 12, 16, 20, 24, 28"
    for which, why in (("10", "no committed checkpoint at step 10"), ("newest", "not a step, 'best' or 'last'"),
                       ("-4", "not a step"), ("²", "not a step, 'best' or 'last'")):
        with pytest.raises(EmberError, match=f"--checkpoint '{which}': {why}.*steps {steps}"):
            export_run(evaluated, "hf", tmp_path / "out", checkpoint=which)
    assert not (tmp_path / "out").exists()
    done = run_ember("export", evaluated, "--format", "hf", "--checkpoint", "10")
    assert done.returncode == 1 and f"steps {steps}" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("method", ["full", "lora"])
def test_damaged_final_weights_are_refused_naming_them_and_the_way_out(tmp_path, method):
    """final/ has no manifest to verify first: a weights file there cut short is refused by
    name, without a traceback, writing nothing; its checkpoints still export."""
    run = train(tmp_path, 10, **(LORA if method == "lora" else {}))
    weights = next((run / "final").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    for fmt in ("hf", "peft") if method == "lora" else ("hf",):
        with pytest.raises(EmberError, match=f"{run / 'final'}: the run's weights there cannot be read.*"
                                             f"--checkpoint last"):
            export_run(run, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists() and not list(tmp_path.glob(f".tmp-{fmt}*"))
    done = run_ember("export", run, "--format", "hf", "--out", tmp_path / "hf")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "cannot be read" in done.stderr
    assert export_run(run, "hf", tmp_path / "from-checkpoint", checkpoint="last").kind == method


def test_best_without_evaluations_says_so(tmp_path):
    run = train(tmp_path, 10)
    with pytest.raises(EmberError, match="--checkpoint best: none of .* has a held-out loss"):
        export_run(run, "hf", checkpoint="best")


def test_a_checkpoint_several_ranks_wrote_loads_its_weights_in_one_process(tmp_path):
    """DCP checkpoints (distributed runs) export too: their trainable weights, without a process group."""
    import warnings

    from transformers import LlamaForCausalLM

    from ember.ckpt.sharded import is_sharded, read_model, write_sharded
    from ember.ckpt.state import RunState
    from ember.models import tiny_config
    from ember.world import World
    torch.manual_seed(0)
    saved = LlamaForCausalLM(tiny_config())
    optimizer = torch.optim.AdamW(saved.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        write_sharded(tmp_path, saved, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                      torch.amp.GradScaler(enabled=False), RunState(), World())
    assert is_sharded(tmp_path)
    torch.manual_seed(1)
    loaded = LlamaForCausalLM(tiny_config())
    read_model(tmp_path, loaded)
    assert_equal_weights(saved.state_dict(), loaded.state_dict())


def test_a_checkpoint_the_training_run_retires_while_it_is_exported_is_named_as_retired(tmp_path, monkeypatch):
    """`ember export RUN --checkpoint last` while RUN trains: the run committed a newer checkpoint
    and retired the one being exported (keep_last) between its verification and its read, and
    the export ended in 'No such file or directory: .../model.safetensors', with nothing to say
    what happened or what to do."""
    from ember.ckpt import contents
    from ember.ckpt.state import RunState
    from ember.events import Events
    from ember.infer import export
    from ember.recipe import load_recipe
    from ember.runfolder import RunDir
    from ember.train.model import load_model
    recipe = load_recipe(write_recipe(tmp_path))
    run = RunDir.open(tmp_path / "run", recipe, False, Events())
    run.lock.release()
    model = load_model(recipe.model, recipe.method, False, Events()).model
    optimizer = torch.optim.AdamW(model.parameters())
    snap = contents.snapshot(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                             torch.amp.GradScaler("cpu", enabled=False), RunState(step=3), copy=False)
    CheckpointStore(run.ckpt_dir, keep_last=2).save(3, lambda folder: contents.write_snapshot(folder, snap), {})

    def built_while_the_run_retires_it(*args, **kwargs):
        ckpt = run.ckpt_dir / "step-000000003"
        ckpt.rename(ckpt.with_name(".del-step-000000003"))  # what retirement does (ember.ckpt.store)
        return load_model(*args, **kwargs)

    monkeypatch.setattr(export, "load_model", built_while_the_run_retires_it)
    with pytest.raises(EmberError, match=r"step-000000003 was retired by the run training in .* while it was "
                                         r"read .*export again"):
        export_run(run.path, "hf", tmp_path / "out", checkpoint="last")
    assert not (tmp_path / "out").exists()
