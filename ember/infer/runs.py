"""The runs an engine can be asked for by name, without torch (the service reads this too).

A model name is a run folder's name (`runs/a` -> `a`): each registered folder that holds a
run.json is one run, and each folder of such folders holds several.
"""

from __future__ import annotations

from pathlib import Path

from ember.errors import EmberError
from ember.runfolder import is_run_folder, read_record

BASE = "base"


def find_runs(roots: list[Path]) -> dict[str, Path]:
    """Model name -> run folder, for every run under `roots` now."""
    found: dict[str, Path] = {}
    for root in roots:
        if is_run_folder(root):
            found.setdefault(root.name, root)
        elif root.is_dir():
            for p in sorted(root.iterdir()):
                if p.name != BASE and is_run_folder(p):
                    found.setdefault(p.name, p)
    return found


def lora_run(roots: list[Path], name: str) -> Path | None:
    """The run under `roots` named `name`, if it trained a LoRA adapter (which a base model would
    answer for wrongly); only its own record is read."""
    path = find_runs(roots).get(name)
    if path is None:
        return None
    try:
        kind = read_record(path).get("recipe", {}).get("method", {}).get("kind")
    except (EmberError, AttributeError):
        return None
    return path if kind == "lora" else None
