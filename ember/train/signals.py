"""Stop on request: SIGINT, SIGTERM and SIGUSR1 finish the current optimizer step, checkpoint and
exit 75; a second SIGINT exits at once."""

from __future__ import annotations

import os
import signal
import sys


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
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
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            # Second Ctrl-C: leave now. Committed checkpoints are safe by construction.
            sys.stderr.write("\nsecond SIGINT: exiting without a checkpoint\n")
            os._exit(130)
        if self.signal_name is None:
            self.signal_name = name
            sys.stderr.write(f"\n{name}: finishing this step, then checkpointing and exiting "
                             f"(Ctrl-C again to exit at once)\n")
