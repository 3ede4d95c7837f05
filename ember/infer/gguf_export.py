"""A Llama-family model as one GGUF file that llama.cpp loads: hyperparameters, tokenizer and
tensors under llama.cpp's names (the `gguf` package's tensor-name map), in f16 or f32.

The file says what model it is: the source GGUF's general.* keys (name, licence, organisation,
size, languages, ...) are copied, but for those that describe the file rather than the model
(architecture, file type, quantization, alignment); from a Hugging Face folder, the name and the
licence come from its model card (README.md), when it has one, else the name is the folder's.

Two layouts differ between the formats. Hugging Face's Llama rotates the two halves of each
attention head (`rotate_half`), llama.cpp rotates adjacent pairs, as Meta's original weights did;
the Q and K projections are therefore re-ordered row-wise, per head, back into pairs. And
llama.cpp keeps norms (1-D tensors) in f32 whatever the file type.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember.errors import EmberError
from ember.events import Events
from ember.models import one_reader

LLAMA_TYPES = ("llama",)
# tokenizer.json pre-tokenizers llama.cpp knows by name; others get its default, with a warning
PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # llama.cpp's token types
# general.* keys about the file, not the model: this writer sets its own, or none
FILE_KEYS = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")


def write_gguf(model: torch.nn.Module, tokenizer_source: Path, model_source: Path | None, path: Path,
               dtype: str, events: Events) -> None:
    """Write `model` (a float32 LlamaForCausalLM) with the tokenizer from `tokenizer_source` (a GGUF
    file, whose tokenizer.ggml.* metadata is copied, or a Hugging Face tokenizer folder) and the
    general.* metadata of `model_source` (the GGUF file or model folder the run started from)."""
    import gguf
    config = model.config
    check_llama(config)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    with one_reader():  # the source GGUF is read for its general.* and its tokenizer.* keys: parsed once
        write_general(writer, model_source)
        write_hparams(writer, config, dtype)
        if tokenizer_source.is_file():
            copy_gguf_tokenizer(writer, tokenizer_source)
        else:
            write_hf_tokenizer(writer, tokenizer_source, config.vocab_size, events)
    events.stage(f"writing GGUF ({dtype})", path=str(path))
    for name, array in llama_tensors(model.state_dict(), config, dtype):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def check_llama(config: Any) -> None:
    """Refuse what this writer does not convert faithfully, saying what instead."""
    if config.model_type not in LLAMA_TYPES:
        raise EmberError(f"--format gguf: the model is a {config.model_type!r} model; ember writes "
                         f"GGUF for the Llama family only; export it with --format hf and convert "
                         f"that with llama.cpp's convert_hf_to_gguf.py")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") != "default":
        raise EmberError(f"--format gguf: the model uses {rope['rope_type']!r} RoPE scaling, which "
                         f"ember's GGUF writer does not carry over; export with --format hf")


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings across transformers versions (rope_parameters, or rope_theta/rope_scaling)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_general(writer: Any, source: Path | None) -> None:
    """general.* metadata: the source GGUF's (but FILE_KEYS), or a model folder's name (its model
    card's model_name, else the folder's name), licence and languages."""
    import gguf
    if source is not None and source.is_file():
        for key, field in gguf.GGUFReader(source).fields.items():
            if key.startswith("general.") and key not in FILE_KEYS:
                vtype = field.types[0]
                sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        return
    card = model_card(source) if source is not None else {}
    writer.add_type("model")
    writer.add_name(card.get("model_name") or (source.name if source is not None else "ember export"))
    if isinstance(card.get("license"), str):
        writer.add_license(card["license"])
    languages = card.get("language")
    if languages:
        writer.add_languages([languages] if isinstance(languages, str) else list(languages))


def model_card(folder: Path) -> dict[str, Any]:
    """The metadata of a model folder's README.md (its YAML header), or {} without one."""
    readme = folder / "README.md"
    if not readme.is_file():
        return {}
    import yaml
    from huggingface_hub.repocard import metadata_load
    try:
        return metadata_load(readme) or {}
    except yaml.YAMLError:  # a header that does not parse: nothing to copy (the weights still export)
        return {}


