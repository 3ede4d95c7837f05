"""Stop on request: SIGINT, SIGTERM, SIGUSR1 and SIGHUP (a terminal or SSH session that went
away) stop between two micro-batches (the step in progress undone: ember.train.between) or at
the step's end, checkpoint and exit 75; a second SIGINT exits at once.
Installed before the job is prepared (the model loaded, the data tokenized), so a signal during
start-up (a scheduler's warning, a preemption) stops the run before its first step instead of
killing it. A rank of a distributed run is `quiet`: the ranks agree at the step boundary whether
to stop, and say so then; a SIGTERM may also be the agent tearing the group down after another
rank died, when no checkpoint follows.
Once the loop has ended (`ended`), a stop signal changes nothing: the run's outcome is decided
and its files are being closed; the handlers stay until the process exits (an `ember run`), or
until whoever installed them restores them, so a late one (a scheduler's warning landing as a
completed run exits) cannot kill a finished run with the signal's default action."""

from __future__ import annotations

import os
import signal

from ember.events import Events

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class StopRequest:
    def __init__(self, events: Events, quiet: bool = False) -> None:
        self.events, self.quiet = events, quiet
        self.signal_name: str | None = None
        self.ended = False  # the loop is over: a signal now is noted, and nothing stops
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.ended:
            return
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            # Second Ctrl-C: leave now. Committed checkpoints are safe by construction.
            self.events.warn("second SIGINT: exiting without a checkpoint")
            os._exit(130)
        if self.signal_name is None:
            self.signal_name = name
            if self.quiet:
                return
            self.events.info(f"{name}: stopping after the micro-batch in progress, with a checkpoint "
                             f"(Ctrl-C again to exit at once)", signal=name)
