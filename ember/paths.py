"""Where ember keeps state outside a run folder, and content hashes of large files."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ember.durable import sha256_file


def ember_home() -> Path:
    """$EMBER_HOME, default ~/.ember: converted models, token caches, the hash cache."""
    return Path(os.environ.get("EMBER_HOME") or Path.home() / ".ember")


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
