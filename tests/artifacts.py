"""Artifacts built once and shared by every test worker: the uninterrupted baselines of the crash
and resume tests, finished runs for the commands that only read one, converted models.

Each is keyed by its inputs and by the content of the code that builds it (ember/, the test
harness, the example data, the versions of torch and transformers), so a cached artifact is the
one this code would build; it is built under a file lock, by the first worker that asks, into
`.test-cache/` (or $EMBER_TEST_CACHE), and is read-only for the tests that use it: a test that
changes one works on `copy_of` it. A build killed half-way leaves no marker and is redone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from functools import lru_cache
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DONE = ".built"


def cache_root() -> Path:
    return Path(os.environ.get("EMBER_TEST_CACHE") or ROOT / ".test-cache")


@lru_cache(maxsize=1)
def code_digest() -> str:
    """What every artifact depends on besides its own inputs."""
    h = hashlib.sha256()
    files = sorted([*ROOT.glob("ember/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("examples/data/*")])
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("torch", "transformers", "peft", "safetensors", "tokenizers"):
        h.update(f"{dist}={metadata.version(dist)}\0".encode())
    return h.hexdigest()[:16]


def shared(name: str, inputs: object, build: Callable[[Path], None]) -> Path:
    """The folder `build(folder)` fills for these inputs, built once across workers and runs."""
    digest = hashlib.sha256(json.dumps([name, inputs], sort_keys=True, default=str).encode()).hexdigest()[:16]
    base = cache_root() / code_digest()
    folder = base / f"{name}-{digest}"
    if (folder / DONE).exists():
        return folder
    base.mkdir(parents=True, exist_ok=True)
    _forget_other_code(base)
    with open(base / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building it: wait for it
        if not (folder / DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that was killed half-way
            folder.mkdir()
            build(folder)  # in place: run folders and ledgers record their own paths
            (folder / DONE).touch()
    return folder


def copy_of(artifact: Path, dest: Path) -> Path:
    """A private copy of an artifact (or of a folder inside one) for a test that changes it."""
    shutil.copytree(artifact, dest, symlinks=True, ignore=shutil.ignore_patterns(DONE))
    return dest


def _forget_other_code(base: Path) -> None:
    """Artifacts of other versions of the code are not used again: remove those an hour old
    (a younger one may belong to a run still going on, started before an edit)."""
    with open(base.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for other in base.parent.iterdir():
            if other.is_dir() and other != base and time.time() - other.stat().st_mtime > 3600:
                shutil.rmtree(other, ignore_errors=True)