def write_hparams(writer: Any, config: Any, dtype: str) -> None:
    import gguf
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_rope_freq_base(float(rope_parameters(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)


def llama_tensors(state: dict[str, torch.Tensor], config: Any, dtype: str):
    """(GGUF name, array) for each weight: Q/K re-ordered, matrices in `dtype`, norms in f32."""
    import gguf
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp uses token_embd for the output when output.weight is absent
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise EmberError(f"--format gguf: the model has a tensor {hf_name!r} that llama.cpp's "
                             f"Llama layout has no place for; export with --format hf")
        t = tensor.detach().float()
        if hf_name.endswith("q_proj.weight"):
            t = pairs_from_halves(t, heads)
        elif hf_name.endswith("k_proj.weight"):
            t = pairs_from_halves(t, kv_heads)
        keep_f32 = dtype == "f32" or t.dim() == 1
        yield name, t.numpy().astype(np.float32 if keep_f32 else np.float16)


def pairs_from_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Re-order the rows of a Q or K projection from Hugging Face's per-head layout (all first
    halves of the rotary pairs, then all second halves) to llama.cpp's (pair members adjacent)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def copy_gguf_tokenizer(writer: Any, source: Path) -> None:
    """Copy every tokenizer.* key of the source GGUF, with its value type, unchanged."""
    for key, value, vtype, sub in gguf_tokenizer_fields(source):
        writer.add_key_value(key, value, vtype, sub_type=sub)


def gguf_tokenizer_fields(source: Path) -> list[tuple[str, Any, Any, Any]]:
    """Every tokenizer.* key of a GGUF file: (key, value, its GGUFValueType, an array's item type
    or None). Parsing reads every metadata field: seconds for a vocabulary of ~50k tokens."""
    import gguf
    out = []
    for key, field in gguf.GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            out.append((key, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None))
    return out


def write_hf_tokenizer(writer: Any, folder: Path, vocab_size: int, events: Events) -> None:
    """A gpt2-style (byte-level BPE) tokenizer from a Hugging Face tokenizer folder: tokens in id
    order, their types, the merges, the special token ids, the chat template."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    spec = json.loads(tok.backend_tokenizer.to_str()) if getattr(tok, "backend_tokenizer", None) else {}
    if spec.get("model", {}).get("type") != "BPE":
        raise EmberError(f"--format gguf: the tokenizer in {folder} is not a byte-level BPE (gpt2-style) "
                         f"tokenizer; ember writes only those into GGUF: export with --format hf")
    tokens, types = vocabulary(tok, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(spec, events))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    for add, token_id in ((writer.add_bos_token_id, tok.bos_token_id), (writer.add_eos_token_id, tok.eos_token_id),
                          (writer.add_unk_token_id, tok.unk_token_id), (writer.add_pad_token_id, tok.pad_token_id)):
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)  # ember trains without BOS (documents end with EOS only)
    if isinstance(tok.chat_template, str):
        writer.add_chat_template(tok.chat_template)


def vocabulary(tok: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their llama.cpp types; ids the model has beyond the tokenizer are padding."""
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    if len(by_id) > vocab_size:
        raise EmberError(f"--format gguf: the tokenizer has {len(by_id)} tokens, more than the model's "
                         f"{vocab_size} embeddings")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    return tokens, types


def pre_tokenizer(spec: dict[str, Any], events: Events) -> str:
    """llama.cpp's name for the tokenizer.json pre-tokenizer, or 'default' with a warning."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    shape = tuple((s.get("type"), s.get("use_regex", s.get("individual_digits"))) for s in steps)
    if shape in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[shape]
    events.warn(f"GGUF: llama.cpp has no name for this tokenizer's pre-tokenizer ({shape}); writing "
                f"'default': llama.cpp may split some text differently from the Hugging Face tokenizer")
    return "default"
