"""Durable checkpoints: atomic commit, manifest with checksums, verified load, retention.

A checkpoint is a folder of files plus `MANIFEST.json` (each file's size and CRC32C, and the
manifest's own CRC32C). The folder's states, and the only transitions (this module alone makes
them):

    (absent)      --begin-->       .tmp-step-N.PID   files written and fsynced, manifest last
    .tmp-step-N   --commit-->      step-N            fsync folder, rename, fsync parent
    step-N        --retire-->      .del-step-N       rename + fsync parent; deleted behind the commit
    step-N        --quarantine-->  corrupt-step-N.T  a failed verification on load (SetAside)

A folder named `step-N` is committed: the rename is the commit point, and the rename happens
only after every byte inside it is durable. `.tmp-*` and `.del-*` folders are never committed
(or no longer wanted) and are swept at start-up. Which files a checkpoint holds is the
caller's business, so sharded state from several processes (torch.distributed.checkpoint
writes one file per rank) commits under the same protocol. A `write(folder)` that makes its
files durable and checksums them as it writes (ember.ckpt.contents) returns their manifest
entries; any other file in the folder is fsynced and checksummed here, read back.

Retention keeps the newest `keep_last` committed checkpoints, and the one whose step the newest
commit's manifest names in `meta["best_step"]` (the best held-out loss so far: ember.train.saving),
however old; that name is durable with the commit, so a resume, or a kill at any point, keeps
the same one. Retirement renames (the durable part, on the commit's path: a kill after it never
brings the old step back) and leaves the deletion to a thread of its own, so the commit returns
as soon as the new checkpoint is durable; `settle()` waits for the deletion. A kill during it
leaves a `.del-*` folder, swept at the next start. A `.del-*` or `.tmp-*` folder that cannot be
deleted (a file held open on a network file system, an immutable file, a folder another program
writes into) changes nothing committed: training goes on, the deletion is tried again at the
next retirement and the next start, and `deletion_errors()` hands the caller each error as the
operating system gave it, to report. (A leftover `.del-step-N` never blocks the retirement of
a later `step-N`: that one is renamed to `.del-step-N.<ns>`.)

Formats: ember-checkpoint/2 checksums with CRC32C (integrity: torn, truncated, zeroed or
flipped data); ember-checkpoint/1 (SHA-256, optimizer.pt) still verifies and loads.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember import faults
from ember.durable import crc32c_bytes, crc32c_file, fsync_dir, fsync_file, sha256_file
from ember.errors import EmberError
from ember.paths import ascii_digits

if TYPE_CHECKING:  # a type only: reading checkpoints (ember report, the dashboard) needs no torch
    from ember.world import World

MANIFEST = "MANIFEST.json"
FORMAT = "ember-checkpoint/2"
FORMATS = ("ember-checkpoint/1", FORMAT)  # verified and loaded; only the last is written
PREFIX = "step-"
NEARLY_FULL = 16 << 20  # bytes free under which a failed write is taken for a full disk


class SetAside(StrEnum):
    """Why a checkpoint folder was set aside: the prefix of its new name (quarantine)."""
    CORRUPT = "corrupt"        # it failed verification on load
    SUPERSEDED = "superseded"  # a leftover at the step a new commit takes


def committed_in(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint in `root`, oldest first (none if no `root`)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        number = p.name[len(PREFIX):]  # ASCII digits: '²' is isdigit() but no int, '٣' no name of ours
        if p.name.startswith(PREFIX) and ascii_digits(number) and p.is_dir():
            found.append((int(number), p))
    return sorted(found)


def _seal_all(paths: list[Path]) -> dict[str, Any]:
    """fsync and describe files; one thread per file: crc32c and fsync release the GIL."""
    if len(paths) <= 1:
        return dict(map(_seal, paths))
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(paths))) as pool:
        return dict(pool.map(_seal, paths))


def _seal(path: Path) -> tuple[str, dict[str, Any]]:
    """fsync a file written by someone else and describe it for the manifest."""
    fsync_file(path)  # durability point: data blocks on disk before the manifest names them
    return path.name, {"bytes": path.stat().st_size, "crc32c": crc32c_file(path)}


def _manifest_crc(manifest: dict[str, Any]) -> str:
    """CRC32C of a manifest's canonical JSON, without its own checksum field."""
    body = {k: v for k, v in manifest.items() if k != "crc32c"}
    return crc32c_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _check_file(path: Path, fname: str, info: dict[str, Any]) -> None:
    """Raise ValueError unless `fname` in `path` has the size and checksum its entry says."""
    p = path / fname
    if not p.is_file():
        raise ValueError(f"{fname} is missing")
    if p.stat().st_size != info["bytes"]:
        raise ValueError(f"{fname} has {p.stat().st_size} bytes, manifest says {info['bytes']}")
    if "crc32c" in info:
        if crc32c_file(p) != info["crc32c"]:
            raise ValueError(f"{fname} fails its CRC32C check")
    elif sha256_file(p) != info["sha256"]:  # ember-checkpoint/1
        raise ValueError(f"{fname} fails its SHA-256 check")


