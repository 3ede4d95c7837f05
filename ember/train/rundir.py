"""The run folder: its record (run.json), its attempts, its metrics log, its final weights.

    OUT/run.json          what it takes to re-run: resolved recipe, hashes, versions, machine
    OUT/attempts.jsonl    one line per process start
    OUT/metrics.jsonl     one line per optimizer step (fsynced before each checkpoint commits)
    OUT/metrics.lost.jsonl  lines of steps computed after the last checkpoint of an attempt that died
    OUT/checkpoints/      see ember.ckpt.store
    OUT/final/            the trained weights (safetensors)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember.ckpt.store import fsync_dir, fsync_file
from ember.errors import EmberError
from ember.jsonl import read_jsonl
from ember.recipe import OPERATIONAL_KEYS, Recipe, diff_recipes
from ember.recipe import get_dotted as _get

RUN_FILE = "run.json"


def write_durable(path: Path, text: str) -> None:
    """Replace a small file atomically and durably: temp file, fsync, rename, fsync folder."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def open_append(path: Path):
    """Open a log for appending; a file created here gets a durable name (fsync of its folder),
    or fsyncing its contents later would keep data that a power cut leaves without a name."""
    new = not path.exists()
    f = open(path, "a")
    if new:
        fsync_dir(path.parent)
    return f


def append_durable(path: Path, text: str) -> None:
    with open_append(path) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class RunDir:
    def __init__(self, path: Path):
        self.path = path
        self.ckpt_dir = path / "checkpoints"
        self.metrics_path = path / "metrics.jsonl"
        self.record: dict[str, Any] = {}
        self.attempt = 0

    @classmethod
    def open(cls, path: Path, recipe: Recipe, allow_change: bool, warn: Callable[[str], None]) -> RunDir:
        """Create the run folder durably, or reopen it after checking the recipe has not changed."""
        run = cls(path)
        record_path = path / RUN_FILE
        if record_path.is_file():
            run.record = json.loads(record_path.read_text())
            run._check_recipe(recipe, allow_change, warn)
        elif path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise EmberError(f"--out {path}: exists and is not an ember run folder (no {RUN_FILE}); "
                             f"choose a new folder")
        else:
            path.mkdir(parents=True, exist_ok=True)
            fsync_dir(path.parent)  # the run folder itself survives a power cut
            run.record = {"id": f"{path.name}-{secrets.token_hex(3)}", "created": time.time(),
                          "recipe": recipe.to_dict(),
                          "recipe_digest": recipe.digest(), "recipe_changes": []}
            write_durable(record_path, json.dumps(run.record, indent=1))
        run.attempt = run._count_attempts() + 1
        return run

    def _check_recipe(self, recipe: Recipe, allow_change: bool, warn: Callable[[str], None]) -> None:
        old, new = self.record["recipe"], recipe.to_dict()
        changed = diff_recipes(old, new)
        material = [k for k in changed if k not in OPERATIONAL_KEYS]
        if material and not allow_change:
            lines = "\n".join(f"  {k}: {_get(old, k)!r} -> {_get(new, k)!r}" for k in material)
            raise EmberError(f"--out {self.path}: belongs to a run with a different recipe; changed:\n"
                             f"{lines}\nuse another --out, restore the recipe, or pass "
                             f"--allow-recipe-change to continue with the new one (it is recorded)")
        if changed:
            if material:
                warn(f"continuing with a changed recipe: {', '.join(material)} (recorded in {RUN_FILE})")
            self.record["recipe_changes"].append(
                {"time": time.time(), "keys": {k: [_get(old, k), _get(new, k)] for k in changed}})
            self.record["recipe"], self.record["recipe_digest"] = new, recipe.digest()
            self.save_record()

    def save_record(self) -> None:
        write_durable(self.path / RUN_FILE, json.dumps(self.record, indent=1))

    def _count_attempts(self) -> int:
        p = self.path / "attempts.jsonl"
        return sum(1 for line in p.read_text().splitlines() if line.strip()) if p.exists() else 0

    def start_attempt(self, info: dict[str, Any]) -> None:
        append_durable(self.path / "attempts.jsonl",
                       json.dumps({"attempt": self.attempt, "pid": os.getpid(), "start": time.time(),
                                   "hostname": socket.gethostname(), **info}) + "\n")

    def rewind_metrics(self, step: int) -> int:
        """Keep metrics lines up to `step` (the resumed checkpoint); move later ones to the lost log."""
        records = read_jsonl(self.metrics_path)  # a line torn by a kill mid-write is dropped
        kept = [r for r in records if r["step"] <= step]
        lost = [r for r in records if r["step"] > step]
        if lost:
            append_durable(self.path / "metrics.lost.jsonl", "".join(json.dumps(r) + "\n" for r in lost))
        if self.metrics_path.exists():
            write_durable(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        return len(lost)

    def write_final(self, write: Callable[[Path], None]) -> Path:
        """Write the final weights into a temp folder, make it durable, then swap it into place."""
        final, tmp = self.path / "final", self.path / f".tmp-final.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        for p in tmp.rglob("*"):
            if p.is_file():
                fsync_file(p)
            else:
                fsync_dir(p)
        fsync_dir(tmp)
        if final.exists():
            old = self.path / f".del-final.{os.getpid()}"
            os.rename(final, old)
            shutil.rmtree(old)
        os.rename(tmp, final)
        fsync_dir(self.path)
        return final


class MetricsLog:
    """Appends one JSON line per optimizer step; `sync()` makes them durable."""

    def __init__(self, path: Path):
        self.file = open_append(path)

    def append(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def sync(self) -> None:
        os.fsync(self.file.fileno())  # durability point: loss history up to the checkpoint

    def close(self) -> None:
        self.file.close()
