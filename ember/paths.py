"""Where ember keeps state outside a run folder, and content hashes of large files."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from ember.durable import sha256_file
from ember.errors import BadInput, Refused

# A job's name (local or remote) names its default run folder and its staging folder: one path
# segment, never '.', '..' or anything with a separator, short enough to show.
NAME_GRAMMAR = "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME = re.compile(NAME_GRAMMAR)


def ember_home() -> Path:
    """$EMBER_HOME, default ~/.ember: converted models, token caches, the hash cache."""
    return Path(os.environ.get("EMBER_HOME") or Path.home() / ".ember")


def check_name(name: str, what: str = "job name") -> str:
    """`name` when it follows NAME_GRAMMAR; otherwise a BadInput that shows the grammar."""
    if not _NAME.fullmatch(name):
        shown = name if len(name) <= 80 else f"{name[:60]}... ({len(name)} characters)"
        raise BadInput(f"{what} {shown!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                       f"letter or digit ({NAME_GRAMMAR}); it names the job's run folder")
    return name


def name_from(stem: str, suffix: str) -> str:
    """A valid name made of a file's stem (other characters become '-') and a unique suffix."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("._-")[: 63 - len(suffix)].rstrip("._-") or "job"
    return check_name(f"{base}-{suffix}")


def default_run_folder(name: str) -> Path:
    """$EMBER_HOME/runs/NAME, resolved; refused when it resolves elsewhere (a link put there)."""
    root = (ember_home() / "runs").resolve()
    folder = (root / check_name(name)).resolve()
    if folder.parent != root:
        raise Refused(f"run folder {root / name} resolves to {folder}, outside {root}; remove "
                      f"the link or give the job an --out")
    return folder


def scratch_dir(prefix: str) -> Path:
    """A new private folder under $EMBER_HOME/scratch (on the same disk as the runs' caches)."""
    root = ember_home() / "scratch"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def cached_sha256(path: Path) -> str:
    """SHA-256 of a file, remembered by (path, size, mtime) so large model files hash once."""
    path = path.resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    cache_file = ember_home() / "cache" / "sha256.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = sha256_file(path)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)  # a cache: atomic, but needs no fsync
    return cache[key]
