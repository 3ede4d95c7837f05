"""The runs an engine can be asked for by name, without torch (the service reads this too).

A model name is a run folder's name (`runs/a` -> `a`): each registered folder that holds a
run.json is one run, and each folder of such folders holds several.
"""

from __future__ import annotations

import json
from pathlib import Path

from ember.runfolder import RUN_FILE

BASE = "base"


def find_runs(roots: list[Path]) -> dict[str, Path]:
    """Model name -> run folder, for every run under `roots` now."""
    found: dict[str, Path] = {}
    for root in roots:
        if (root / RUN_FILE).is_file():
            found.setdefault(root.name, root)
        elif root.is_dir():
            for p in sorted(root.iterdir()):
                if p.name != BASE and (p / RUN_FILE).is_file():
                    found.setdefault(p.name, p)
    return found


def lora_run(roots: list[Path], name: str) -> Path | None:
    """The run under `roots` named `name`, if it trained a LoRA adapter (which a base model would
    answer for wrongly); only its own record is read."""
    path = find_runs(roots).get(name)
    if path is None:
        return None
    try:
        kind = json.loads((path / RUN_FILE).read_text()).get("recipe", {}).get("method", {}).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return path if kind == "lora" else None
