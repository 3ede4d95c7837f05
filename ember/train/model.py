"""Models and tokenizers: builtin:tiny, a Hugging Face folder, or a GGUF file; LoRA through peft."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from torch import nn

from ember.errors import EmberError
from ember.events import Events
from ember.models import model_folder, reading, tiny_config
from ember.paths import cached_sha256
from ember.recipe import MethodConfig, ModelConfig
from ember.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from ember.train.gguf_blocks import is_block_linear, keep_gguf_blocks, load_with_blocks
from ember.train.quantize import merge_adapters, quantize_base

if TYPE_CHECKING:
    from peft import LoraConfig

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt")


@dataclass
class ModelBundle:
    model: nn.Module
    tokenizer: Tokenizer
    max_positions: int
    source: dict[str, Any]  # what was loaded, with content hashes: part of the run's record


def load_model(cfg: ModelConfig, method: MethodConfig, activation_checkpointing: bool,
               events: Events | None = None) -> ModelBundle:
    """Build the model (seed torch first: random init must be reproducible) and its tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    # A first run of a .gguf file converts it and, for quantize = 'gguf', indexes its blocks:
    # gguf-py parses the file's metadata once for both (ember.models.one_reader; a run's own
    # window, ember.train.job, also holds its check of the model's config).
    with reading(cfg.path):
        if cfg.path == "builtin:tiny":
            model = LlamaForCausalLM(tiny_config())
            tokenizer: Tokenizer = ByteTokenizer()
            source = {"kind": "builtin", "name": "tiny", "config": model.config.to_diff_dict()}
        elif cfg.path.startswith("builtin:"):
            raise EmberError(f"[model] path = {cfg.path!r}: the only builtin model is 'builtin:tiny'")
        else:
            path, source = model_folder(cfg.path, events)
            source["files"] = {p.name: cached_sha256(p) for p in sorted(path.iterdir())
                               if p.is_file() and p.suffix in WEIGHT_SUFFIXES}
            try:
                if method.quantize == "gguf" and source["kind"] == "gguf":  # never the whole fp32 model
                    model = load_with_blocks(path, Path(source["path"]), cfg.path)
                else:
                    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            except (OSError, ValueError) as e:
                raise EmberError(f"[model] path = {cfg.path!r}: transformers could not load it: {e}") from None
            except RuntimeError as e:  # transformers' own words for it; anything else (out of memory) is not this
                if "ignore_mismatched_sizes" not in str(e):
                    raise
                raise EmberError(f"[model] path = {cfg.path!r}: its config.json does not describe its weights "
                                 f"(the tensors' shapes are not the sizes it gives: hidden_size, ...); config.json "
                                 f"and the weights must come from the same model: download it again") from None
            except SafetensorError as e:  # safetensors' own type, for a file cut short or overwritten
                raise EmberError(f"[model] path = {cfg.path!r}: its weights in {path} cannot be read ({e}); "
                                 f"a weights file is truncated or damaged: copy or download the model again") from None
            tokenizer = load_tokenizer(path)
        gguf = Path(source["path"]) if source.get("kind") == "gguf" else None
        model = prepare_model(model, method, activation_checkpointing, gguf=gguf, spec=cfg.path)
    max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    return ModelBundle(model, tokenizer, max_positions, source)


def prepare_model(model: nn.Module, method: MethodConfig, activation_checkpointing: bool,
                  make_4bit: Callable[[nn.Linear], nn.Module] | None = None, gguf: Path | None = None,
                  spec: str = "") -> nn.Module:
    """A built model made what the recipe trains: no KV cache, activation checkpointing, a 4-bit
    base (each linear by `make_4bit`, if given: ember.train.quantize.quantize_base; or the blocks
    of `gguf`, the .gguf file [model] path `spec` names: ember.train.gguf_blocks), LoRA."""
    model.config.use_cache = False
    if activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if method.quantize == "nf4":
        quantize_base(model, make_4bit)  # before LoRA wraps the linears: peft adapts the 4-bit ones
    elif method.quantize == "gguf" and not any(map(is_block_linear, model.modules())):  # else loaded so
        keep_gguf_blocks(model, gguf, spec)
    if method.kind == "lora":
        model = apply_lora(model, method)
    if activation_checkpointing:
        drop_input_grad_hooks(model)
    return model


def drop_input_grad_hooks(model: nn.Module) -> None:
    """Remove the hooks transformers and peft put on the input embeddings under activation
    checkpointing (`requires_grad_(True)` on their output): reentrant checkpointing needs them,
    ember's non-reentrant one does not, and under torch.compile each is a graph break. The
    gradients are the same without them."""
    hooks = model.get_input_embeddings()._forward_hooks  # torch keeps no public way to list them
    for key in [k for k, fn in hooks.items() if getattr(fn, "__name__", "") == "make_inputs_require_grads"]:
        del hooks[key]


def lora_config(method: MethodConfig) -> LoraConfig:
    """The peft LoraConfig of a recipe's [method]: for training, and for serving its adapters."""
    from peft import LoraConfig
    targets: Any = "all-linear" if method.target_modules == ["all-linear"] else method.target_modules
    return LoraConfig(r=method.rank, lora_alpha=method.alpha, lora_dropout=method.dropout,
                      target_modules=targets, task_type="CAUSAL_LM")


def apply_lora(model: nn.Module, method: MethodConfig) -> nn.Module:
    from peft import get_peft_model
    try:
        return get_peft_model(model, lora_config(method))
    except ValueError as e:
        raise EmberError(f"[method] target_modules = {method.target_modules!r}: {e}") from None


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def save_final(bundle: ModelBundle, folder: Path, method: MethodConfig,
               weights: dict[str, torch.Tensor] | None = None, adapter: bool = False) -> None:
    """Write the trained weights as safetensors (the adapter alone for LoRA) and the tokenizer.
    `weights`: the full state dict, when the live model is sharded over ranks; `adapter`: they
    are LoRA's adapter as peft saves it, gathered from pipeline stages (ember.parallel.stages)."""
    folder.mkdir(parents=True)
    bundle.model.save_pretrained(folder, safe_serialization=True,
                                 **({"state_dict": weights} if weights is not None and not adapter else {}))
    if adapter and weights is not None:  # over the file of this stage's layers alone
        from safetensors.torch import save_file
        save_file(weights, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    bundle.tokenizer.save(folder)
    if method.kind == "lora" and method.export_merged:
        merged = merge_adapters(bundle.model)
        merged.config.use_cache = True  # for inference (training turned the KV cache off)
        merged.save_pretrained(folder / "merged", safe_serialization=True)
        bundle.tokenizer.save(folder / "merged")