def _delete(folders: list[Path]) -> list[str]:
    """Delete retired or abandoned folders (never committed, or no longer: renamed away durably);
    return the errors of those that could not be, as the operating system gave them."""
    errors = []
    for folder in folders:
        try:
            shutil.rmtree(folder)
        except OSError as e:
            errors.append(f"{folder.name}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""))
    return errors


def _leftovers(root: Path) -> list[Path]:
    """Folders of interrupted commits and retirements (.tmp-*, .del-*)."""
    return sorted(p for p in root.iterdir() if p.name.startswith((".tmp-", ".del-")))


class CheckpointNotWritten(EmberError):
    """A checkpoint could not be committed; every earlier one is intact. `disk_full`: for want of
    space (the advice is to free some), else another cause (the advice is to fix it)."""

    def __init__(self, message: str, disk_full: bool):
        super().__init__(message)
        self.disk_full = disk_full


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
        self._deleting: threading.Thread | None = None
        self._delete_errors: list[str] = []
        self._errors_lock = threading.Lock()  # the deletion thread adds, the training thread takes
        self._reported: set[str] = set()  # each folder's error is told once, not at every retry
        self.root.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.root.parent)

    def committed(self) -> list[tuple[int, Path]]:
        return committed_in(self.root)

    @staticmethod
    def newest_step(root: Path) -> int:
        """The newest committed step in `root`, 0 if none (reads only; creates nothing)."""
        return max((step for step, _ in committed_in(root)), default=0)

    def sweep(self) -> list[str]:
        """Delete leftovers of interrupted commits and retirements; return the names of those
        deleted (the others' errors wait in deletion_errors())."""
        self.settle()  # not while this store's own deletion is under way
        found = _leftovers(self.root)
        self._add_errors(_delete(found))
        swept = [p.name for p in found if not p.exists()]
        if swept:
            fsync_dir(self.root)
        return swept

    def deletion_errors(self) -> list[str]:
        """Why folders retired or left over could not be deleted, since the last call: nothing
        committed is affected, and each is tried again at the next retirement and start."""
        with self._errors_lock:
            errors, self._delete_errors = self._delete_errors, []
        new = [e for e in dict.fromkeys(errors) if e not in self._reported]
        self._reported.update(new)
        return new

    def _add_errors(self, errors: list[str]) -> None:
        with self._errors_lock:
            self._delete_errors += errors

    def save(self, step: int, write: Callable[[Path], Any], meta: dict[str, Any]) -> Checkpoint:
        """Commit a checkpoint whose files `write(folder)` creates (returning the manifest entries
        of those it made durable and checksummed, if any); retire the oldest beyond keep_last."""
        tmp = self.root / f".tmp-{PREFIX}{step:09d}.{os.getpid()}"
        try:
            tmp.mkdir()
            described = write(tmp)
            files = dict(described) if isinstance(described, dict) else {}  # else: seal them all here
            files.update(_seal_all(sorted(p for p in tmp.iterdir() if p.name not in files)))
            final = self._commit(step, tmp, files, meta)
        except Exception as e:  # torch.save and safetensors report a full disk as their own types
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(step, e) from e
        self._retire_old(meta.get("best_step"))
        return Checkpoint(step, final, json.loads((final / MANIFEST).read_text()))

    def save_collective(self, step: int, write: Callable[[Path], None], own: Callable[[Path], list[Path]],
                        meta: dict[str, Any], world: World) -> Checkpoint | None:
        """The same commit with several ranks writing: rank 0 makes the temporary folder, every
        rank writes its files into it (`write`, a collective) and seals the ones it wrote
        (`own(folder)`); after they are all durable, rank 0 writes the manifest of every file
        and renames. Returns the checkpoint on rank 0, None elsewhere. A rank whose write fails
        raises; the others then fail at the next collective (its timeout bounds the wait)."""
        tmp = self.root / f".tmp-{PREFIX}{step:09d}.{world.broadcast(os.getpid())}"
        if world.main:
            tmp.mkdir()
        world.barrier()
        try:
            write(tmp)
            mine = _seal_all(own(tmp))
        except Exception as e:
            raise self._failed(step, e) from e
        everyone = world.gather(mine)  # sync point: every rank's files are durable after this
        final = None
        if world.main:
            files = {name: info for part in everyone for name, info in part.items()}
            try:
                final = self._commit(step, tmp, files, meta)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise self._failed(step, e) from e
            self._retire_old(meta.get("best_step"))
        world.barrier()  # no rank goes on (or exits) before the commit
        return None if final is None else Checkpoint(step, final, json.loads((final / MANIFEST).read_text()))

    def _commit(self, step: int, tmp: Path, files: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Manifest, fsync, rename: the commit point. Every file in `files` is durable already."""
        faults.point("ckpt.files_written")
        manifest = {"format": FORMAT, "step": step, "created": time.time(), "files": files, "meta": meta}
        manifest["crc32c"] = _manifest_crc(manifest)  # a flipped bit anywhere in it is caught
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)  # the folder's entries are durable before it becomes visible
        faults.point("ckpt.manifest_written")
        final = self.root / f"{PREFIX}{step:09d}"
        if final.exists():  # a leftover at this step that failed to load earlier
            self.quarantine(final, SetAside.SUPERSEDED)
        os.rename(tmp, final)  # the commit point
        faults.point("ckpt.renamed")
        fsync_dir(self.root)
        faults.committed(step)
        return final

    def _failed(self, step: int, e: Exception) -> CheckpointNotWritten:
        last = self.committed()
        kept = f"the newest committed checkpoint, {last[-1][1].name}, is intact" if last \
            else "no earlier checkpoint exists"
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) \
            or "space" in str(e).lower() or "write" in str(e).lower()
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        # torch.save (DCP's files) reports a full disk as "unexpected pos N vs M": ask the disk
        if not full and (free := shutil.disk_usage(self.root).free) < NEARLY_FULL:
            full, reason = True, f"{reason} ({free / 1e6:.1f} MB free there)"
        hint = "free disk space" if full else "fix the cause"
        return CheckpointNotWritten(f"checkpoint at step {step} could not be written to {self.root}: "
                                    f"{reason}; {kept}; {hint} and run the same command again to resume",
                                    full)

    def _retire_old(self, best: int | None) -> None:
        """Rename the checkpoints beyond keep_last, but for step `best`, away (durably), and delete
        them behind the commit: the caller goes on while a thread deletes (a 1.6 GB folder takes
        ~0.3 s)."""
        self.settle()
        retired = False
        for step, path in self.committed()[:-self.keep_last]:
            if step == best:
                continue
            target = path.with_name(f".del-{path.name}")
            if target.exists():  # one left by an earlier retirement that could not be deleted
                target = path.with_name(f".del-{path.name}.{time.time_ns()}")
            os.rename(path, target)  # atomic: a kill mid-delete never leaves a half step-N
            fsync_dir(self.root)
            faults.point("ckpt.retired")
            retired = True
        doomed = [p for p in _leftovers(self.root) if p.name.startswith(".del-")] if retired else []
        if doomed:  # this retirement's, and any an earlier deletion could not finish
            self._deleting = threading.Thread(target=self._delete_in_background, args=(doomed,),
                                              name="ember-ckpt-retire", daemon=True)
            self._deleting.start()

    def _delete_in_background(self, doomed: list[Path]) -> None:
        self._add_errors(_delete(doomed))  # reported by the caller: deletion_errors()

    def settle(self) -> None:
        """Wait until retired checkpoints are deleted (or could not be: deletion_errors())."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """The manifest of a committed checkpoint, after checking every file; raises ValueError
        (reads only: `CheckpointStore.verify(path)` needs no store)."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
            raise ValueError(f"manifest unreadable: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
            raise ValueError(f"unknown format {manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
        if manifest["format"] != FORMATS[0] and manifest.get("crc32c") != _manifest_crc(manifest):
            raise ValueError(f"{MANIFEST} fails its CRC32C check")
        try:
            for fname, info in manifest["files"].items():
                _check_file(path, fname, info)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{MANIFEST} malformed: {e!r}") from None
        return manifest

    def load_latest(self, warn: Callable[[str], None]) -> Checkpoint | None:
        """The newest checkpoint that verifies; damaged newer ones are reported and quarantined.
        When none verifies, each is reported and none is moved (as a resume leaves them:
        ember.train.resume), and the answer is None."""
        damaged: list[tuple[Path, str]] = []
        for step, path in reversed(self.committed()):
            try:
                manifest = self.verify(path)
            except ValueError as e:
                damaged.append((path, str(e)))
                continue
            for bad, why in damaged:
                moved = self.quarantine(bad, SetAside.CORRUPT)
                warn(f"checkpoint {bad.name} is damaged ({why}); moved it to {moved.name} and "
                     f"falling back to {path.name}")
            return Checkpoint(step, path, manifest)
        for bad, why in damaged:
            warn(f"checkpoint {bad.name} is damaged ({why}); no older checkpoint verifies: left in place")
        return None

    def quarantine(self, path: Path, why: SetAside) -> Path:
        """Rename `path` out of the committed set, as `{why}-{name}.{ns}`; durable on return."""
        target = path.with_name(f"{why}-{path.name}.{time.time_ns()}")
        os.rename(path, target)
        fsync_dir(self.root)
        return target
