"""`ember yield`: the owner holds all training, for some seconds or until released. The hold is
written to the service's folder (fsynced) before it takes effect, so before `ember yield` is
answered, and a service that starts again finds it in force; a file it cannot read holds too
(the owner asked for the machine) until `ember yield --release`."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ember.durable import fsync_dir, write_durable
from ember.events import Events
from ember.sched.owner_rules import Hold

YIELD_FILE = "yield.json"
MAX_SECONDS = 7 * 86400  # the longest hold one `ember yield --for` asks (longer: until released)


class YieldHold:
    """The yield in force: `until` is when it ends (seconds since the epoch; math.inf: until
    released; None: no yield)."""

    def __init__(self, folder: Path, events: Events):
        self.dir = folder
        self.path = folder / YIELD_FILE
        self.until: float | None = self._load(events)

    def _load(self, events: Events) -> float | None:
        try:
            until = json.loads(self.path.read_text())["until"]
            return math.inf if until is None else float(until)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:  # the owner asked for the machine: hold
            events.warn(f"{self.path}: unreadable ({e}); all training is held until `ember yield --release`")
            return math.inf

    def set(self, until: float | None) -> None:
        """Hold until `until` (math.inf: until released; None: release). Durable before it holds."""
        if until is None:
            if self.path.exists():
                self.path.unlink()
                fsync_dir(self.dir)
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_durable(self.path, json.dumps({"until": None if math.isinf(until) else until}))
        self.until = until

    def hold(self, now: float) -> Hold | None:
        """The hard hold on every job at `now`, saying for how long; None (and released) once it ended."""
        if self.until is None:
            return None
        if now >= self.until:
            self.set(None)
            return None
        left = "until released" if math.isinf(self.until) else f"for {self.until - now:.0f} s more"
        return Hold("yield", "hard", None, False, f"ember yield, {left}")

    def shown(self) -> Hold | None:
        """The hold as `ember queue` shows it on each job, without the time left."""
        return None if self.until is None else Hold("yield", "hard", None, False, "ember yield")
