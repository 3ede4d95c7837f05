"""The owner's rules as a running service applies them: owner.toml read again when its bytes
change (ember.sched.owner_rules.merge: restart keys wait for a restart; a file that does not
validate changes nothing), the machine observed at most every OBSERVE_SECONDS
(ember.sched.observe), and the holds the rules put on training now (ember.sched.owner_rules.holds).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ember.errors import BadInput, EmberError, Refused
from ember.events import Events
from ember.sched import owner_rules as owner
from ember.sched.observe import Observer

OBSERVE_SECONDS = 0.5


def rules_bytes() -> bytes | None:
    """owner.toml's bytes (None: absent): compared, not its mtime, which two quick edits can share."""
    try:
        return owner.owner_file().read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return repr(e).encode()  # unreadable: load_rules says why, once, until that changes


class OwnerWatch:
    """The rules in force, their status (for `ember queue` and the dashboard), the last
    observation of the machine and the holds it gave."""

    def __init__(self, rules: owner.OwnerRules, events: Events):
        self.rules, self.events = rules, events
        self.text = rules_bytes()
        self.status = owner.RulesStatus(str(owner.owner_file()), time.time())
        self.observer = Observer()
        self.observation: owner.Observation | None = None
        self.observed_at = 0.0
        self.holds: list[owner.Hold] = []

    def observe(self, ours: Callable[[], set[int]], force: bool = False) -> bool:
        """Read owner.toml if it changed and the machine, unless done within OBSERVE_SECONDS;
        `ours()`: the PIDs of the service and its jobs (their load and programs do not count).
        Whether new rules took effect."""
        now = time.monotonic()
        if not force and now - self.observed_at < OBSERVE_SECONDS:
            return False
        changed = self.reload()
        self.observation = self.observer.observe(self.rules, ours())
        self.holds = owner.holds(self.rules, self.observation, dt.datetime.now())
        self.observed_at = now
        return changed

    def reload(self) -> bool:
        """owner.toml edited: its live keys hold from now; a change to a key read only at start
        (owner.RESTART_KEYS) waits for a restart; a file that does not validate changes nothing.
        Both are said in the log and kept in `status` (ember queue, the dashboard). Whether new
        rules took effect."""
        text = rules_bytes()
        if text == self.text:
            return False
        self.text, path = text, owner.owner_file()
        try:
            new = owner.load_rules(path)
        except (EmberError, OSError) as e:
            self.status.error = str(e)
            self.events.warn(f"{e}; the rules in force stay as they were until the file is fixed")
            return False
        self.rules, restart = owner.merge(self.rules, new)
        self.status = owner.RulesStatus(str(path), time.time(), None, restart)
        later = f"; {', '.join(c['key'] for c in restart)}: changed, but read only at start" if restart else ""
        self.events.info(f"owner rules read from {path}: in force now{later}" if text is not None
                         else f"{path} is gone: the default rules are in force now{later}")
        for note in self.status.notes():
            self.events.warn(note)
        return True

    def report(self) -> dict:
        """owner.toml as the service applies it: the error or the changes waiting for a restart,
        said in words (notes), and the rules in force."""
        return {**asdict(self.status), "notes": self.status.notes(), "rules": asdict(self.rules)}

    def allowed(self, path: str, what: str) -> Path:
        """`path` resolved, if it lies under a folder the owner allowed ([service] allowed)."""
        try:
            p = Path(path).expanduser().resolve()
            p.exists()  # a name or path too long for the file system says so here, not later as a 500
        except (ValueError, RuntimeError, OSError) as e:  # a NUL byte; a loop of links; ENAMETOOLONG
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise BadInput(f"{what} {path[:200]!r}{'...' if len(path) > 200 else ''}: not a usable path "
                           f"({reason})") from None
        roots = [Path(a).expanduser().resolve() for a in self.rules.service.allowed]
        if not any(p.is_relative_to(r) for r in roots):
            raise Refused(f"{what} {p} is outside the folders the owner allowed "
                          f"({', '.join(map(str, roots))}; [service] allowed in owner.toml)")
        return p
