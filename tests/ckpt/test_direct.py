"""Checkpoint files written with O_DIRECT from page-aligned file images (ember.ckpt.tensorfile
FileImage, ember.durable.write_image), the buffered fallback, and the persist's niceness."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from ember import durable
from ember.ckpt import contents, tensorfile
from ember.ckpt.store import CheckpointStore
from ember.durable import crc32c_file, write_image
from tests.ckpt.test_format import assert_same_state, fresh_like, training_state


def spy_open_flags(monkeypatch) -> list[int]:
    """The flags of every os.open in ember.durable (the real call still happens)."""
    seen, real = [], os.open

    def recording(path, flags, *args, **kw):
        seen.append(flags)
        return real(path, flags, *args, **kw)
    monkeypatch.setattr(durable.os, "open", recording)
    return seen


def image_with(tensors, metadata=None) -> tensorfile.FileImage:
    img = tensorfile.image_of(tensors, metadata, None, pinned=False)
    for n, t in tensors.items():
        img.tensors[n].copy_(t)
    return img


def test_an_image_is_written_with_o_direct_and_is_a_plain_safetensors_file(tmp_path, monkeypatch):
    tensors = {"a": torch.randn(1000, 37), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(3).bfloat16(),
               "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 4)}
    img = image_with(tensors, {"format": "pt"})
    assert img.view().nbytes % 4096 == 0 and img.size % 4096 != 0  # a partial last page to cut away
    flags = spy_open_flags(monkeypatch)
    entry = write_image(tmp_path / "x.safetensors", img.view(), img.size)
    assert flags and all(f & os.O_DIRECT for f in flags)
    assert entry == {"bytes": img.size, "crc32c": crc32c_file(tmp_path / "x.safetensors")}
    assert os.path.getsize(tmp_path / "x.safetensors") == img.size
    back = load_file(tmp_path / "x.safetensors")
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())


def test_a_buffer_o_direct_cannot_take_is_written_buffered_and_a_tmpfs_file_is_whole(tmp_path, small_disk,
                                                                                       monkeypatch):
    img = image_with({"w": torch.randn(300, 300)})
    unaligned = img.view()[8:8 + 4096 * 90]  # O_DIRECT needs a page-aligned address: never tried
    flags = spy_open_flags(monkeypatch)
    entry = write_image(tmp_path / "u.bin", unaligned, 300_000)
    assert flags and not any(f & os.O_DIRECT for f in flags)
    assert entry == {"bytes": 300_000, "crc32c": crc32c_file(tmp_path / "u.bin")}
    assert (tmp_path / "u.bin").read_bytes() == bytes(unaligned[:300_000])
    disk = small_disk("64m")  # tmpfs: O_DIRECT refused (older kernels) or taken; the file is whole either way
    entry = write_image(disk / "w.safetensors", img.view(), img.size)
    assert entry == {"bytes": img.size, "crc32c": crc32c_file(disk / "w.safetensors")}
    assert torch.equal(load_file(disk / "w.safetensors")["w"], img.tensors["w"])


def test_snapshots_reuse_their_images_and_a_grown_header_gets_a_new_one():
    model, opt, sched, scaler, state = training_state()
    buffers: dict = {}
    contents.snapshot(model, opt, sched, scaler, state, copy=True, buffers=buffers)
    first = {name: img.file.data_ptr() for name, img in buffers.items() if isinstance(img, tensorfile.FileImage)}
    assert sorted(first) == ["model.safetensors", "optimizer.safetensors"]
    opt.param_groups[0]["lr"] = 1.234567890123e-7  # the metadata changes; it still fits its room
    snap = contents.snapshot(model, opt, sched, scaler, state, copy=True, buffers=buffers)
    assert {n: buffers[n].file.data_ptr() for n in first} == first
    assert snap.optimizer["param_groups"][0]["lr"] == 1.234567890123e-7
    opt.param_groups[0]["note"] = "x" * 5000  # outgrows the reserved room: a new image
    contents.snapshot(model, opt, sched, scaler, state, copy=True, buffers=buffers)
    assert buffers["optimizer.safetensors"].file.data_ptr() != first["optimizer.safetensors"]
    assert buffers["model.safetensors"].file.data_ptr() == first["model.safetensors"]


def test_a_checkpoint_from_images_round_trips_bit_for_bit(tmp_path):
    model, opt, sched, scaler, state = training_state()
    opt.param_groups[0]["lr"] = 3e-4
    store = CheckpointStore(tmp_path / "ck", keep_last=1)
    buffers: dict = {}
    contents.snapshot(model, opt, sched, scaler, state, copy=True, buffers=buffers)  # an older snapshot's images
    snap = contents.snapshot(model, opt, sched, scaler, state, copy=True, buffers=buffers)
    assert snap.images
    ck = store.save(7, lambda d: contents.write_snapshot(d, snap), meta={})
    store.verify(ck.path)
    other, other_opt, other_sched, other_scaler = fresh_like(model, opt)
    assert contents.read_files(ck.path, other, other_opt, other_sched, other_scaler).step == 7
    assert_same_state(model, opt, other, other_opt)


def test_the_persist_thread_runs_at_the_configured_niceness():
    import threading

    from ember.ckpt.writer import lower_priority
    seen, before = [], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def persist():
        lower_priority(15)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    t = threading.Thread(target=persist)
    t.start()
    t.join()
    assert seen == [15] and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # this one untouched
