"""The runs whose LoRA adapters an engine serves: where they are, whether they were trained on its
base, and their newest checkpoint's weights, verified, copied into a peft adapter slot.

A model name is a run folder's name (`runs/a` -> `a`): each registered folder that holds a
run.json is a run, and any other registered folder is a folder of runs, rescanned on every call
so new runs appear. On a name clash the first registered wins.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from ember.ckpt.contents import MODEL_FILE
from ember.ckpt.store import MANIFEST, CheckpointStore
from ember.errors import EmberError
from ember.events import Events
from ember.infer.runs import BASE, find_runs  # noqa: F401  (re-exported: the engine's names)
from ember.models import resolve_path
from ember.recipe import MethodConfig
from ember.runfolder import RUN_FILE, RunDir


class RequestError(EmberError):
    """A request the engine cannot serve; `status` is the HTTP status it answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_roots(roots: list[Path], events: Events) -> None:
    """Refuse --runs paths that are files or whose run names clash; warn of folders not made yet."""
    named = [p.name for p in roots if (p / RUN_FILE).is_file()]
    for p in roots:
        if p.exists() and not p.is_dir():
            raise EmberError(f"--runs {p}: not a folder; give a run folder (with {RUN_FILE}) "
                             f"or a folder of run folders")
        if not p.exists():  # a folder of runs may be made later ($EMBER_HOME/runs): rescanned then
            events.warn(f"--runs {p}: no such folder yet; its runs are served once it has some")
    if BASE in named or len(set(named)) != len(named):
        raise EmberError(f"--runs: run folder names {named} must be unique and not '{BASE}': "
                         f"a model is asked for by its run folder's name")


def servable_record(name: str, path: Path, spec: str, seed: int, files: dict | None) -> dict[str, Any]:
    """The run's record, if its adapter can be served on the base `spec` (initialised with `seed`,
    of model `files`); else RequestError."""
    record = RunDir.read(path).record
    recipe = record["recipe"]  # an object (ember.runfolder.read_record); the tables read here too:
    for where, value in [("recipe.method", recipe.get("method", {})), ("recipe.model", recipe.get("model", {})),
                         ("recipe.train", recipe.get("train", {})), ("model", record.get("model", {}))]:
        if not isinstance(value, dict):  # before, a 500 from /v1/models and every request
            raise RequestError(f"model {name!r}: {path / RUN_FILE}: its {where!r} is not an object; the record "
                               f"was damaged or replaced: restore it from a backup, or serve another run", 409)
    if recipe.get("method", {}).get("kind") != "lora":
        raise RequestError(f"model {name!r}: {path} is a full fine-tuning run; this engine serves "
                           f"only LoRA adapters on its base model. Serve the run's weights as a "
                           f"base of their own: --model {path / 'final'}")
    if why := _other_base(recipe, record.get("model", {}), spec, seed, files):
        raise RequestError(f"model {name!r}: {path} was trained on {why}")
    return record


def _other_base(recipe: dict[str, Any], trained: dict[str, Any], mine: str, seed: int,
                files: dict | None) -> str | None:
    """How the run's base differs from the engine's (`mine`), or None if it is the same."""
    spec = recipe.get("model", {}).get("path")
    if spec == "builtin:tiny" == mine:
        theirs = recipe.get("train", {}).get("seed")
        return None if theirs == seed else (
            f"builtin:tiny initialised with seed {theirs}, and this engine's with seed {seed}; "
            f"start one with --seed {theirs}")
    if trained.get("files") and files:  # the same weights, wherever the folder is now
        return None if trained["files"] == files else f"{spec}, other model files than {mine}'s"
    if spec and not spec.startswith("builtin:") and not mine.startswith("builtin:") \
            and resolve_path(spec).resolve() == resolve_path(mine).resolve():
        return None
    return f"{spec}, not this engine's base {mine}; serve it from one started with --model {spec}"


def lora_method(record: dict[str, Any]) -> MethodConfig:
    """The [method] a servable run's record was trained with."""
    method = record["recipe"]["method"]
    known = {f.name for f in dataclasses.fields(MethodConfig)}
    return MethodConfig(**{k: v for k, v in method.items() if k in known})


def checkpoint_identity(folder: Path) -> tuple:
    """What tells one committed checkpoint from another, even one committed again at the same step."""
    st = (folder / MANIFEST).stat()
    return folder.name, st.st_ino, st.st_mtime_ns


def verified_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's trainable weights, once its files check against its manifest; else ValueError."""
    from safetensors.torch import load_file
    try:
        files = CheckpointStore.verify(folder)["files"]
    except (AttributeError, KeyError, TypeError) as e:  # the store's verify lets these through
        raise ValueError(f"{MANIFEST} malformed: {e!r}") from None
    if MODEL_FILE not in files:
        raise ValueError(f"{MANIFEST} names no {MODEL_FILE}")
    return load_file(folder / MODEL_FILE)


def copy_adapter_weights(peft_model: Any, slot: str, weights: dict[str, torch.Tensor], folder: Path) -> None:
    """Put a checkpoint's adapter (trained under peft's name 'default') into adapter `slot`."""
    renamed = {re.sub(r"\.default(?=\.|$)", f".{slot}", k): v for k, v in weights.items()}
    params = {n: p for n, p in peft_model.named_parameters() if re.search(rf"\.{slot}(\.|$)", n)}
    wrong = sorted(n for n in params.keys() | renamed.keys()
                   if n not in params or n not in renamed or params[n].shape != renamed[n].shape)
    if wrong:
        raise RequestError(f"{folder / MODEL_FILE}: does not fit a LoRA adapter built from the run's "
                           f"[method] settings ({len(wrong)} tensors differ, e.g. {wrong[0]}); the run's "
                           f"recipe may have changed since: wait for its next checkpoint", 409)
    with torch.no_grad():
        for name, tensor in renamed.items():
            params[name].copy_(tensor)
