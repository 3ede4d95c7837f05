"""Where a remote backend's client (Slurm's sbatch, ...) runs: this machine, or an SSH host.
Commands run there, and folders move there and back as tar streams (`tar c | ssh HOST tar x`), so
the local controller and an SSH host take the same path, the SSH one with `ssh HOST` in front of
the remote side."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ember.errors import EmberError

TIMEOUT = 120.0


class Shell:
    def __init__(self, host: str = "", ssh_options: list[str] | None = None):
        self.host = host  # "": this machine
        self.ssh_options = list(ssh_options or [])  # e.g. ["-p", "2222", "-i", "~/.ssh/cluster"]

    def where(self) -> str:
        return self.host or "this machine"

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` as run where the backend's client is."""
        if not self.host:
            return list(argv)
        return ["ssh", "-o", "BatchMode=yes", *self.ssh_options, self.host, "--", shlex.join(argv)]

    def run(self, argv: list[str], check: bool = True, timeout: float = TIMEOUT,
            stdin: bytes | None = None) -> subprocess.CompletedProcess:
        """Run a command there; with `check`, a non-zero exit is an EmberError quoting its stderr."""
        try:
            done = subprocess.run(self.argv(argv), input=stdin, capture_output=True, timeout=timeout)
        except FileNotFoundError as e:
            raise EmberError(f"{argv[0]}: not found on {self.where()} ({e.strerror}); is the backend's client "
                             f"installed and on PATH?") from None
        except subprocess.TimeoutExpired:
            raise EmberError(f"`{shlex.join(argv)}` on {self.where()} did not finish within {timeout:.0f} s") from None
        if check and done.returncode != 0:
            raise EmberError(f"`{shlex.join(argv)}` on {self.where()} exited {done.returncode}: "
                             f"{done.stderr.decode(errors='replace').strip()}")
        return done

    def text(self, argv: list[str], timeout: float = TIMEOUT) -> str:
        return self.run(argv, timeout=timeout).stdout.decode(errors="replace")

    def put(self, local: Path, remote: str) -> None:
        """Copy the contents of local folder `local` into `remote` (created), symlinks followed."""
        self._pipe(["tar", "-C", str(local), "-chf", "-", "."], self.argv(["sh", "-c",
                   f"mkdir -p {shlex.quote(remote)} && tar -C {shlex.quote(remote)} -xf -"]), f"copying to {remote}")

    def put_tar(self, remote: str, write: Callable[[IO[bytes]], None]) -> None:
        """Unpack into `remote` (created) the tar stream that `write` writes; when `write` raises,
        the copy is cut off there (nothing after that point is sent) and the error goes on."""
        sink = subprocess.Popen(self.argv(["sh", "-c", f"mkdir -p {shlex.quote(remote)} && tar -C "
                                           f"{shlex.quote(remote)} -xf -"]), stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            write(sink.stdin)
            sink.stdin.close()
        except BrokenPipeError:
            pass  # the far side ended early: its exit status and stderr say why
        except BaseException:
            sink.kill()
            sink.wait()
            raise
        err = sink.stderr.read()
        sink.wait(timeout=3600)
        if sink.returncode:
            raise EmberError(f"copying to {remote} on {self.where()} failed: {err.decode(errors='replace').strip()}")

    def get(self, remote: str, local: Path, exclude: tuple[str, ...] = ()) -> None:
        """Copy the contents of folder `remote` into `local` (created), leaving out `exclude` patterns.
        The folder may be a live run's: a file appended to while it is read (metrics.jsonl) comes
        as far as it was read, which the next copy completes; tar says so with exit status 1."""
        local.mkdir(parents=True, exist_ok=True)
        skip = [f"--exclude={p}" for p in exclude]
        self._pipe(self.argv(["tar", "-C", remote, *skip, "-cf", "-", "."]), ["tar", "-C", str(local), "-xf", "-"],
                   f"copying from {remote}", live=True)

    def _pipe(self, source: list[str], sink: list[str], what: str, live: bool = False) -> None:
        with subprocess.Popen(source, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as a:
            b = subprocess.run(sink, stdin=a.stdout, capture_output=True, timeout=3600)
            a.stdout.close()
            a_err = a.stderr.read()
            a.wait(timeout=60)
        said = [line for line in a_err.decode(errors="replace").splitlines() if line.strip()]
        if live and a.returncode == 1 and not b.returncode and said and \
                all(line.endswith(": file changed as we read it") for line in said):
            return  # GNU tar's exit 1 with --create: files changed while archived, nothing else
        if a.returncode or b.returncode:
            err = (a_err + b.stderr).decode(errors="replace").strip()
            raise EmberError(f"{what} on {self.where()} failed: {err}")

    def read(self, remote: str, offset: int = 0) -> bytes:
        """A file there from byte `offset` (b'' when it does not exist yet)."""
        done = self.run(["sh", "-c", f"[ ! -e {shlex.quote(remote)} ] || tail -c +{offset + 1} {shlex.quote(remote)}"])
        return done.stdout
