"""`ember export`: a completed run's weights in the forms serving engines load.

    hf     a merged Hugging Face folder (config.json, tokenizer, model.safetensors):
           transformers, vLLM, TGI. LoRA runs are merged into their base; a QLoRA run's
           ([method] quantize = 'nf4') into the base quantized as it trained on it, dequantized.
    peft   the LoRA adapter with a base_model_name_or_path that loads: peft, vLLM's --lora-modules.
    gguf   one GGUF file (llama family): llama.cpp, Ollama. Written by ember.infer.gguf_export.

What is exported: the run's final weights (a completed run), or with --checkpoint one of its
committed checkpoints: a step, `last` (the newest) or `best` (the lowest held-out loss at a
checkpoint's step, from OUT/eval). A checkpoint holds the trainable weights alone, so the model
is rebuilt as the run built it (the base, or builtin:tiny from the run's seed) and they are
loaded into it.

Writing is atomic: everything goes under a temporary name beside --out, which is fsynced and
renamed into place last; a failure removes the temporary and leaves --out absent. Files get the
modes of ordinary files (0666, folders 0777, less the umask), whatever their writer chose.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ember.ckpt.state import seed_all
from ember.ckpt.store import PREFIX, CheckpointStore, committed_in
from ember.durable import fsync_dir, fsync_file
from ember.errors import EmberError
from ember.events import Events
from ember.metrics.heldout import history as held_out_history
from ember.models import model_folder
from ember.paths import cached_sha256
from ember.recipe import MethodConfig, ModelConfig
from ember.data.tokenizer import Tokenizer
from ember.train.model import load_model
from ember.data.tokenizer import ByteTokenizer, load_tokenizer
from ember.train.quantize import merge_adapters, quantize_base
from ember.runfolder import RUN_FILE, RunDir, remote_job
from ember.paths import ascii_digits

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
    """What export needs to know about a run, read from its folder, and which weights."""
    path: Path
    record: dict[str, Any]
    kind: str     # "full" or "lora"
    spec: str     # [model] path as the run resolved it
    checkpoint: Path | None = None  # a committed checkpoint to export instead of the final weights

    @property
    def final(self) -> Path:
        return self.path / "final"

    @property
    def step(self) -> int | None:
        """The checkpoint's step; None for the final weights."""
        return None if self.checkpoint is None else int(self.checkpoint.name.removeprefix(PREFIX))


def default_out(run: Path, fmt: str, dtype: str, step: int | None = None) -> Path:
    """RUN/export/<format>, and RUN/export/model-<dtype>.gguf for a GGUF file; a checkpoint's
    with its step: RUN/export/<format>-step-N, RUN/export/model-step-N-<dtype>.gguf."""
    at = "" if step is None else f"-step-{step}"
    return run / "export" / (f"model{at}-{dtype}.gguf" if fmt == "gguf" else f"{fmt}{at}")


