"""A tiny GGUF model for the tests of [method] quantize = 'gguf' (tests/train/test_gguf_blocks.py,
tests/e2e/test_resume.py): a two-layer Llama with SmolLM2's vocabulary and tokenizer (copied from
the shipped GGUF), each kind of decoder matrix quantized by gguf-py to another type."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ember.models import resolve_path
from tests.artifacts import shared
from tests.engines import SMOLLM2_GGUF

# A two-layer Llama with SmolLM2's vocabulary (its tokenizer is copied from the shipped GGUF),
# each kind of linear stored in another type: every format, and a layer the file keeps in f32.
TINY = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, use_cache=False)
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_0", "ffn_down": "Q8_0"}
F32_LAYER = "blk.1.ffn_down"  # this one stays f32 in the file, and an nn.Linear in the model


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_fields() -> list[tuple]:
    """The shipped SmolLM2 GGUF's tokenizer keys (ember.infer.gguf_export.gguf_tokenizer_fields),
    parsed once per process: ~3-4 CPU-s a parse here, and a worker writes several tiny files."""
    from ember.infer.gguf_export import gguf_tokenizer_fields
    return gguf_tokenizer_fields(resolve_path(SMOLLM2_GGUF))


def write_tiny_gguf(path: Path, types: dict[str, str], f32: tuple[str, ...] = (F32_LAYER,)) -> Path:
    """TINY, seeded, as a GGUF file whose decoder matrices are quantized by gguf-py to `types`."""
    import gguf
    from ember.infer.gguf_export import llama_tensors, write_hparams
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name("tiny")
    write_hparams(writer, TINY, "f32")
    for key, value, vtype, sub in smollm2_tokenizer_fields():  # as copy_gguf_tokenizer writes them
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for name, array in llama_tensors(model.state_dict(), TINY, "f32"):
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if kind in types and not name.startswith(f32):
            qtype = gguf.GGMLQuantizationType[types[kind]]
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def shared_tiny_gguf() -> Path:
    """write_tiny_gguf's file of TYPES, built once for every worker (tests/artifacts.py)."""
    return shared("tiny-gguf", TYPES, lambda folder: write_tiny_gguf(folder / "tiny.gguf", TYPES)) / "tiny.gguf"


@contextlib.contextmanager
def gguf_parses():
    """Counts the GGUF files gguf-py's reader parses meanwhile (each parse reads every metadata
    field: seconds for a 49k-token vocabulary): yields a list with the count in its one item."""
    from gguf.gguf_reader import GGUFReader
    build = GGUFReader._build_fields
    count = [0]

    def counted(self, *args, **kwargs):
        count[0] += 1
        return build(self, *args, **kwargs)

    GGUFReader._build_fields = counted
    try:
        yield count
    finally:
        GGUFReader._build_fields = build
