"""`[method] quantize = 'gguf'`: QLoRA over a GGUF file's own quantized blocks.

A GGUF model is already quantized (the demo's SmolLM2 is Q4_1). ember trains over the weights
transformers dequantizes from it; 'nf4' would quantize those a second time, onto another grid,
and that second rounding is what QLoRA's loss pays on a small model (bench/README: "QLoRA
against LoRA on the demo job"). 'gguf' keeps each decoder linear as the file stores it: the
blocks' bytes, read from the file, dequantized for each matmul and freed after. The weights a
matmul sees are bit-for-bit those LoRA trains over (checked for every layer at load), at the
file's size: Q4_0 and Q4_1 hold 32 weights in 18 and 20 bytes, Q8_0 in 34, and the k-quants
256 in 144 (Q4_K), 176 (Q5_K) and 210 (Q6_K), what "Q4_K_M"-style files mix.

Formats (ggml's block layouts, along a row):
  Q4_0  fp16 scale d, 16 bytes of 4-bit codes q           w = (q - 8) * d
  Q4_1  fp16 scale d, fp16 minimum m, 16 bytes of codes     w = q * d + m
  Q8_0  fp16 scale d, 32 signed bytes q                     w = q * d
  Q4_K  fp16 d and dmin, eight 6-bit scales sc and mins m in 12 bytes, 128 bytes of 4-bit
        codes; 8 sub-blocks of 32                           w = d * sc * q - dmin * m
  Q5_K  as Q4_K, with each code's fifth bit in 32 bytes more
  Q6_K  128 bytes of codes' low 4 bits, 64 of their high 2, sixteen 8-bit scales, fp16 d;
        16 sub-blocks of 16                                 w = d * sc * (q - 32)
In the 32-weight types the codes of a block's first 16 weights are the low nibbles, the next
16 the high nibbles. A layer stored in another type (f16, Q5_0, Q2_K, Q3_K, the i-quants) stays
as transformers loaded it, in fp32; a file with none of these types is refused. The arithmetic
is gguf-py's (what transformers dequantizes with), in the same order, so the load-time check
holds exactly. Which tensors are where in the file is read once with gguf-py's reader and kept
in $EMBER_HOME by the file's hash (`tensor_index`): the reader parses all the metadata.

A layer's backward dequantizes again for its input's gradient rather than keep the weight from
forward, as an nn.Linear would (saved-tensor hooks around nn.Linear's own op: the same graph, so
the same gradients, bit for bit); under autocast the layer casts its operands itself, and what
it would keep is that half-precision copy, dequantized and cast again in backward instead.
What it resumes from is a pure function of the file; a checkpoint never holds the base.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.errors import EmberError, NothingToQuantize

# The types held: (weights a block, bytes a block). ggml's "k-quants" group 256 weights in a
# super-block of sub-blocks, each with its own 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) scale.
FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34),
           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
BLOCK_BYTES = {qtype: size for qtype, (_, size) in FORMATS.items()}


def dequantize(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """The fp32 weight of `packed` (uint8, [rows, blocks x block bytes]) in GGUF type `qtype`,
    computed as gguf-py's dequantize computes it (the same operations in the same order)."""
    rows = packed.shape[0]
    b = packed.reshape(-1, BLOCK_BYTES[qtype])  # one block a row
    if qtype == "Q6_K":
        return _q6_k(b).reshape(rows, -1)
    d = _f16(b[:, 0:2])  # [blocks, 1]
    if qtype == "Q8_0":
        return (b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d).reshape(rows, -1)
    if qtype in ("Q4_K", "Q5_K"):
        return _q45_k(b, d, qtype).reshape(rows, -1)
    codes = b[:, 4:] if qtype == "Q4_1" else b[:, 2:]
    q = torch.cat((codes & 0x0F, codes >> 4), dim=-1)  # low nibbles: weights 0-15; high: 16-31
    if qtype == "Q4_0":
        return (d * (q.to(torch.int8) - 8).to(torch.float32)).reshape(rows, -1)
    return (d * q.to(torch.float32) + _f16(b[:, 2:4])).reshape(rows, -1)