def export_run(run: Path, fmt: str, out: Path | None = None, dtype: str = "f32",
               events: Events | None = None, checkpoint: str | None = None) -> Exported:
    """Write the run's weights in `fmt` at `out` (default `default_out`), atomically: its final
    weights, or those of `checkpoint` (a step, 'best' or 'last')."""
    events = events or Events()
    if fmt not in FORMATS:
        raise EmberError(f"--format {fmt!r}: unknown; choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise EmberError(f"--dtype {dtype!r}: unknown; choose one of {', '.join(DTYPES)}")
    trained = read_run(run) if checkpoint is None else at_checkpoint(read_record(run), checkpoint, events)
    if fmt == "peft" and trained.kind != "lora":
        raise EmberError(f"{run}: a full fine-tuning run has no adapter to export as peft; export "
                         f"its weights with --format hf (a Hugging Face folder) or --format gguf")
    out = out or default_out(run, fmt, dtype, trained.step)
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
            source = gguf_tokenizer_source(trained, events)  # refuse before loading and merging the model
            write_gguf(merged_model(trained, events), source, model_source(trained), tmp, dtype, events)
        set_modes(tmp, umask())
        make_durable(tmp)
        os.rename(tmp, out)  # the commit point: --out appears whole, or not at all
        fsync_dir(out.parent)
    except SafetensorError as e:  # final/ has no manifest to verify first (a checkpoint has, a base its hashes)
        weights = trained.final if trained.checkpoint is None else trained.checkpoint
        raise EmberError(f"{weights}: the run's weights there cannot be read ({e}); a file is truncated or "
                         f"damaged: export one of its checkpoints (--checkpoint last), or train again") from None
    finally:
        remove(tmp)  # the rename did not happen: leave nothing half-written behind
    size = out.stat().st_size if out.is_file() else sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    what = "final weights" if trained.checkpoint is None else trained.checkpoint.name
    events.info(f"exported {run} ({what}) as {fmt} ({dtype}) to {out}", path=str(out), bytes=size)
    return Exported(fmt, dtype, str(out), size, trained.kind)


def read_record(run: Path) -> TrainedRun:
    """The run folder's record; EmberError if it is not a run folder."""
    if not run.is_dir() or not (run / RUN_FILE).is_file():
        raise EmberError(f"{run}: not an ember run folder (no {RUN_FILE}); give the --out folder "
                         f"of an `ember run`")
    record = RunDir.read(run).record
    recipe = record.get("recipe", {})
    kind = recipe.get("method", {}).get("kind", "full")
    return TrainedRun(run, record, kind, recipe.get("model", {}).get("path", "builtin:tiny"))


def read_run(run: Path) -> TrainedRun:
    """The run folder's record, once it is a completed run with final weights; else EmberError."""
    trained = read_record(run)
    if trained.record.get("completed_step") is None or not trained.final.is_dir():
        origin = remote_job(run)
        how = "run the same `ember run` command again to resume it" if origin is None else (
            f"it is remote job {origin['job']} on '{origin['target']}': while it runs, `ember remote status "
            f"{origin['job']} --wait` brings it back when it ends; stopped or cancelled, `ember remote continue "
            f"{origin['job']}` with new limits resumes it")
        raise EmberError(f"{run}: the run has not completed (no final weights in {trained.final}); "
                         f"finish it first ({how}), or export one of its checkpoints with "
                         f"--checkpoint STEP|best|last")
    return trained


def at_checkpoint(trained: TrainedRun, which: str, events: Events) -> TrainedRun:
    """The run with the committed checkpoint `which` names (a step, 'best', 'last'), verified."""
    run = trained.path
    committed = committed_in(run / "checkpoints")
    steps = ", ".join(str(step) for step, _ in committed) or "none"
    if not committed:
        raise EmberError(f"--checkpoint {which}: {run} has no committed checkpoint (in {run / 'checkpoints'}); "
                         f"export its final weights: leave out --checkpoint")
    if which == "last":
        step, path = committed[-1]
    elif which == "best":
        step, path = best_checkpoint(run, committed, steps)
    elif ascii_digits(which) and int(which) in dict(committed):  # not '²': int() refuses it
        step, path = int(which), dict(committed)[int(which)]
    else:
        wrong = (f"no committed checkpoint at step {int(which)}" if ascii_digits(which)
                 else "not a step, 'best' or 'last'")
        raise EmberError(f"--checkpoint {which!r}: {wrong}; {run} has checkpoints at steps {steps} "
                         f"(or give 'best' or 'last')")
    try:
        CheckpointStore.verify(path)
    except ValueError as e:
        if not path.is_dir():  # renamed away meanwhile: not damaged
            raise retired(path) from None
        raise EmberError(f"--checkpoint {which}: {path} is damaged ({e}); export another of the "
                         f"checkpoints at steps {steps}") from None
    events.info(f"exporting {path.name} (step {step}) of {run}", step=step, path=str(path))
    return dataclasses.replace(trained, checkpoint=path)


def retired(path: Path) -> EmberError:
    """The error for checkpoint `path`, which the run, training still, retired while it was read."""
    return EmberError(f"{path.name} was retired by the run training in {path.parent.parent} while it was read "
                      f"(a run keeps its newest [checkpoint] keep_last checkpoints, and its best); export again "
                      f"(--checkpoint last is then a newer one), or give a step the run keeps")


def best_checkpoint(run: Path, committed: list[tuple[int, Path]], steps: str) -> tuple[int, Path]:
    """The committed checkpoint with the lowest held-out loss evaluated at its step (the earliest
    of equals)."""
    losses = {e["step"]: e["loss"] for e in held_out_history(run)}
    rated = [(losses[step], step, path) for step, path in committed
             if step in losses and math.isfinite(losses[step])]
    if not rated:
        raise EmberError(f"--checkpoint best: none of {run}'s checkpoints (steps {steps}) has a held-out "
                         f"loss evaluated at its step (evaluations need [eval] holdout or files; with "
                         f"[checkpoint] keep_best each better one is checkpointed); give a step or 'last'")
    _, step, path = min(rated)
    return step, path


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


def checkpoint_model(trained: TrainedRun, events: Events) -> torch.nn.Module:
    """The model as the run had it at the checkpoint, in float32: built as the run built it (a
    LoRA run's base checked against the files it trained on), its trainable weights loaded."""
    from ember.ckpt.contents import read_weights
    from ember.ckpt.sharded import is_sharded, read_model
    recipe = trained.record["recipe"]
    method = MethodConfig(**{f.name: recipe["method"][f.name] for f in dataclasses.fields(MethodConfig)
                             if f.name in recipe["method"]})
    if trained.spec == "builtin:tiny":
        seed_all(recipe["train"]["seed"])  # as the run did, before building it
    elif trained.kind == "lora":
        check_base_files(trained, events)
    model = load_model(ModelConfig(trained.spec), method, False, events).model
    try:
        read_model(trained.checkpoint, model) if is_sharded(trained.checkpoint) else read_weights(trained.checkpoint, model)
    except FileNotFoundError:
        if trained.checkpoint.is_dir():
            raise
        raise retired(trained.checkpoint) from None
    except (ValueError, RuntimeError, KeyError) as e:  # it verified: whole, yet not this model's
        raise EmberError(f"{trained.checkpoint} does not load into the model {trained.path / RUN_FILE} "
                         f"describes ({type(e).__name__}: {str(e)[:300]})") from None
    return model


def merged_model(trained: TrainedRun, events: Events) -> torch.nn.Module:
    """The trained model in float32: the final weights (or the checkpoint's), or the base with
    the adapter merged in (a QLoRA run's base quantized as in training, then dequantized; under
    quantize 'gguf' that is the fp32 base itself, bit for bit: ember.train.gguf_blocks)."""
    from transformers import AutoModelForCausalLM
    if trained.checkpoint is not None:
        model = checkpoint_model(trained, events)
        return merge_adapters(model) if trained.kind == "lora" else model
    if trained.kind != "lora":
        return AutoModelForCausalLM.from_pretrained(trained.final, dtype=torch.float32)
    from peft import PeftModel
    base = base_model(trained, events)
    if trained.record["recipe"]["method"].get("quantize", "none") == "nf4":
        quantize_base(base)  # as the run did: its adapter was trained over the 4-bit base
    events.stage(f"merging the LoRA adapter of {trained.path} into its base")
    return merge_adapters(PeftModel.from_pretrained(base, trained.final))


def tokenizer_of(trained: TrainedRun, events: Events) -> Tokenizer:
    """The run's tokenizer: saved with the final weights, or the base model's (a checkpoint)."""
    if trained.checkpoint is None:
        return load_tokenizer(trained.final)
    if trained.spec == "builtin:tiny":
        return ByteTokenizer()
    return load_tokenizer(model_folder(trained.spec, events)[0])


def for_inference(model: torch.nn.Module) -> torch.nn.Module:
    """The config an engine reads: the KV cache on (training turns it off)."""
    model.config.use_cache = True
    return model


def write_hf(trained: TrainedRun, tmp: Path, dtype: torch.dtype, events: Events) -> None:
    model = for_inference(merged_model(trained, events))
    events.stage(f"writing a Hugging Face folder ({str(dtype).removeprefix('torch.')})", path=str(tmp))
    model.to(dtype).save_pretrained(tmp, safe_serialization=True)
    tokenizer_of(trained, events).save(tmp)


def write_peft(trained: TrainedRun, tmp: Path, out: Path, dtype: torch.dtype, events: Events) -> None:
    """The adapter files, cast to `dtype`, with base_model_name_or_path set to a folder that loads:
    the model folder ember trained on (a GGUF's converted folder), or for builtin:tiny its
    seeded init, written into OUT/base."""
    from safetensors.torch import load_file, save_file
    tmp.mkdir()
    adapter = trained.final
    if trained.checkpoint is not None:  # peft writes the checkpoint's adapter as it wrote final/
        adapter = tmp / ".adapter"
        checkpoint_model(trained, events).save_pretrained(adapter, safe_serialization=True)
    if trained.spec == "builtin:tiny":
        base_path = out / "base"
        for_inference(base_model(trained, events)).save_pretrained(tmp / "base", safe_serialization=True)
        tokenizer_of(trained, events).save(tmp / "base")
    else:
        base_path = check_base_files(trained, events).resolve()
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(base_path)
    weights = load_file(adapter / ADAPTER_WEIGHTS)
    remove(tmp / ".adapter")
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    save_file({k: v.to(dtype) for k, v in weights.items()}, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    tokenizer_of(trained, events).save(tmp)


def gguf_tokenizer_source(trained: TrainedRun, events: Events | None = None) -> Path:
    """Where the GGUF's tokenizer comes from: the run's source GGUF file (its tokenizer.ggml.*
    metadata is copied), else the run's Hugging Face tokenizer folder (final/, or the base's)."""
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
    return trained.final if trained.checkpoint is None else model_folder(trained.spec, events)[0]


def model_source(trained: TrainedRun) -> Path | None:
    """What the base model came from, for the GGUF's general.* metadata (name, licence): the
    source GGUF file, or the Hugging Face model folder (its model card); None if gone."""
    source = trained.record.get("model", {})
    if source.get("kind") == "gguf":
        return Path(source["path"])  # checked by gguf_tokenizer_source
    path = Path(source.get("path", "")) if source.get("path") else None
    return path if path is not None and path.is_dir() else None


def umask() -> int:
    """This process's umask, read without changing it (Linux); else set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def set_modes(path: Path, mask: int) -> None:
    """Ordinary modes under `path`: files 0666, folders 0777, less `mask`. safetensors writes its
    files 0600 (a private temporary renamed into place), which an export should not keep."""
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


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
