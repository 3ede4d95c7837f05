"""Soft pause: how the service asks a training process to stop at its next micro-batch boundary while
keeping the process (and how the process answers). No torch here: the service uses it too.

Two small files in a folder the service keeps per job ($EMBER_HOME/serve/control/JOB, named to
the job's process by EMBER_CONTROL; never the run folder, which the job itself creates), each
replaced atomically (write, rename):

    control.json   written by the service: {"seq": n, "pause": null | "inference" | "owner" | "user",
                   "asked": t0, "until": t}; "asked": when request n was first written (a renewal
                   keeps it); "until" (a pause for inference only) ends a lease the service
                   renews while requests run: past it the process goes on by itself
    control.ack    written by the training process: {"seq": n, "state": "paused" | "running",
                   "pid": p, "time": t, "last": null | {"n", "reason", "asked", "at"}} once it
                   has acted on request n; "last" is the newest pause this process took (its
                   count n, why, when it was asked and when training stopped), carried by every
                   later acknowledgement so the service sees each pause even if it was short

The training loop calls `PausePoint.check()` between micro-batches (one process; a distributed
run's ranks stop at step boundaries together): one stat() of control.json (a few microseconds)
when nothing changed. When asked to pause it releases its allocator's cached memory (on an
accelerator, after the work queued there finished), acknowledges, and waits, looking at the file
every POLL_SECONDS, until the pause is lifted or a stop signal arrives; then it acknowledges
again and returns the pause for the ledger, with the instant it was asked. So a pause takes
effect within one micro-batch of the request (plus one poll), the step resumes where it stopped
(its gradients wait in memory: nothing it computes changes), and the paused time is accounted in
its own goodput bucket (ember.ledger.goodput). The pause latency, `at - asked` of each pause, is
the same figure in the job's ledger event and in the service's `/api/stats` (ember.sched.inference).

Neither file needs to survive a power cut: after any restart the service writes the request
again and a fresh training process starts unpaused. A pause for inference is a lease: if the
service dies during one, nobody lifts it, so the process lifts it itself once "until" passes
(`[inference] pause_lease_seconds` after the service last renewed it), and a service that starts
again settles whatever it finds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV = "EMBER_CONTROL"
CONTROL = "control.json"
ACK = "control.ack"
POLL_SECONDS = 0.01
REASONS = ("inference", "owner", "user")
EVENT_KIND = {"inference": "pause_inference", "owner": "pause", "user": "pause"}


@dataclass(frozen=True)
class Pause:
    reason: str        # one of REASONS
    start: float       # training stopped (its device work done)
    end: float
    asked: float       # the service first wrote the request it acted on

    @property
    def latency(self) -> float:
        """Seconds from the request to training stopped."""
        return max(0.0, self.start - self.asked)

    @property
    def kind(self) -> str:
        """The ledger event kind: its goodput bucket (paused_for_inference or paused)."""
        return EVENT_KIND[self.reason]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic; no fsync: see the module docstring


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def request(run: Path, pause: str | None, lease: float | None = None) -> int:
    """Ask the training process in `run` to pause (for `pause`, a reason) or go on (None);
    returns the request's number, which its acknowledgement will carry. With `lease` (seconds),
    the pause lapses by itself that long from now unless asked again: asking again for the same
    pause renews it (same number) once half of it has passed."""
    if pause is not None and pause not in REASONS:
        raise ValueError(f"pause reason {pause!r}: one of {REASONS}")
    current = _read_json(run / CONTROL) or {}
    now = time.time()
    asked = now
    if current.get("pause") == pause and "seq" in current:
        until = current.get("until")
        if lease is None or (isinstance(until, (int, float)) and until - now > lease / 2):
            return int(current["seq"])
        seq = int(current["seq"])  # a renewal: the same request, for longer, asked when it first was
        asked = current.get("asked", now)
    else:
        seq = int(current.get("seq", 0)) + 1
    _write_json(run / CONTROL, {"seq": seq, "pause": pause, "time": now, "asked": asked,
                                **({"until": now + lease} if lease is not None and pause is not None else {})})
    return seq


def requested(run: Path) -> str | None:
    """The pause now asked of the run, or None."""
    return (_read_json(run / CONTROL) or {}).get("pause")


def acknowledged(run: Path) -> dict | None:
    """The training process's last acknowledgement, or None."""
    return _read_json(run / ACK)


def clear(run: Path) -> None:
    """Forget both files (a job that starts again starts unpaused)."""
    for name in (CONTROL, ACK):
        try:
            (run / name).unlink()
        except FileNotFoundError:
            pass


def from_environment() -> Path | None:
    """The control folder the service named for this process, or None (not run by a service)."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


class PausePoint:
    """The training loop's side: `check()` between micro-batches; a no-op without a control folder."""

    def __init__(self, folder: Path | None, stopping: Callable[[], bool], release: Callable[[], None]):
        self.path = folder / CONTROL if folder is not None else None
        self.ack = folder / ACK if folder is not None else None
        self.stopping, self.release = stopping, release
        self._seen: int | None = None  # mtime_ns of the control file last read
        self.last: dict | None = None  # the newest pause taken, carried by every acknowledgement

    def _changed(self) -> dict | None:
        if self.path is None:
            return None
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime == self._seen:
            return None
        self._seen = mtime
        return _read_json(self.path)

    def check(self) -> Pause | None:
        """Pause here if asked; return the pause once it is lifted (None if there was none)."""
        ctl = self._changed()
        if not ctl:
            return None
        if not ctl.get("pause"):
            self._acknowledge(ctl, "running")
            return None
        if _lapsed(ctl):  # a lease its service stopped renewing
            return None
        self.release()  # waits for the device's queued work, then its cached memory goes back
        reason, start = str(ctl["pause"]), time.time()
        asked = float(ctl.get("asked", ctl.get("time", start)))
        self.last = {"n": (self.last or {}).get("n", 0) + 1, "reason": reason, "asked": asked, "at": start}
        self._acknowledge(ctl, "paused")
        while not self.stopping():
            time.sleep(POLL_SECONDS)
            new = self._changed()
            if new is None:
                if _lapsed(ctl):  # the service died, or stopped renewing: go on by ourselves
                    break
                continue
            if not new.get("pause") or _lapsed(new):
                ctl = new
                break
            if new.get("seq") != ctl.get("seq") or new.get("pause") != ctl.get("pause"):
                self._acknowledge(new, "paused")  # a new request; a renewal needs no answer
            ctl = new
            reason = str(ctl["pause"]) if ctl["pause"] in REASONS else reason
        self._acknowledge(ctl, "running")
        return Pause(reason if reason in REASONS else "user", start, time.time(), asked)

    def _acknowledge(self, ctl: dict, state: str) -> None:
        _write_json(self.ack, {"seq": ctl.get("seq", 0), "state": state, "pid": os.getpid(),
                               "time": time.time(), "last": self.last})


def _lapsed(ctl: dict) -> bool:
    """Whether a leased pause's lease has run out."""
    until = ctl.get("until")
    return isinstance(until, (int, float)) and time.time() > until