def _f16(x: torch.Tensor) -> torch.Tensor:
    """Each row's 2 bytes as an fp16 number, in fp32: [blocks, 1]."""
    return x.contiguous().view(torch.float16).to(torch.float32)


def _shifts(like: torch.Tensor, *bits: int) -> torch.Tensor:
    """Bit shifts as a column, on `like`'s device (a CUDA tensor cannot shift by a CPU one)."""
    return torch.tensor(bits, dtype=torch.uint8, device=like.device).reshape(-1, 1)


def _q45_k(b: torch.Tensor, d: torch.Tensor, qtype: str) -> torch.Tensor:
    """Q4_K and Q5_K: d and dmin (fp16), 12 bytes of eight 6-bit scales and minimums, then (Q5_K)
    32 bytes of each weight's fifth bit, then 128 bytes of 4-bit codes: w = d*sc*q - dmin*m."""
    n = b.shape[0]
    s = b[:, 4:16].reshape(n, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=-1).to(torch.float32)
    mn = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)), dim=-1).to(torch.float32)
    scale = (d * sc).reshape(n, 8, 1)
    low = (_f16(b[:, 2:4]) * mn).reshape(n, 8, 1)
    codes = b[:, -128:].reshape(n, 4, 1, 32) >> _shifts(b, 0, 4)
    q = (codes & 0x0F).reshape(n, 8, 32)
    if qtype == "Q5_K":
        high = (b[:, 16:48].reshape(n, 1, 32) >> _shifts(b, *range(8))) & 0x01
        q = q | (high << 4)
    return (scale * q.to(torch.float32) - low).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K: 128 bytes of each weight's low 4 bits, 64 of its high 2, sixteen 8-bit scales, d
    (fp16): w = d*sc*(q - 32)."""
    n = b.shape[0]
    scale = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    low = ((b[:, :128].reshape(n, 2, 1, 64) >> _shifts(b, 0, 4)) & 0x0F).reshape(n, 8, 32)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(b, 0, 2, 4, 6)) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (scale * q).reshape(n, 256)


class _Redequantize:
    """Saved-tensor hooks for one call: autograd keeps, in place of the dequantized weight (or a
    view of it) that the linear saves for its input's gradient, the packed blocks and the view's
    geometry, and dequantizes again when backward needs it. The graph is nn.Linear's own, so the
    gradients are the same bits as over the fp32 weight."""

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, qtype: str):
        self.packed, self.qtype = packed, qtype
        # The weight's root tensor (a view's _base is its root) by identity alone: autograd keeps
        # these hooks with what they saved, and a reference here would keep the weight alive.
        self.root = id(weight if weight._base is None else weight._base)

    def pack(self, t: torch.Tensor) -> Any:
        if id(t) != self.root and (t._base is None or id(t._base) != self.root):
            return t  # an input, kept as autograd keeps it
        return (self.packed, self.qtype, t.dtype, t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        packed, qtype, dtype, size, stride, offset = saved
        return dequantize(packed, qtype).to(dtype).as_strided(size, stride, offset)


class BlockLinear(nn.Linear):
    """A frozen linear whose weight is a GGUF file's quantized blocks (uint8, [out, row bytes]),
    dequantized for each call. An nn.Linear, as peft's LoRA wraps it; `qtype` names the format."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, qtype: str):
        nn.Module.__init__(self)  # not nn.Linear's: its random init would draw on torch's RNG
        self.in_features, self.out_features, self.qtype = linear.in_features, linear.out_features, qtype
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = dequantize(self.weight, self.qtype), self.bias
        if torch.is_autocast_enabled(x.device.type):  # cast as autocast casts an nn.Linear's operands,
            dtype = torch.get_autocast_dtype(x.device.type)  # but here, so that the cast weight is what is saved
            x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        hooks = _Redequantize(weight, self.weight, self.qtype)
        with torch.autocast(x.device.type, enabled=False), \
                torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            return nn.functional.linear(x, weight, bias)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight every call computes with."""
        return dequantize(self.weight.detach(), self.qtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


def is_block_linear(module: nn.Module) -> bool:
    return isinstance(module, BlockLinear)


def load_with_blocks(folder: Path, gguf: Path, spec: str) -> nn.Module:
    """The model of `folder` (GGUF file `gguf` converted: ember.models.convert_gguf) with the
    linears the file quantizes in its blocks, never all in fp32 at once: the model is built
    without parameters (accelerate's init_empty_weights; buffers are made), each linear's blocks
    come from the file, checked against its fp32 weight read alone from the folder's safetensors,
    and only the other weights (embeddings, norms, an untied head, linears the file keeps in f16
    or f32) are loaded. The process's peak is the quantized model's, not the fp32 one's."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    where: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            where.update(dict.fromkeys(handle.keys(), path))

    def read(name: str) -> torch.Tensor:
        # A file mapped for one tensor at a time: pages of a whole mapped file read once stay
        # resident (and counted) until it is unmapped.
        with safe_open(where[name], "pt") as handle:
            return handle.get_tensor(name)

    keep_gguf_blocks(model, gguf, spec, read)
    rest = {k: read(k) for k, t in model.state_dict().items() if t.is_meta and k in where}
    model.load_state_dict(rest, strict=False, assign=True)
    model.tie_weights()  # a tied head is not in the files: it is the embeddings again
    missing = [k for k, p in model.named_parameters() if p.is_meta]
    if missing:
        raise EmberError(f"[model] path = {spec!r}: {folder} has no weights for {', '.join(missing[:5])}: the "
                         f"converted folder is incomplete; delete it and run again to convert the file anew")
    return model


def keep_gguf_blocks(model: nn.Module, gguf: Path | None, spec: str,
                     reference: Callable[[str], torch.Tensor] | None = None) -> int:
    """Replace each linear of `model` (but the output head) that the GGUF file `gguf` stores in a
    type of BLOCK_BYTES by a BlockLinear of the file's blocks; return how many. Each layer's
    blocks must dequantize to exactly its fp32 weight: the one `model` holds, or where its weights
    are on the meta device, `reference(parameter name)`'s; without one (the plan's model, which
    has no values), the blocks keep the meta device too. `spec` is [model] path, for the errors."""
    where = f"[method] quantize = 'gguf' with [model] path = {spec!r}"
    if gguf is None or gguf.suffix != ".gguf":
        raise EmberError(f"{where}: 'gguf' keeps a GGUF file's own quantized blocks, and this model is not "
                         f"a .gguf file; use quantize = 'nf4' (4-bit NF4 by bitsandbytes) or 'none'")
    stored = gguf_linears(model, gguf)
    head = model.get_output_embeddings()
    count, other = 0, set()
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, nn.Linear) or child is head or is_block_linear(child) or full not in stored:
                continue
            data, qtype = stored[full]
            if qtype not in BLOCK_BYTES:
                other.add(qtype)
                continue
            meta = child.weight.is_meta
            if not meta:  # the weight transformers loaded
                device, fp32 = child.weight.device, child.weight.detach()
            elif reference is not None:  # built without weights: each read alone
                device, fp32 = torch.device("cpu"), reference(f"{full}.weight")
            else:  # the plan's model: shapes only
                device, fp32 = torch.device("meta"), None
            packed = _packed(data, device)
            if fp32 is not None and not torch.equal(dequantize(packed, qtype), fp32.to(device)):
                raise EmberError(f"{where}: the file's {qtype} blocks of {full} do not dequantize to the weight "
                                 f"transformers loaded from it (this family's conversion changes the layer); "
                                 f"use quantize = 'nf4' or 'none'")
            if meta and child.bias is not None and reference is not None:
                child.bias = nn.Parameter(reference(f"{full}.bias"), requires_grad=False)
            setattr(parent, name, BlockLinear(child, packed, qtype))
            count += 1
    if not count:
        raise NothingToQuantize(
            f"{where}: no linear layer of the file is stored in {', '.join(BLOCK_BYTES)}"
            + (f" (its layers are {', '.join(sorted(other))})" if other else "")
            + "; use quantize = 'nf4' (bitsandbytes re-quantizes the dequantized weights) or 'none'")
    return count


