"""The run folder: its record (run.json), its launch, its attempts, its metrics log, its final
weights. This module alone reads and writes these files (the checkpoints are ember.ckpt.store's);
everything else asks it: is the run complete, at what step, which attempt. Torch-free.

    OUT/run.json          what it takes to re-run: resolved recipe, hashes, versions, machine
    OUT/launch.json       what the newest launch decided (ember.launchspec), read by its children
    OUT/attempts.jsonl    one line per process start
    OUT/metrics.jsonl     one line per optimizer step (fsynced before each checkpoint commits)
    OUT/metrics.lost.jsonl  lines of steps computed after the last checkpoint of an attempt that died
    OUT/checkpoints/      see ember.ckpt.store
    OUT/final/            the trained weights (safetensors)
    OUT/.lock             held (flock) by the one process that uses the folder (ember.lock)
    OUT/remote.json       a remote job's results brought back here: {"job": NAME, "target": T}
                          (written by ember.remote.submit; its run is continued there, not here)
    OUT/console.log       what `ember run` printed after its terminal or pipe went away (ember.cli.render)
"""

from __future__ import annotations

import copy
import errno
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember.ckpt.store import committed_in
from ember.durable import append_durable, fsync_dir, fsync_file, open_append, write_durable
from ember.errors import EmberError, NotFound
from ember.events import Events
from ember.jsonl import Shape, read_jsonl
from ember.launchspec import ENV as LAUNCH_ENV
from ember.launchspec import LaunchSpec
from ember.lock import Lock, acquire
from ember.recipe import OPERATIONAL_KEYS, Recipe, diff_recipes
from ember.recipe import get_dotted as _get

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
REMOTE_FILE = "remote.json"
CONSOLE_LOG = "console.log"
LAUNCH_FILE = "launch.json"
SERVE_FILE = "serve.json"  # co-serving's address and token, while the run serves ([serve] coserve)


def new_run_id(path: Path) -> str:
    """The folder's name and 6 hex digits: 'demo-1a2b3c' (`--out .` named by the folder it is)."""
    return f"{path.resolve().name or 'run'}-{secrets.token_hex(3)}"


def make_folder(path: Path) -> None:
    """Create the run folder durably, or check that an existing folder is one (or empty)."""
    if path.is_symlink() and not path.exists():  # a link to nothing: mkdir would say only "File exists"
        try:
            os.stat(path)
        except OSError as e:
            why = "which loops back on itself" if e.errno == errno.ELOOP else "which is not there"
            raise EmberError(f"--out {path}: a symbolic link to {os.readlink(path)}, {why}; mount or "
                             f"create what it points to, or choose another --out") from None
    if (problem := unusable(path)) is not None:
        raise EmberError(f"--out {path}: {problem}; choose a new folder")
    if path.is_dir():
        return
    path.mkdir(parents=True)
    fsync_dir(path.parent)  # the run folder itself survives a power cut


def unusable(path: Path) -> str | None:
    """Why `path` cannot be a run folder (a file; a folder of other things), or None."""
    if path.exists() and not path.is_dir():
        return "exists and is not a folder"
    if path.is_dir() and not is_run_folder(path) and any(p.name not in (LOCK_FILE, CONSOLE_LOG, LAUNCH_FILE)
                                                         for p in path.iterdir()):
        return f"exists and is not an ember run folder (no {RUN_FILE})"
    return None


def folder_identity(path: Path) -> dict[str, int]:
    """What tells this folder from a copy of it: its device and inode (a rename keeps them)."""
    st = path.stat()
    return {"device": st.st_dev, "inode": st.st_ino}


def mark_remote(path: Path, job: str, target: str) -> None:
    """Record in run folder `path` that remote job `job` on `target` brings its results back here."""
    write_durable(path / REMOTE_FILE, json.dumps({"job": job, "target": target}))


