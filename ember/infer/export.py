"""`ember export`: a completed run's weights in the forms serving engines load.

    hf     a merged Hugging Face folder (config.json, tokenizer, model.safetensors):
           transformers, vLLM, TGI. LoRA runs are merged into their base.
    peft   the LoRA adapter with a base_model_name_or_path that loads: peft, vLLM's --lora-modules.
    gguf   one GGUF file (llama family): llama.cpp, Ollama. Written by ember.infer.gguf_export.

Writing is atomic: everything goes under a temporary name beside --out, which is fsynced and
renamed into place last; a failure removes the temporary and leaves --out absent.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember.ckpt.state import seed_all
from ember.durable import fsync_dir, fsync_file
from ember.errors import EmberError
from ember.events import Events
from ember.models import model_folder
from ember.paths import cached_sha256
from ember.recipe import MethodConfig, ModelConfig
from ember.train.model import load_model, load_tokenizer
from ember.train.rundir import RUN_FILE, RunDir, remote_job

FORMATS = ("hf", "peft", "gguf")
DTYPES = {"f16": torch.float16, "f32": torch.float32}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class Exported:
    format: str
    dtype: str
    path: str     # the folder (hf, peft) or the file (gguf)
    bytes: int    # on disk, all files together
    kind: str     # the run's method: "full" or "lora"


@dataclass(frozen=True)
class TrainedRun:
    """What export needs to know about a completed run, read from its folder."""
    path: Path
    record: dict[str, Any]
    kind: str     # "full" or "lora"
    spec: str     # [model] path as the run resolved it

    @property
    def final(self) -> Path:
        return self.path / "final"


def default_out(run: Path, fmt: str, dtype: str) -> Path:
    """RUN/export/<format>, and RUN/export/model-<dtype>.gguf for a GGUF file."""
    return run / "export" / (f"model-{dtype}.gguf" if fmt == "gguf" else fmt)


def export_run(run: Path, fmt: str, out: Path | None = None, dtype: str = "f32",
               events: Events | None = None) -> Exported:
    """Write the completed run's weights in `fmt` at `out` (default `default_out`), atomically."""
    events = events or Events()
    if fmt not in FORMATS:
        raise EmberError(f"--format {fmt!r}: unknown; choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise EmberError(f"--dtype {dtype!r}: unknown; choose one of {', '.join(DTYPES)}")
    trained = read_run(run)
    if fmt == "peft" and trained.kind != "lora":
        raise EmberError(f"{run}: a full fine-tuning run has no adapter to export as peft; export "
                         f"its weights with --format hf (a Hugging Face folder) or --format gguf")
    out = out or default_out(run, fmt, dtype)
    if out.exists():
        raise EmberError(f"--out {out}: already exists; remove it or choose another --out "
                         f"(export never overwrites)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}.{os.getpid()}")
    remove(tmp)
    try:
        if fmt == "hf":
            write_hf(trained, tmp, DTYPES[dtype], events)
        elif fmt == "peft":
            write_peft(trained, tmp, out, DTYPES[dtype], events)
        else:
            from ember.infer.gguf_export import write_gguf
            source = gguf_tokenizer_source(trained)  # refuse before loading and merging the model
            write_gguf(merged_model(trained, events), source, tmp, dtype, events)
        make_durable(tmp)
        os.rename(tmp, out)  # the commit point: --out appears whole, or not at all
        fsync_dir(out.parent)
    finally:
        remove(tmp)  # the rename did not happen: leave nothing half-written behind
    size = out.stat().st_size if out.is_file() else sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    events.info(f"exported {run} as {fmt} ({dtype}) to {out}", path=str(out), bytes=size)
    return Exported(fmt, dtype, str(out), size, trained.kind)


def read_run(run: Path) -> TrainedRun:
    """The run folder's record, once it is a completed run with final weights; else EmberError."""
    if not run.is_dir() or not (run / RUN_FILE).is_file():
        raise EmberError(f"{run}: not an ember run folder (no {RUN_FILE}); give the --out folder "
                         f"of a completed `ember run`")
    record = RunDir.read(run).record
    recipe = record.get("recipe", {})
    if record.get("completed_step") is None or not (run / "final").is_dir():
        origin = remote_job(run)
        how = "run the same `ember run` command again to resume it" if origin is None else (
            f"it is remote job {origin['job']} on '{origin['target']}': while it runs, `ember remote status "
            f"{origin['job']} --wait` brings it back when it ends; stopped or cancelled, `ember remote continue "
            f"{origin['job']}` with new limits resumes it")
        raise EmberError(f"{run}: the run has not completed (no final weights in {run / 'final'}); "
                         f"finish it first: {how}")
    kind = recipe.get("method", {}).get("kind", "full")
    return TrainedRun(run, record, kind, recipe.get("model", {}).get("path", "builtin:tiny"))


def base_model(trained: TrainedRun, events: Events) -> torch.nn.Module:
    """The base the run's adapter was trained on, in float32: builtin:tiny is rebuilt from the
    run's seed (its init), a model folder is checked against the files the run recorded."""
    if trained.spec == "builtin:tiny":
        seed_all(trained.record["recipe"]["train"]["seed"])  # as the run did, before building it
    else:
        check_base_files(trained, events)
    return load_model(ModelConfig(trained.spec), MethodConfig(kind="full"), False, events).model


def check_base_files(trained: TrainedRun, events: Events) -> Path:
    """The base model folder, if its weights are the ones the run trained on; else EmberError."""
    folder, _ = model_folder(trained.spec, events)
    recorded = trained.record.get("model", {}).get("files") or {}
    changed = [name for name, digest in recorded.items()
               if not (folder / name).is_file() or cached_sha256(folder / name) != digest]
    if changed:
        raise EmberError(f"{trained.path}: its base model {folder} has changed since the run trained "
                         f"on it ({', '.join(changed)} differ from {RUN_FILE}); the adapter only fits "
                         f"the original weights: restore them, or train again")
    return folder


def merged_model(trained: TrainedRun, events: Events) -> torch.nn.Module:
    """The trained model in float32: the final weights, or the base with the adapter merged in."""
    from transformers import AutoModelForCausalLM
    if trained.kind != "lora":
        return AutoModelForCausalLM.from_pretrained(trained.final, dtype=torch.float32)
    from peft import PeftModel
    base = base_model(trained, events)
    events.stage(f"merging the LoRA adapter of {trained.path} into its base")
    return PeftModel.from_pretrained(base, trained.final).merge_and_unload()


def write_hf(trained: TrainedRun, tmp: Path, dtype: torch.dtype, events: Events) -> None:
    model = merged_model(trained, events)
    events.stage(f"writing a Hugging Face folder ({str(dtype).removeprefix('torch.')})", path=str(tmp))
    model.to(dtype).save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(trained.final).save(tmp)


def write_peft(trained: TrainedRun, tmp: Path, out: Path, dtype: torch.dtype, events: Events) -> None:
    """The adapter files, cast to `dtype`, with base_model_name_or_path set to a folder that loads:
    the model folder ember trained on (a GGUF's converted folder), or for builtin:tiny its
    seeded init, written into OUT/base."""
    from safetensors.torch import load_file, save_file
    tmp.mkdir()
    if trained.spec == "builtin:tiny":
        base_path = out / "base"
        base_model(trained, events).save_pretrained(tmp / "base", safe_serialization=True)
        load_tokenizer(trained.final).save(tmp / "base")
    else:
        base_path = check_base_files(trained, events).resolve()
    config = json.loads((trained.final / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(base_path)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    weights = load_file(trained.final / ADAPTER_WEIGHTS)
    save_file({k: v.to(dtype) for k, v in weights.items()}, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    load_tokenizer(trained.final).save(tmp)


def gguf_tokenizer_source(trained: TrainedRun) -> Path:
    """Where the GGUF's tokenizer comes from: the run's source GGUF file (its tokenizer.ggml.*
    metadata is copied), else the run's saved Hugging Face tokenizer folder."""
    if trained.spec == "builtin:tiny":
        raise EmberError(f"{trained.path}: builtin:tiny has ember's byte-level tokenizer, which "
                         f"llama.cpp cannot represent; export it with --format hf")
    source = trained.record.get("model", {})
    if source.get("kind") == "gguf":
        path = Path(source["path"])
        if not path.is_file() or cached_sha256(path) != source.get("sha256"):
            raise EmberError(f"{trained.path}: the run's source GGUF {path} is missing or changed "
                             f"since training; its tokenizer is copied from it: restore the file")
        return path
    return trained.final


def make_durable(path: Path) -> None:
    """fsync every file and folder under `path` (or the file itself) before the rename."""
    if path.is_file():
        fsync_file(path)
        return
    for p in path.rglob("*"):
        fsync_file(p) if p.is_file() else fsync_dir(p)
    fsync_dir(path)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