def gguf_linears(model: nn.Module, gguf: Path) -> dict[str, tuple[Any, str]]:
    """{module name: (its weight's bytes as the file stores them, a read-only numpy view with the
    rows in transformers' order; the GGUF type's name)} for every linear of `model` the file
    holds. Names map through gguf-py's tensor-name map of the file's architecture, as
    transformers' GGUF loader maps them, and its per-architecture processing is applied (Llama's
    Q and K rows reordered per head: whole rows move, blocks and all)."""
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    arch_name, tensors = tensor_index(gguf)
    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise EmberError(f"[method] quantize = 'gguf': {gguf} is a {arch_name!r} model, which this gguf "
                         f"package does not name; use quantize = 'nf4' or 'none'")
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    to_hf = {}
    for module, child in model.named_modules():
        if isinstance(child, nn.Linear):
            parts = module.split(".")  # the map knows some names without their model's prefix
            found = next(filter(None, (names.get_name(".".join(parts[i:])) for i in range(len(parts)))), None)
            if found is not None:
                to_hf[f"{found}.weight"] = f"{module}.weight"
    config = model.config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=config)
    out = {}
    for name, qtype, offset, shape in tensors:
        if name not in to_hf:
            continue
        data = np.memmap(gguf, dtype=np.uint8, mode="r", offset=offset, shape=tuple(shape))  # rows of bytes
        result = processor.process(weights=data, name=name, tensor_key_mapping=to_hf,
                                   parsed_parameters={"config": config, "tensors": {}})
        if result.weights is not None and result.name in to_hf:
            out[to_hf[result.name].removesuffix(".weight")] = (result.weights, qtype)
    return out


