"""How the CLI shows library events (ember/events.py): warnings in yellow, stages and notices as
lines, checkpoint commits, and training progress as a rich bar on a terminal, or, in logs and
pipes, a line at the first step, every tenth of the run or 30 seconds, and the last, with an ETA.
Every message is printed without markup, so brackets in user paths stay as typed.

The console may go away while the work goes on: a pipe whose reader ended (`| head`, a `tee` that
was killed: EPIPE) or a terminal that hung up (an SSH session that dropped: EIO). The CLI writes
through `Surviving` streams: the first write that fails so points that stream's descriptor at the
file `keep_output_in()` named (`ember run`: the run folder's console.log; else /dev/null), with a
line saying when and why, and everything after, ember's and any library's, goes there. Nothing
is raised into the work, which never learns of it.
"""

from __future__ import annotations

import datetime
import errno
import os
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ember.events import Event, Events
from ember.paths import open_own_file

PLAIN_EVERY_SECONDS = 30.0
GONE = (errno.EPIPE, errno.EIO, errno.ENXIO)  # its reader or its terminal is no more

_fallback: list[Path] = []  # where output goes once the console is gone
_lost: dict[int, str] = {}  # descriptor -> why it went away
_losing = threading.Lock()  # rich's refresh thread writes too


def keep_output_in(path: Path) -> None:
    """Where this process's output goes if its console goes away (see the module docstring)."""
    _fallback[:] = [path]


class Surviving:
    """sys.stdout or sys.stderr (by name, as it is at each write) for a rich Console: a write the
    console's end refuses (GONE) moves the stream to the fallback instead of raising."""

    def __init__(self, name: str):
        self.name = name

    @property
    def stream(self):
        return getattr(sys, self.name)

    def write(self, text: str) -> int:
        try:
            fd = self.fileno()
        except (OSError, ValueError):  # no descriptor: an in-memory stream (a test's capture)
            return self.stream.write(text)
        self.flush()  # what others wrote through the stream first, in order
        data = text.encode(self.encoding, errors="replace")
        while data:  # straight to the descriptor: a failed write leaves no doubt about what was lost
            try:
                data = data[os.write(fd, data):]
            except OSError as e:
                if e.errno not in GONE:
                    raise
                console_lost(fd, e)  # and again, to where it leads now
        return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            if e.errno not in GONE:
                raise
            console_lost(self.stream.fileno(), e)
            self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return self.stream.encoding


def console_lost(fd: int, error: OSError) -> None:
    """Point descriptor `fd` (1 or 2) at the fallback file, appending, with a line saying why;
    at /dev/null if there is none or it cannot be opened (or is a symbolic link)."""
    with _losing:
        if fd in _lost:
            return
        _lost[fd] = error.strerror or str(error)
        # never through a link (symbolic or hard): what one left in the run folder names would get the output
        try:
            target = open_own_file(_fallback[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except (IndexError, OSError):
            target = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(target, fd)  # the stream keeps its descriptor; where it leads changes
        os.close(target)
        what = {1: "standard output", 2: "standard error"}.get(fd, f"descriptor {fd}")
        os.write(fd, f"--- {datetime.datetime.now():%Y-%m-%d %H:%M:%S} (PID {os.getpid()}): {what} went "
                     f"away ({_lost[fd]}); its output continues here\n".encode())


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
        if self.bar is not None and not self.console.is_terminal:  # the terminal went away
            self.close()
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
    return Events(Renderer(Console(file=Surviving("stderr"), soft_wrap=True), stamped))


def console(stderr: bool = False) -> Console:
    """A rich Console on standard output (or error) that survives its reader's end."""
    return Console(file=Surviving("stderr" if stderr else "stdout"), soft_wrap=True)
