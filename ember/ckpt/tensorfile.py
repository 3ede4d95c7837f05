"""safetensors files written as a stream of buffers, straight from the tensors' memory.

safetensors' own `save_file` copies every tensor into a bytes object before writing; here the
file is an 8-byte header length, the JSON header, and then each tensor's memory as it lies, so
`ember.durable.write_stream` can checksum and write it with no copy. The files are ordinary
safetensors (tensors ordered by element size, then name, so each is aligned to its element
size, as safetensors lays them out) and load with `safetensors.torch.load_file`.

A nested state (an optimizer's state_dict) is flattened: its tensors under their path of keys
(`state/0/exp_avg`), the rest of its structure as JSON in the header's metadata, with tensors
as {"__tensor__": key}, tuples as {"__tuple__": [...]} and dicts whose keys are not strings
(the optimizer's state by parameter index) as {"__items__": [[key, value], ...]}.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

TREE_KEY = "ember.tree"
PAGE = 4096          # O_DIRECT's alignment of address, offset and length (any disk's block divides it)
HEADER_SLACK = 1024  # header bytes reserved beyond the first snapshot's, plus an eighth of it
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
           torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A tensor's memory as bytes, without a copy (a non-contiguous tensor is made contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _header(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None,
            room: int = 0) -> tuple[list[str], bytes, int]:
    """(tensor order, the file's first bytes: length + JSON header padded with spaces to a
    multiple of 8 and at least `room` bytes, data bytes)."""
    assert sys.byteorder == "little", "safetensors is little-endian"
    names = sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for n in names:
        dtype, shape = specs[n]
        size = math.prod(shape) * dtype.itemsize
        header[n] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * max(-len(text) % 8, room - len(text))  # the data starts 8-byte aligned
    return names, struct.pack("<Q", len(text)) + text, at


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}


def parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Iterator[Any]:
    """The buffers of a safetensors file holding `tensors` (host tensors), header first."""
    names, head, _ = _header(_specs(tensors), metadata)
    yield head
    for n in names:
        yield _bytes_of(tensors[n])


class FileImage:
    """A safetensors file laid out in one page-aligned host buffer, so it can be written with
    O_DIRECT (ember.durable.write_image): no copy into the page cache, which on a machine whose
    cores all train was most of a persist's CPU time. The header is rewritten at each snapshot
    into room reserved for it (the optimizer's metadata changes as its learning rate does);
    `tensors` are views that a snapshot copies the live state into."""

    def __init__(self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None,
                 pinned: bool):
        _, head, data = _header(specs, metadata)
        self.specs, self.pinned = specs, pinned
        self.room = len(head) - 8 + HEADER_SLACK + (len(head) >> 3)  # metadata may grow a little
        self.room += -self.room % 8
        names, head, data = _header(specs, metadata, self.room)
        self.size = len(head) + data
        padded = self.size + (-self.size % PAGE)
        # A page more than needed, so the file's first byte can sit on a page boundary; pinned
        # for accelerator state (asynchronous device-to-host copies), which is page-aligned too.
        self.arena = torch.empty(padded + PAGE, dtype=torch.uint8, pin_memory=pinned)
        skip = -self.arena.data_ptr() % PAGE
        self.file = self.arena[skip:skip + padded]
        self.tensors: dict[str, torch.Tensor] = {}
        at = len(head)
        for n in names:
            dtype, shape = specs[n]
            size = math.prod(shape) * dtype.itemsize
            self.tensors[n] = self.file[at:at + size].view(dtype).view(shape)
            at += size
        self.file[len(head) + data:].zero_()  # the padding past the end, written then truncated away

    def fits(self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], pinned: bool) -> bool:
        return specs == self.specs and pinned == self.pinned

    def set_header(self, metadata: dict[str, str] | None) -> bool:
        """Write the header for `metadata`; False when it outgrew the room (make a new image)."""
        _, head, _ = _header(self.specs, metadata)
        if len(head) - 8 > self.room:
            return False
        _, head, _ = _header(self.specs, metadata, self.room)
        self.file[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        return True

    def view(self) -> memoryview:
        """The file's bytes and the padding to a whole page after them, page-aligned."""
        return memoryview(self.file.numpy())


def image_of(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, old: FileImage | None,
             pinned: bool) -> FileImage:
    """A FileImage for these tensors' names, dtypes and shapes (`old`, reused when it fits),
    its header written; the caller copies the data into `.tensors`."""
    specs = _specs(tensors)
    if old is not None and old.fits(specs, pinned) and old.set_header(metadata):
        return old
    img = FileImage(specs, metadata, pinned)
    img.set_header(metadata)
    return img


def _join(key: str, part: Any) -> str:
    return f"{key}/{part}" if key else str(part)


def _flatten(x: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        tensors[key] = x
        return {"__tensor__": key}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _flatten(v, _join(key, k), tensors) for k, v in x.items()}
        return {"__items__": [[k, _flatten(v, _join(key, k), tensors)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {"__tuple__": [_flatten(v, _join(key, i), tensors) for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_flatten(v, _join(key, i), tensors) for i, v in enumerate(x)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot store {type(x).__name__} at {key!r} in a checkpoint")


def _unflatten(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_unflatten(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tensor__" in x:
        return tensors[x["__tensor__"]]
    if "__tuple__" in x:
        return tuple(_unflatten(v, tensors) for v in x["__tuple__"])
    if "__items__" in x:
        return {k: _unflatten(v, tensors) for k, v in x["__items__"]}
    return {k: _unflatten(v, tensors) for k, v in x.items()}


def flatten_tree(tree: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A nested state as (its tensors by path of keys, the metadata holding the rest)."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(tree, "", tensors)
    return tensors, {TREE_KEY: json.dumps(structure)}


def unflatten_tree(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Any:
    """flatten_tree's inverse, over the same or other tensors under the same keys."""
    return _unflatten(json.loads(metadata[TREE_KEY]), tensors)


def parts_of_tree(tree: Any) -> Iterator[Any]:
    """The buffers of a safetensors file holding a nested state (tensors and plain values)."""
    return parts(*flatten_tree(tree))


def read_tree(path: Path) -> Any:
    """The nested state of a file written from parts_of_tree."""
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return unflatten_tree(tensors, metadata)