def tensor_index(gguf: Path) -> tuple[str, list[tuple[str, str, int, list[int]]]]:
    """The file's architecture and, for each 2-D tensor, (name, GGUF type, byte offset, [rows,
    bytes per row]). gguf-py's reader parses every metadata field to get there (a tokenizer's
    tens of thousands of tokens: ~3 s and ~170 MB for SmolLM2's), so the index is kept in
    $EMBER_HOME by the file's content hash and read from there at later starts."""
    from ember.durable import write_durable
    from ember.paths import cached_sha256, home
    cache = home().gguf_tensors_cache(cached_sha256(gguf))
    try:
        known = json.loads(cache.read_text())
        return known["arch"], [tuple(t) for t in known["tensors"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from gguf import GGUFReader
    reader = GGUFReader(gguf)
    tensors = [(t.name, t.tensor_type.name, int(t.data_offset), [int(t.data.shape[0]), int(t.n_bytes // t.data.shape[0])])
               for t in reader.tensors if len(t.shape) == 2]
    arch = str(reader.fields["general.architecture"].contents())
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_durable(cache, json.dumps({"arch": arch, "tensors": tensors}))
    return arch, tensors


def _packed(data: Any, device: torch.device) -> torch.Tensor:
    """A layer's blocks as a uint8 tensor on `device` (only their shape on the meta device)."""
    import numpy as np
    if device.type == "meta":
        return torch.empty(data.shape, dtype=torch.uint8, device="meta")
    return torch.from_numpy(np.array(data, dtype=np.uint8)).to(device)
