"""Progress display: a rich progress bar on a terminal, a plain line every tenth of the run
otherwise (logs, CI, tests)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)


class ProgressDisplay:
    def __init__(self, total: int, done: int, console: Console):
        self.total, self.console = total, console
        self.every = max(1, total // 10)
        self.bar = None
        if console.is_terminal:
            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("loss {task.fields[loss]}"),
                                TextColumn("{task.fields[tok_s]} tok/s"), TimeRemainingColumn(),
                                console=console, transient=False)
            self.task = self.bar.add_task("train", total=total, completed=done, loss="-", tok_s="-")
            self.bar.start()

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, loss=f"{loss:.4f}",
                            tok_s=f"{tokens_per_second:,.0f}")
        elif step % self.every == 0 or step == self.total:
            self.console.print(f"step {step}/{self.total}  loss {loss:.4f}  "
                               f"{tokens_per_second:,.0f} tok/s", highlight=False)

    def note(self, message: str) -> None:
        self.console.print(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