def remote_job(path: Path) -> dict[str, str] | None:
    """The remote job whose results come back to run folder `path` ({"job", "target"}), or None."""
    try:
        return json.loads((path / REMOTE_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_run_folder(path: Path) -> bool:
    """Whether `path` is a run folder (it has its record)."""
    return (path / RUN_FILE).is_file()


def read_record(path: Path) -> dict[str, Any]:
    """run.json of run folder `path`, or a clear error saying why there is none."""
    if not path.is_dir():
        raise NotFound(f"{path}: no such run folder (give a run folder or a run id from `ember runs`)")
    if not is_run_folder(path):
        raise NotFound(f"{path}: not an ember run folder (no {RUN_FILE})")
    try:
        record = json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise EmberError(f"{path / RUN_FILE}: unreadable ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("recipe"), dict):
        what = "a JSON object" if not isinstance(record, dict) else "its \"recipe\" is not an object"
        raise EmberError(f"{path / RUN_FILE}: not a run record ({what}); it was damaged or replaced: "
                         f"restore it from a backup, or train into a new --out")
    return record


def completed(path: Path) -> int | None:
    """The step run folder `path` completed at (run.json says so and final/ exists), else None."""
    try:
        record = read_record(path)
    except EmberError:
        return None
    step = record.get("completed_step")
    return step if step is not None and (path / "final").is_dir() else None


def write_launch_spec(out: Path, spec: LaunchSpec) -> Path:
    """Write the spec of this launch into the run folder, durably; returns its path."""
    return spec.save(out / LAUNCH_FILE)


def inherited_launch_spec(out: Path) -> LaunchSpec | None:
    """The spec this process was launched with ($EMBER_LAUNCH_SPEC), if it is run folder `out`'s;
    None for a process started by hand, which is then the launcher."""
    where = os.environ.get(LAUNCH_ENV)
    if not where:
        return None
    try:
        spec = LaunchSpec.from_dict(json.loads(Path(where).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise EmberError(f"${LAUNCH_ENV}={where}: unreadable launch spec ({e}); unset it to launch "
                         f"afresh") from None
    return spec if spec.is_for(out) else None


class RunDir:
    def __init__(self, path: Path):
        self.path = path
        self.ckpt_dir = path / "checkpoints"
        self.metrics_path = path / "metrics.jsonl"
        self.record: dict[str, Any] = {}
        self.attempt = 0
        self.lock: Lock | None = None
        self.found: dict[str, Any] | None = None  # the record as open() found it (a reopened run)

    @classmethod
    def open(cls, path: Path, recipe: Recipe, allow_change: bool, events: Events) -> RunDir:
        """Lock the run folder for this process, then create it durably, or reopen it after
        checking that it is the same run (not a copy) and that its recipe has not changed."""
        run = cls(path)
        make_folder(path)
        run.lock = acquire(path / LOCK_FILE, f"--out {path}")
        record_path = path / RUN_FILE
        if record_path.is_file():
            run.record = read_record(path)  # unreadable: an EmberError naming it, nothing written
            run.found = copy.deepcopy(run.record)
            run._check_identity(events)
            run._check_recipe(recipe, allow_change, events)
        else:
            run.record = {"id": new_run_id(path), "created": time.time(), "folder": folder_identity(path),
                          "recipe": recipe.to_dict(), "recipe_digest": recipe.digest(), "recipe_changes": []}
            write_durable(record_path, json.dumps(run.record, indent=1))
        run.attempt = run._count_attempts() + 1
        return run

    @classmethod
    def read(cls, path: Path) -> RunDir:
        """The run folder's record, read only (no lock, nothing written)."""
        run = cls(path)
        run.record = read_record(path)
        return run

    def material_changes(self, recipe: Recipe) -> list[str]:
        """Recipe keys that differ from the run's and change what it computes."""
        return [k for k in diff_recipes(self.record["recipe"], recipe.to_dict()) if k not in OPERATIONAL_KEYS]

    def mark_completed(self, step: int, stopped_early: str | None = None) -> None:
        """Record, durably, that the run completed at `step` and wrote its final weights: at
        max_steps, or earlier for the reason `stopped_early` (early stopping: [eval] patience)."""
        self.record["completed_step"] = step
        self.record["stopped_early"] = stopped_early
        self.save_record()

    def completed_at(self, max_steps: int) -> int | None:
        """The step the run completed at, if it completed: it reached `max_steps`, or it stopped
        early (a run stopped early is complete; the same command does not train it further)."""
        done = self.record.get("completed_step")
        if done is None or not (self.path / "final").is_dir():
            return None
        return done if done >= max_steps or self.record.get("stopped_early") else None

    def _check_identity(self, events: Events) -> None:
        """A folder copied from another run (cp -a) keeps its run.json but not its inode: it becomes
        a new run with its own id, so the original keeps its own ledger history."""
        here, recorded = folder_identity(self.path), self.record.get("folder")
        if recorded is None:  # a run folder from before identities were recorded
            self.record["folder"] = here
            self.save_record()
            return
        if recorded == here:
            return
        old = self.record["id"]
        self.record.update(id=new_run_id(self.path), folder=here, copied_from=old)
        self.save_record()
        events.warn(f"{self.path} is a copy of run {old} (another folder): registered as a new run, "
                    f"{self.record['id']}; its checkpoints and metrics carry over, and run {old} keeps "
                    f"its own history", copied_from=old, run_id=self.record["id"])

    def _check_recipe(self, recipe: Recipe, allow_change: bool, events: Events) -> None:
        old, new = self.record["recipe"], recipe.to_dict()
        changed = diff_recipes(old, new)
        material = [k for k in changed if k not in OPERATIONAL_KEYS]
        unpinned = not self.has_checkpoints()  # nothing trained yet depends on the old recipe
        if material and not allow_change and not unpinned:
            lines = "\n".join(f"  {k}: {_get(old, k)!r} -> {_get(new, k)!r}" for k in material)
            raise EmberError(f"--out {self.path}: belongs to a run with a different recipe; changed:\n"
                             f"{lines}\nuse another --out, restore the recipe, or pass "
                             f"--allow-recipe-change to continue with the new one (it is recorded)")
        if changed:
            if material and unpinned and not allow_change:
                events.info(f"no checkpoint yet: starting with the changed recipe ({', '.join(material)}; "
                            f"recorded in {RUN_FILE})")
            elif material:
                events.warn(f"continuing with a changed recipe: {', '.join(material)} (recorded in {RUN_FILE})")
            self.record["recipe_changes"].append(
                {"time": time.time(), "keys": {k: [_get(old, k), _get(new, k)] for k in changed}})
            self.record["recipe"], self.record["recipe_digest"] = new, recipe.digest()
            self.save_record()

    def undo_changes(self) -> None:
        """Put the record back as open() found it, if this process recorded a change of recipe or
        data: its attempt never trained (the checkpoint does not load into the changed model, or
        none verifies), so the run's recipe is still the one its checkpoints were trained with."""
        changes = len(self.record.get("recipe_changes", []))
        if self.found is not None and changes > len(self.found.get("recipe_changes", [])):
            self.record = copy.deepcopy(self.found)
            self.save_record()

    def has_checkpoints(self) -> bool:
        """Whether any checkpoint was ever committed here (damaged ones included)."""
        if not self.ckpt_dir.is_dir():
            return False
        return bool(committed_in(self.ckpt_dir)) or any(self.ckpt_dir.glob("corrupt-*"))

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
        records = read_metrics(self.metrics_path)  # a line torn by a kill mid-write is dropped
        kept = [r for r in records if r["step"] <= step]
        lost = [r for r in records if r["step"] > step]
        if lost:
            append_durable(self.path / "metrics.lost.jsonl", "".join(json.dumps(r) + "\n" for r in lost))
        if self.metrics_path.exists():
            write_durable(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        return len(lost)

    def announce_serving(self, info: dict[str, Any]) -> Path:
        """Write OUT/serve.json (co-serving's address and token), readable by this user alone;
        nothing durable: it lasts while the process serves."""
        path = self.path / SERVE_FILE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(json.dumps(info))
        os.replace(tmp, path)
        return path

    def serving_ended(self) -> None:
        """Remove OUT/serve.json: the process serves no more."""
        (self.path / SERVE_FILE).unlink(missing_ok=True)

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
            old = self.path / f".del-final.{os.getpid()}.{time.time_ns()}"  # a PID comes again (PID 1)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.path)
        for old in self.path.glob(".del-final.*"):  # this one, and any a killed process left
            shutil.rmtree(old)
        return final


NUMBER = (int, float)
METRIC_SHAPE: Shape = {"step": (int,), "attempt": (int,), "tokens": (int,), "loss": (*NUMBER, type(None)),
                       "step_seconds": NUMBER, "data_wait_seconds": NUMBER}  # what every metrics line has


def read_metrics(path: Path, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The lines of metrics.jsonl or metrics.lost.jsonl at `path`, each with the fields the
    report and charts read (a line without them is named, as corruption is)."""
    return read_jsonl(path, notes, METRIC_SHAPE)


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
