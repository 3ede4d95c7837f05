"""`ember compare`'s weight check reads safetensors headers and bytes itself (no torch in the
service or the dashboard): equal files are equal, and each differing tensor is named."""

import torch
from safetensors.torch import save_file

from ember.metrics.compare import weight_differences


def write(folder, tensors, name="model.safetensors", metadata=None):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name), metadata=metadata)


def test_bit_for_bit_tensor_by_tensor(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "c": torch.arange(10)}
    write(tmp_path / "x", base)
    write(tmp_path / "same", {k: v.clone() for k, v in base.items()}, metadata={"written": "later"})
    assert weight_differences(tmp_path / "x", tmp_path / "same") == []
    changed = {k: v.clone() for k, v in base.items()}
    changed["a.weight"][63, 31] = torch.nextafter(changed["a.weight"][63, 31], torch.tensor(9.0))  # one ulp
    changed["c"] = changed["c"].to(torch.int32)  # same values, another dtype
    write(tmp_path / "changed", changed)
    assert weight_differences(tmp_path / "x", tmp_path / "changed") == \
        ["model.safetensors: a.weight differs", "model.safetensors: c differs"]
    assert weight_differences(tmp_path / "x", tmp_path / "changed", limit=1) == ["model.safetensors: a.weight differs"]
    write(tmp_path / "renamed", {"z": base["c"]})
    assert weight_differences(tmp_path / "x", tmp_path / "renamed") == ["model.safetensors: different tensor names"]
    assert weight_differences(tmp_path / "x", tmp_path / "none") is None
