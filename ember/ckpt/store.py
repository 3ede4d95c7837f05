"""Durable checkpoints: atomic commit, manifest with checksums, verified load, retention.

A checkpoint is a folder of files plus `MANIFEST.json` (each file's size and SHA-256). The
folder's states, and the only transitions (this module alone makes them):

    (absent)      --begin-->       .tmp-step-N.PID   files written and fsynced, manifest last
    .tmp-step-N   --commit-->      step-N            fsync folder, rename, fsync parent
    step-N        --retire-->      .del-step-N       rename + fsync parent, then delete
    step-N        --quarantine-->  corrupt-step-N.T  a failed verification on load

A folder named `step-N` is committed: the rename is the commit point, and the rename happens
only after every byte inside it is durable. `.tmp-*` and `.del-*` folders are never committed
(or no longer wanted) and are swept at start-up. Which files a checkpoint holds is the
caller's business, so sharded state from several processes (torch.distributed.checkpoint
writes one file per rank) commits under the same protocol.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember import faults
from ember.errors import EmberError

MANIFEST = "MANIFEST.json"
FORMAT = "ember-checkpoint/1"
PREFIX = "step-"


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_in(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint in `root`, oldest first (none if no `root`)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
            found.append((int(p.name[len(PREFIX):]), p))
    return sorted(found)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _seal(path: Path) -> tuple[str, dict[str, Any]]:
    """fsync a written file and describe it for the manifest."""
    fsync_file(path)  # durability point: data blocks on disk before the manifest names them
    return path.name, {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


@dataclass
class Checkpoint:
    step: int
    path: Path
    manifest: dict[str, Any]


class CheckpointStore:
    """The committed checkpoints under one folder, oldest to newest by step."""

    def __init__(self, root: Path, keep_last: int):
        self.root = root
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.root.parent)

    def committed(self) -> list[tuple[int, Path]]:
        return committed_in(self.root)

    @staticmethod
    def newest_step(root: Path) -> int:
        """The newest committed step in `root`, 0 if none (reads only; creates nothing)."""
        return max((step for step, _ in committed_in(root)), default=0)

    def sweep(self) -> list[str]:
        """Delete leftovers of interrupted commits and retirements; return their names."""
        swept = []
        for p in self.root.iterdir():
            if p.name.startswith((".tmp-", ".del-")):
                shutil.rmtree(p, ignore_errors=False)
                swept.append(p.name)
        if swept:
            fsync_dir(self.root)
        return swept

    def save(self, step: int, write: Callable[[Path], None], meta: dict[str, Any]) -> Checkpoint:
        """Commit a checkpoint whose files `write(folder)` creates; retire the oldest beyond keep_last."""
        name = f"{PREFIX}{step:09d}"
        tmp = self.root / f".tmp-{name}.{os.getpid()}"
        try:
            tmp.mkdir()
            write(tmp)
            # One thread per file: hashlib and fsync release the GIL, so files hash in parallel.
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                files = dict(pool.map(_seal, sorted(tmp.iterdir())))
            faults.point("ckpt.files_written")
            manifest = {"format": FORMAT, "step": step, "created": time.time(), "files": files,
                        "meta": meta}
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)  # the folder's entries are durable before it becomes visible
            faults.point("ckpt.manifest_written")
            final = self.root / name
            if final.exists():  # a leftover at this step that failed to load earlier
                self.quarantine(final, "superseded")
            os.rename(tmp, final)  # the commit point
            faults.point("ckpt.renamed")
            fsync_dir(self.root)
            faults.committed(step)
        except Exception as e:  # torch.save and safetensors report a full disk as their own types
            shutil.rmtree(tmp, ignore_errors=True)
            last = self.committed()
            kept = f"the newest committed checkpoint, {last[-1][1].name}, is intact" if last \
                else "no earlier checkpoint exists"
            full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) \
                or "space" in str(e).lower() or "write" in str(e).lower()
            hint = "free disk space" if full else "fix the cause"
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise EmberError(f"checkpoint at step {step} could not be written to {self.root}: "
                             f"{reason}; {kept}; {hint} and run the same command again "
                             f"to resume") from e
        self._retire_old()
        return Checkpoint(step, final, manifest)

    def _retire_old(self) -> None:
        committed = self.committed()
        for _, path in committed[:-self.keep_last]:
            doomed = path.with_name(f".del-{path.name}")
            os.rename(path, doomed)  # atomic: a kill mid-delete never leaves a half step-N
            fsync_dir(self.root)
            faults.point("ckpt.retired")
            shutil.rmtree(doomed)

    def verify(self, path: Path) -> dict[str, Any]:
        """The manifest of a committed checkpoint, after checking every file; raises ValueError."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"manifest unreadable: {e}") from None
        if manifest.get("format") != FORMAT:
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        for fname, info in manifest["files"].items():
            p = path / fname
            if not p.is_file():
                raise ValueError(f"{fname} is missing")
            if p.stat().st_size != info["bytes"]:
                raise ValueError(f"{fname} has {p.stat().st_size} bytes, manifest says {info['bytes']}")
            if sha256_file(p) != info["sha256"]:
                raise ValueError(f"{fname} fails its SHA-256 check")
        return manifest

    def load_latest(self, warn: Callable[[str], None]) -> Checkpoint | None:
        """The newest checkpoint that verifies; damaged ones are reported and quarantined."""
        for step, path in reversed(self.committed()):
            try:
                manifest = self.verify(path)
            except ValueError as e:
                moved = self.quarantine(path, "corrupt")
                warn(f"checkpoint {path.name} is damaged ({e}); moved it to {moved.name} and "
                     f"falling back to the previous one")
                continue
            return Checkpoint(step, path, manifest)
        return None

    def quarantine(self, path: Path, why: str) -> Path:
        target = path.with_name(f"{why}-{path.name}.{time.time_ns()}")
        os.rename(path, target)
        fsync_dir(self.root)
        return target
