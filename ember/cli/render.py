"""How the CLI shows library events (ember/events.py): warnings in yellow, stages and notices as
lines, checkpoint commits, and training progress as a rich bar on a terminal, or, in logs and
pipes, a line at the first step, every tenth of the run or 30 seconds, and the last, with an ETA.
Every message is printed without markup, so brackets in user paths stay as typed."""

from __future__ import annotations

import datetime
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ember.events import Event, Events

PLAIN_EVERY_SECONDS = 30.0


def duration(seconds: float) -> str:
    """3h 05m, 4m 10s, 12s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


class Renderer:
    def __init__(self, console: Console, stamped: bool = False):
        self.console = console
        self.stamped = stamped  # a long-running service's lines: each starts with the local time
        self.bar: Progress | None = None
        self.last_line = 0.0

    def __call__(self, e: Event) -> None:
        if e.kind == "progress":
            self._progress(e)
            return
        out = self.bar.console if self.bar is not None else self.console
        if self.stamped:
            out.print(datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S "), end="", markup=False, highlight=False)
        if e.kind == "warning":
            out.print("[yellow]warning:[/yellow] ", end="", highlight=False)
            out.print(e.message, markup=False, highlight=False)
        else:
            out.print(e.message, markup=False, highlight=False)

    def _progress(self, e: Event) -> None:
        d = e.data
        # A step with no learned token has no loss and no tokens/s (the guard warned about it).
        loss = "- (no learned token)" if d.get("tokens") == 0 else f"{d['loss']:.4f}"
        tok_s = "-" if d["tokens_per_second"] is None else f"{d['tokens_per_second']:,.0f}"
        if self.console.is_terminal:
            if self.bar is None:
                self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                    TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tok_s]} tok/s"),
                                    TimeRemainingColumn(), console=self.console, transient=False)
                self.task = self.bar.add_task("train", total=d["total"], completed=d["step"], loss="-", tok_s="-")
                self.bar.start()
            self.bar.update(self.task, completed=d["step"], loss=loss, tok_s=tok_s)
            if d["step"] >= d["total"]:
                self.close()
            return
        every = max(1, d["total"] // 10)
        now = time.monotonic()
        if (not self.last_line or d["step"] % every == 0 or d["step"] == d["total"]
                or now - self.last_line >= PLAIN_EVERY_SECONDS):
            self.last_line = now
            self.console.print(f"step {d['step']}/{d['total']}  loss {loss}  "
                               f"{tok_s} tok/s  {d['seconds']:.2f} s/step  "
                               f"ETA {duration(d['eta_seconds'])}", highlight=False, markup=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def stderr_events(stamped: bool = False) -> Events:
    """Events rendered on standard error (progress and notices; results go to standard output);
    `stamped`: each line starts with the local date and time (the service's and the dashboard's log)."""
    return Events(Renderer(Console(stderr=True, soft_wrap=True), stamped))
