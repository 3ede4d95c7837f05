"""Where a tokenization stands, said as `tokenizing` events (ember.events): the records and
bytes of input done, MB/s and the time left, at most one event every PROGRESS_SECONDS, so a
log gets a line every few seconds however fast the shards finish."""

from __future__ import annotations

import time

from ember.events import Events

PROGRESS_SECONDS = 5.0  # at most one progress event this often


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class Progress:
    """The progress of one tokenization of `total` bytes of input (a quick one says nothing)."""

    def __init__(self, events: Events, total: int):
        self.events, self.total = events, total
        self.t0 = self.last = time.monotonic()
        self.records = self.done = self.said = 0

    def shard(self, records: int, nbytes: int) -> None:
        """Count a finished shard's records and bytes; say where the work stands if it is time to."""
        self.records, self.done = self.records + records, self.done + nbytes
        now = time.monotonic()
        if now - self.last < PROGRESS_SECONDS:
            return
        self.last, self.said = now, self.said + 1
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0.0
        self.events.emit("tokenizing", f"tokenizing: {self.records:,} records, {self.done / 1e6:,.1f} of "
                         f"{self.total / 1e6:,.1f} MB, {rate / 1e6:,.2f} MB/s, ETA {_minutes(eta)}",
                         records=self.records, bytes=self.done, total_bytes=self.total,
                         mb_per_second=rate / 1e6, eta_seconds=eta)

    def finish(self, procs: int) -> None:
        """The totals, once, after a tokenization that said where it stood."""
        if self.said:
            seconds = time.monotonic() - self.t0
            self.events.info(f"tokenized {self.records:,} records ({self.done / 1e6:,.1f} MB) in "
                             f"{_minutes(seconds)} with {procs} process(es), {self.done / 1e6 / seconds:,.2f} MB/s",
                             records=self.records, bytes=self.done, seconds=seconds)
