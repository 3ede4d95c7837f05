"""A warm start for `ember` in the tests: one process per pytest worker imports what a run
imports (torch, transformers, peft, ember) once, then forks a child for each `run_ember`.

Each command still runs in a process of its own, with its own arguments, environment, working
folder, standard streams and exit status, and leaves nothing behind in the process that forked it;
what it skips is the interpreter's start and ~2.7 s of imports (the suite launches `ember` some
hundreds of times). The child sets its environment before any of ember runs, and ember reads no
variable at import time (tests/test_warm.py checks that guard); third-party libraries read theirs
when the warm process starts, with the worker's environment (conftest.py: no model hub).

What must be a real start stays one: `start_ember` (signals, kills, power cuts), the service and
its jobs, the supervisor's children and torchrun's ranks are fresh interpreters.

Protocol on a Unix socket: the client sends one JSON line {argv, env, cwd} with its stdin, stdout
and stderr as SCM_RIGHTS; a forked helper forks the command, waits for it and answers with its
exit status as one JSON line; if the client goes away first, the command's process group is killed.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What a tiny `ember run` imports; anything else is imported by the command itself, as it would be.
WARM_MODULES = ["torch", "torch.distributed.tensor", "torch._dynamo", "transformers",
                "transformers.models.llama.modeling_llama", "peft", "safetensors.torch",
                "ember.cli.main", "ember.launch", "ember.train.job", "ember.train.loop"]


# --- the warm process ---------------------------------------------------------------------------

def serve(path: str) -> None:
    import gc
    import importlib
    sys.path[0] = str(ROOT)  # this checkout's ember, as `python -m ember` run from ROOT imports it
    from ember.proc import die_with_parent
    die_with_parent(signal.SIGKILL)  # gone with the worker
    for name in WARM_MODULES:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # fewer copied pages in the children
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # helpers are reaped by the kernel
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _helper(conn)
        conn.close()


def _helper(conn: socket.socket) -> None:
    """Forks the command, waits for it and answers; kills it if the client leaves first."""
    status = 1
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _command(request, fds)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        sel = selectors.DefaultSelector()
        sel.register(pidfd, selectors.EVENT_READ)
        sel.register(conn, selectors.EVENT_READ)
        while True:
            ready = {key.fileobj for key, _ in sel.select()}
            if pidfd in ready:
                break
            if conn in ready and not conn.recv(1, socket.MSG_PEEK):  # the client went away
                _kill(pid)
                break
        _, wait_status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(wait_status)
        conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
        status = 0
    finally:
        os._exit(status)


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except ProcessLookupError:
            pass


def _command(request: dict, fds: list[int]) -> None:
    """The child: becomes the command (own process group, as `start_new_session` would not do:
    the helper kills the group) and exits the way the interpreter would."""
    import atexit
    import runpy
    import threading
    import traceback
    code = 1
    try:
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` has it
        sys.argv = ["ember", *request["argv"]]
        try:
            runpy.run_module("ember", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = _exit_code(exit_.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# --- the client, in the pytest worker ---------------------------------------------------------

class _Warm:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="ember-warm-")
        self.path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], cwd=ROOT,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the warm ember process did not start (said {line!r}, "
                               f"exit {self.proc.wait()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)


_warm: _Warm | None = None


def _instance() -> _Warm:
    global _warm
    if _warm is None or _warm.proc.poll() is not None:
        import atexit
        _warm = _Warm()
        atexit.register(_warm.close)
    return _warm


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(["python", "-m", "ember", *args], capture_output=True, text=True, ...)`,
    forked from the warm process."""
    warm = _instance()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(warm.path)
        request = json.dumps({"argv": list(map(str, args)), "env": env, "cwd": str(cwd)})
        socket.send_fds(conn, [request.encode() + b"\n"], [stdin, out_w, err_w])
    finally:
        for fd in (stdin, out_w, err_w):
            os.close(fd)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    answer = b""
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    for fd in (out_r, err_r, conn):
        sel.register(fd, selectors.EVENT_READ)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(["ember", *args], timeout)
            for key, _ in sel.select(left):
                if key.fileobj is conn:
                    data = conn.recv(4096)
                    answer += data
                else:
                    data = os.read(key.fd, 65536)
                    chunks[key.fd].append(data)
                if not data:
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
        conn.close()  # before the answer, this kills the command
        os.close(out_r)
        os.close(err_r)
    if not answer:
        raise RuntimeError(f"the warm ember process gave no exit status for ember {' '.join(args)}")
    return subprocess.CompletedProcess(["ember", *args], json.loads(answer)["returncode"],
                                       _text(chunks[out_r]), _text(chunks[err_r]))


def _text(chunks: list[bytes]) -> str:
    """As `text=True` decodes: universal newlines."""
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    serve(sys.argv[1])
