"""The checkpoint files of format ember-checkpoint/2: safetensors written from the tensors'
memory, CRC32C computed while writing, every kind of damage detected; /1 checkpoints load."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.ckpt import contents, tensorfile
from ember.ckpt.state import RunState
from ember.ckpt.store import MANIFEST, CheckpointStore
from ember.durable import write_stream
from tests.helpers import MANIFEST_DAMAGE


def training_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64, dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model[1](model[0](torch.randn(8, 64)).bfloat16()).float().sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = RunState(step=7)
    state.capture_rng(torch.device("cpu"))
    return model, opt, sched, scaler, state


def fresh_like(model, opt):
    """The same model and optimizer, with other values, to load into."""
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64, dtype=torch.bfloat16))
    other_opt = torch.optim.AdamW(other.parameters(), lr=5e-4, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(other_opt, lambda s: 1.0)
    return other, other_opt, sched, torch.amp.GradScaler("cpu", enabled=False)


def assert_same_state(model, opt, other, other_opt):
    for (n, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    sa, sb = opt.state_dict(), other_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, s in sa["state"].items():
        for k, t in s.items():
            assert t.dtype == sb["state"][i][k].dtype and torch.equal(t, sb["state"][i][k]), (i, k)


def test_a_checkpoint_round_trips_bit_for_bit_and_its_files_are_plain_safetensors(tmp_path):
    model, opt, sched, scaler, state = training_state()
    store = CheckpointStore(tmp_path / "ck", keep_last=1)
    snap = contents.snapshot(model, opt, sched, scaler, state, copy=True, buffers={})
    ck = store.save(7, lambda d: contents.write_snapshot(d, snap), meta={})
    assert ck.manifest["format"] == "ember-checkpoint/2"
    assert sorted(ck.manifest["files"]) == ["model.safetensors", "optimizer.safetensors", "train_state.pt"]
    assert all(set(f) == {"bytes", "crc32c"} for f in ck.manifest["files"].values())
    weights = load_file(ck.path / "model.safetensors")  # safetensors' own reader accepts it
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    other, other_opt, other_sched, other_scaler = fresh_like(model, opt)
    store.verify(ck.path)
    assert contents.read_files(ck.path, other, other_opt, other_sched, other_scaler).step == 7
    assert_same_state(model, opt, other, other_opt)


def test_a_nested_state_keeps_its_structure():
    tree = {"state": {0: {"step": torch.tensor(3.0), "m": torch.arange(5)}}, "groups": [
        {"betas": (0.9, 0.99), "lr": 1e-3, "name": "x", "flag": None, "eps": float("inf")}]}
    tensors: dict = {}
    structure = tensorfile._unflatten(json.loads(json.dumps(tensorfile._flatten(tree, "", tensors))), tensors)
    assert sorted(tensors) == ["state/0/m", "state/0/step"]
    assert structure["groups"] == tree["groups"] and isinstance(structure["groups"][0]["betas"], tuple)
    assert list(structure["state"]) == [0] and structure["state"][0]["m"] is tensors["state/0/m"]


@pytest.mark.parametrize("damage", [*MANIFEST_DAMAGE, "missing_file"])
def test_each_kind_of_damage_fails_the_fast_checksum(tmp_path, damage):
    store = CheckpointStore(tmp_path / "ck", keep_last=3)
    data = torch.randn(64 * 1024)  # 256 KiB: a zeroed 4 KiB block lies inside the data
    ck = store.save(1, lambda d: {"w.bin": write_stream(d / "w.bin", [memoryview(data.numpy())])}, meta={})
    assert store.verify(ck.path)
    if damage == "missing_file":
        (ck.path / "w.bin").unlink()
    else:
        MANIFEST_DAMAGE[damage](ck.path / "w.bin")
    expected = {"truncate": "bytes, manifest says", "missing_file": "is missing"}.get(damage, "fails its CRC32C check")
    with pytest.raises(ValueError, match=expected):
        store.verify(ck.path)


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE)
def test_damage_to_the_manifest_itself_is_detected(tmp_path, damage):
    store = CheckpointStore(tmp_path / "ck", keep_last=3)
    ck = store.save(1, lambda d: (d / "w.bin").write_bytes(b"w" * 5000), meta={"loss": 1.25})
    MANIFEST_DAMAGE[damage](ck.path / MANIFEST)
    with pytest.raises(ValueError):
        store.verify(ck.path)


def write_v1(folder: Path, snap: contents.Snapshot, step: int) -> None:
    """A checkpoint exactly as ember-checkpoint/1 wrote it: save_file, torch.save, SHA-256."""
    folder.mkdir(parents=True)
    save_file(snap.weights, folder / "model.safetensors")
    torch.save(snap.optimizer, folder / "optimizer.pt")
    torch.save(snap.extra, folder / "train_state.pt")
    files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(folder.iterdir())}
    (folder / MANIFEST).write_text(json.dumps({"format": "ember-checkpoint/1", "step": step,
                                               "created": time.time(), "files": files, "meta": {}}))


def test_a_checkpoint_of_the_first_format_verifies_and_loads(tmp_path):
    model, opt, sched, scaler, state = training_state()
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    write_v1(store.root / "step-000000007", contents.snapshot(model, opt, sched, scaler, state, copy=False), 7)  # live tensors, as v1 saved them
    ck = store.load_latest(pytest.fail)
    assert ck is not None and ck.manifest["format"] == "ember-checkpoint/1"
    other, other_opt, other_sched, other_scaler = fresh_like(model, opt)
    assert contents.read_files(ck.path, other, other_opt, other_sched, other_scaler).step == 7
    assert_same_state(model, opt, other, other_opt)
    MANIFEST_DAMAGE["flip_bit"](ck.path / "optimizer.pt")
    with pytest.raises(ValueError, match="optimizer.pt fails its SHA-256 check"):
        store.verify(ck.path)


def test_retirement_deletes_behind_the_commit_and_settle_waits_for_it(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep_last=1)
    for step in (1, 2, 3):
        store.save(step, lambda d: (d / "w.bin").write_bytes(b"x" * 100_000), meta={})
    store.settle()
    assert [p.name for p in store.root.iterdir()] == ["step-000000003"]
