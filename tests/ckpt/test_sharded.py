"""Checkpoints of a distributed run (ember.ckpt.sharded, DCP) read in one process: a checkpoint
that does not fit the model is refused as a one-process checkpoint is, by a ValueError."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

from ember.ckpt.sharded import own_files, read_model, read_sharded, write_sharded
from ember.ckpt.state import RunState
from ember.ckpt.store import CheckpointNotWritten, CheckpointStore
from ember.models import tiny_config
from ember.world import World


def parts(model: torch.nn.Module):
    optimizer = torch.optim.AdamW(model.parameters())
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), torch.amp.GradScaler(enabled=False)


def test_a_sharded_checkpoint_of_other_shapes_is_a_value_error_not_a_traceback(tmp_path):
    """A DCP checkpoint read into a model of other shapes (its recipe changed with
    --allow-recipe-change) raised torch's CheckpointException, a BaseException that no handler
    took: `ember run` resuming it and `ember export --checkpoint` ended in a traceback, where a
    one-process checkpoint is refused as 'intact but does not load into this run's model'."""
    torch.manual_seed(0)
    saved = LlamaForCausalLM(tiny_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        write_sharded(tmp_path, saved, *parts(saved), RunState(step=3), World())
    config = tiny_config()
    config.intermediate_size *= 2
    other = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="mlp") as info:
        read_model(tmp_path, other)
    assert "Traceback" not in str(info.value)
    with pytest.raises(ValueError, match="mlp"):
        read_sharded(tmp_path, other, *parts(other), World())


def test_a_sharded_checkpoint_on_a_full_disk_is_not_written_and_says_to_free_space(small_disk):
    """A distributed run's checkpoint on a full disk raised DCP's CheckpointException, which the
    store's `except Exception` let through: every rank ended in a traceback instead of 'could not
    be written ... free disk space' (torch.save says only 'unexpected pos': the disk is asked)."""
    store = CheckpointStore(small_disk("128k") / "ck", keep_last=2)
    torch.manual_seed(0)
    model, world = LlamaForCausalLM(tiny_config()), World()
    with warnings.catch_warnings(), pytest.raises(CheckpointNotWritten) as info:
        warnings.simplefilter("ignore", UserWarning)
        store.save_collective(1, lambda f: write_sharded(f, model, *parts(model), RunState(step=1), world),
                              lambda f: own_files(f, world), {}, world)
    message = str(info.value)
    assert info.value.disk_full and "MB free there" in message and "free disk space" in message, message
    assert store.committed() == []


def test_a_one_process_checkpoint_for_more_parameters_than_the_ranks_train_is_a_value_error(tmp_path):
    """Resuming a one-process checkpoint on several ranks (read_full) after a recipe change that
    trains fewer parameters (LoRA on fewer modules) ended each rank in an IndexError traceback
    ('list index out of range' mapping the optimizer's state to names), not 'does not load'."""
    from ember.ckpt import contents
    from ember.ckpt.sharded import read_full
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer, scheduler, scaler = parts(model)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    snap = contents.snapshot(model, optimizer, scheduler, scaler, RunState(step=1), copy=False)
    contents.write_snapshot(tmp_path, snap)
    fewer = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="optimizer state holds 4 parameters; this model trains 2"):
        read_full(tmp_path, fewer, ["0.weight", "0.bias"], *parts(fewer))
