"""What a run was launched with, decided once by whoever launches it and read by every process
under it: the resolved recipe, the memory plan, the service's job and devices, the limits.

    ember serve ─┐ (admits a job: the recipe as it was then, the plan it admitted on)
    ember run ───┴─> OUT/launch.json ──$EMBER_LAUNCH_SPEC──> supervisor ──> training child ──> ranks

The launcher writes the spec (ember.runfolder.write_launch_spec) and names its file in
$EMBER_LAUNCH_SPEC for its children; a process that finds the variable pointing at the spec of its
own run folder takes the recipe and the plan from it: the recipe file is read once per run (an
edit after `ember submit` does not reach the job), and memory is planned once. A process started
by hand (no variable, or the spec of another folder) is a launcher itself. Torch-free.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ember.durable import write_durable
from ember.recipe import Recipe, build_recipe

ENV = "EMBER_LAUNCH_SPEC"
VERSION = 1


@dataclass(frozen=True)
class PlannedMemory:
    """The memory plan the launcher checked the run against (ember.plan.planner)."""
    peak: int          # bytes per device, with the plan's margin
    device: str        # the device it was planned for
    free: int          # bytes free on it when planned
    fits: bool


@dataclass(frozen=True)
class LaunchSpec:
    out: str                              # the run folder, absolute
    recipe: dict[str, dict[str, Any]]     # resolved (data paths absolute), as Recipe.to_dict()
    recipe_digest: str
    recipe_file: str                      # where it was read from, for the run's record
    overrides: list[str] = field(default_factory=list)
    plan: PlannedMemory | None = None     # None: no estimate for this architecture
    job: int | None = None                # the service's job id (ember serve), else None
    devices: list[int] | None = None      # the devices the service gave the job
    device_names: list[str] | None = None
    restarts: int | None = None           # the supervisor's crash budget
    launched: float = 0.0
    launcher: int = 0                     # the PID that wrote it
    version: int = VERSION

    @classmethod
    def create(cls, out: Path, recipe: Recipe, recipe_file: Path, overrides: list[str],
               plan: PlannedMemory | None, **extra: Any) -> LaunchSpec:
        """A spec for a launch now, from this process."""
        return cls(str(out.resolve()), recipe.to_dict(), recipe.digest(), str(recipe_file),
                   list(overrides), plan, launched=time.time(), launcher=os.getpid(), **extra)

    def build_recipe(self) -> Recipe:
        """The recipe it carries, validated again (cheap, no file read)."""
        return build_recipe(self.recipe, f"{self.out}/launch.json")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> Path:
        """Write the spec to `path` durably (the launcher's, before any process reads it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durable(path, json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchSpec:
        plan = data.get("plan")
        return cls(**{**data, "plan": PlannedMemory(**plan) if plan else None})

    def is_for(self, out: Path) -> bool:
        """Whether this spec is the launch of run folder `out`."""
        return Path(self.out) == out.resolve()
