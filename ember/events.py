"""Progress and warnings from below the commands, through one small interface.

Library code never prints: it reports what happens as `Event`s to an `Events` object, whose sink
decides what to do with them. The CLI renders them with rich (ember/cli/render.py); the service
will record them; tests collect them in a list. With no sink, events go nowhere.

    info        something worth saying once ("resuming from step-000000040")
    warning     something the user should look at; the work goes on
    stage       a named part of the work begins (converting the model, tokenizing, first step)
    progress    an optimizer step finished: step, total, loss, tokens/s, ETA
    checkpoint  a checkpoint was committed and is durable
    tokenizing  where a tokenization stands: records, MB of input, MB/s, ETA (every few seconds)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KINDS = ("info", "warning", "stage", "progress", "checkpoint", "tokenizing")


@dataclass(frozen=True)
class Event:
    kind: str                     # one of KINDS
    message: str                  # one line for a person
    data: dict[str, Any] = field(default_factory=dict)  # the figures behind it, for machines
    time: float = field(default_factory=time.time)


class Events:
    """Where library code reports; `sink(event)` renders, records or drops each one."""

    def __init__(self, sink: Callable[[Event], None] | None = None):
        self.sink = sink

    def emit(self, kind: str, message: str, **data: Any) -> None:
        if self.sink is not None:
            self.sink(Event(kind, message, data))

    def info(self, message: str, **data: Any) -> None:
        self.emit("info", message, **data)

    def warn(self, message: str, **data: Any) -> None:
        self.emit("warning", message, **data)

    def stage(self, message: str, **data: Any) -> None:
        self.emit("stage", message, **data)


def collect() -> tuple[Events, list[Event]]:
    """Events that land in a list (tests, and experiments that report afterwards)."""
    seen: list[Event] = []
    return Events(seen.append), seen
