"""A warm start for `ember` in the tests: one process per pytest run imports what a run imports
(torch, transformers, peft, ember) once, then forks a child for each `run_ember` of any worker.
conftest.py starts it in the pytest process that starts the workers, before they start, so it
imports while they collect (`start_shared`); each worker joins it by the folder in $EMBER_TEST_WARM
and waits at its first command until it listens.

Each command still runs in a process of its own, with its own arguments, environment, working
folder, standard streams and exit status, and leaves nothing behind in the process that forked it;
what it skips is the interpreter's start and ~2.7 s of imports (the suite launches `ember` some
hundreds of times). The child sets its environment before any of ember runs, and ember reads no
variable at import time (tests/test_warm.py checks that guard); third-party libraries read theirs
when the warm process starts, with the environment of the pytest process that starts it
(conftest.py: no model hub).

The processes a warm command starts as `python -m ember ...` (the ranks torchrun's agent starts
for `--nproc N`, the child a supervisor starts for `--restarts N`, preflight's trial run) are
forked here too: the command starts a small stand-in instead of the interpreter (`stand_in`),
which asks this process for the command by the same protocol, hands over the descriptors it
inherited (the supervisor's lock), passes on the signals it gets, and exits as the command did
(its code, or killed by the same signal), so the agent, the supervisor and ember.ranks read the
ending a real process would leave. A test may start the stand-in itself (tests.helpers.warm_cmd:
the crash harness's attempts, killed by their PID).

A test that walks the process tree under a stand-in sees through it with `tree` (each stand-in's
command, and what that started, count as its children) and signals the command itself: a rank
SIGKILLed at a random moment is the rank, and its stand-in dies of the same signal after it.
What must be a real start stays one: `start_ember` without `warm` (signals to a process group,
reached by every process in it; a lock holder named by its PID) and everything under it, and a
service and its jobs' supervisors, are fresh interpreters; what those start is forked here too,
through tests/warm_jobs/sitecustomize.py (a service's jobs' training processes, its plans).

Protocol on a Unix socket: the client sends one JSON line {argv, env, cwd, fds} with the
descriptors named in fds (its stdin, stdout and stderr at least) as SCM_RIGHTS; the warm process
forks the command, says its PID as one JSON line, waits for it and answers with its exit status
as another; if the client goes away first, the command's process group is killed. While the
command runs, the file `of-<client PID>` beside the socket holds the command's PID (`command_of`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What a tiny `ember run` imports; anything else is imported by the command itself, as it would be.
WARM_MODULES = ["torch", "torch.distributed.tensor", "torch._dynamo", "transformers",
                "transformers.models.llama.modeling_llama", "peft", "safetensors.torch",
                "ember.cli.main", "ember.launch", "ember.train.job", "ember.train.loop",
                "torch.distributed.launcher.api"]


# --- the warm process ---------------------------------------------------------------------------

def serve(path: str) -> None:
    import gc
    import importlib
    sys.path[0] = str(ROOT)  # this checkout's ember, as `python -m ember` run from ROOT imports it
    from ember.proc import die_with_parent
    die_with_parent(signal.SIGKILL)  # gone with the pytest process that started it
    for name in WARM_MODULES:
        importlib.import_module(name)
    _read_once()
    _ember_children_forked_here(path)
    _no_exit_finalizers_of_the_imports()
    gc.collect()
    gc.freeze()  # fewer copied pages in the children
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    ready = os.path.join(os.path.dirname(path), READY)
    with open(ready + ".new", "w"):
        pass
    os.replace(ready + ".new", ready)  # listening: clients may connect
    _Server(listener, os.path.dirname(path)).loop()


ASKS = "asks"  # a client's connection before its request is read


class _Server:
    """The warm process's one loop: it accepts a client, forks its command and answers when the
    command ends, for many clients at once. No process stands between it and its commands: each
    fork of this process costs ~9 ms here and each exit ~12 ms (the page tables of ~320 MB of
    imports), which a helper process per command would pay twice."""

    def __init__(self, listener: socket.socket, folder: str) -> None:
        self.listener, self.folder = listener, folder
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, None)
        self.running: dict[int, tuple[socket.socket, int, str]] = {}  # pidfd: (conn, pid, of-file)
        self.pid = os.getpid()

    def loop(self) -> None:
        while True:
            for key, _ in self.sel.select():
                try:
                    if key.fileobj is self.listener:  # a client: its request is read once it has come
                        self.sel.register(self.listener.accept()[0], selectors.EVENT_READ, ASKS)
                    elif isinstance(key.fileobj, int):
                        self._ended(key.fileobj)
                    elif key.data is ASKS:
                        self.sel.unregister(key.fileobj)
                        self._start(key.fileobj)
                    else:  # the client went away first (it sends nothing more while it waits)
                        self.sel.unregister(key.fileobj)
                        try:
                            gone = not key.fileobj.recv(1, socket.MSG_PEEK)
                        except OSError:  # reset: it closed with our PID line unread
                            gone = True
                        if gone:
                            _kill(key.data)
                except Exception:  # one client's trouble is not the others': said, and served on
                    import traceback
                    traceback.print_exc()

    def _start(self, conn: socket.socket) -> None:
        """Fork the command the client on `conn` asks for, and say its PID."""
        fds: list[int] = []
        pid = 0
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            client = struct.unpack("3i", creds)[0]
            known = os.path.join(self.folder, f"of-{client}")  # the client's PID
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, MAX_FDS)
            if not msg and not fds:  # gone before it asked (a stand-in killed as it started)
                conn.close()
                return
            request = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                try:
                    self._child(conn, request, fds, client)
                finally:
                    os._exit(1)  # _child ends in os._exit: this is for what raised before
            pidfd = os.pidfd_open(pid)
        except BaseException:  # nothing of this client kept: its descriptors, its command
            for fd in fds:
                os.close(fd)
            conn.close()
            if pid:
                _kill(pid)
                os.waitpid(pid, 0)
            raise
        for fd in fds:
            os.close(fd)
        self.running[pidfd] = (conn, pid, known)
        self.sel.register(pidfd, selectors.EVENT_READ, pid)
        self.sel.register(conn, selectors.EVENT_READ, pid)
        with open(known + ".new", "w") as f:
            f.write(str(pid))
        os.replace(known + ".new", known)  # before the client learns the PID: a test reads it after
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:  # the client went away: so does its command (answered once it ends)
            _kill(pid)

    def _child(self, conn: socket.socket, request: dict, fds: list[int], client: int) -> None:
        """In the forked command: none of the server's descriptors (a client reads its answer to
        the end: a copy of its socket here would hold it until this command ends), the client's
        own group (under `pytest --cpu-by-test`), death with this process, then the command. It
        never returns."""
        try:
            for key in self.sel.get_map().values():  # clients not read yet among them
                if key.data is ASKS:
                    key.fileobj.close()
            self.sel.close()
            self.listener.close()
            conn.close()
            for pidfd, (other, _, _) in self.running.items():
                os.close(pidfd)
                other.close()
            if "EMBER_TEST_CPU_CGROUP" in request["env"]:  # pytest --cpu-by-test
                from tests.cpu_by_test import join_the_clients
                join_the_clients(client)
            from ember.proc import die_with_parent
            die_with_parent(signal.SIGKILL, self.pid)  # no one would answer its client or stop it
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(1)
        _command(request, fds)  # ends in os._exit

    def _ended(self, pidfd: int) -> None:
        """The command of `pidfd` ended: reap it and tell its client how."""
        conn, pid, known = self.running.pop(pidfd)
        self.sel.unregister(pidfd)
        with contextlib.suppress(KeyError):  # unregistered already if its client went away first
            self.sel.unregister(conn)
        os.close(pidfd)
        _, wait_status = os.waitpid(pid, 0)
        with contextlib.suppress(FileNotFoundError):  # a client with two commands at once
            os.unlink(known)
        with conn, contextlib.suppress(OSError):  # a client gone meanwhile hears nothing
            conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(wait_status)}).encode() + b"\n")


def _no_exit_finalizers_of_the_imports() -> None:
    """The finalizers the imports registered (torch.library's, one for each library of operators
    it defines: ~250) do not run at a command's exit. A fresh interpreter runs them, to unregister
    the operators from torch's dispatcher just before the process ends, which nothing outside the
    process can see; in a fork they copy ~10,000 shared pages, ~40 ms of CPU for a short command
    (one that trains has copied most of them itself by then). The finalizers a command registers
    itself (a temporary folder's) run as they would."""
    import weakref
    for f in list(weakref.finalize._registry):  # no public way to list them
        f.atexit = False


def _read_once() -> None:
    """What every run would otherwise read again in its own process (0.4 s of a tiny run's 0.53
    CPU-s, measured per test): the installed packages' metadata (a new $EMBER_HOME has no cache
    of it) and transformers' table of checkpoint conversions, built at the first save."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from ember.ledger.manifest import read_packages
    read_packages()
    get_checkpoint_conversion_mapping("llama")


def _ember_children_forked_here(path: str) -> None:
    """In a command forked from here, every `python -m ember ...` it starts (torchrun's agent its
    ranks, a supervisor its child, preflight its trial run) starts `stand_in` instead, which has
    that command forked from here too. Popen is the one place they all pass."""
    stand_in = os.path.join(os.path.dirname(path), STAND_IN)
    with open(stand_in, "w") as f:
        f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                f"from tests.warm import stand_in\nstand_in({path!r})\n")
    os.chmod(stand_in, 0o755)
    init = subprocess.Popen.__init__

    def forked(self, args, *rest, **kwargs):
        if isinstance(args, (list, tuple)) and [str(a) for a in args[:3]] == [sys.executable, "-m", "ember"]:
            args = [stand_in, *args[3:]]
        init(self, args, *rest, **kwargs)
    subprocess.Popen.__init__ = forked


# Signals a parent (torchrun's agent, a supervisor) or a test may send; passed on to the command.
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MAX_FDS = 16
STAND_IN = "python"  # the stand-in's file name, beside the warm process's socket


def stand_in(path: str) -> None:
    """The process a rank's or a supervised child's parent sees: `ember ARGS` forked from the warm
    process at `path`, with this process's environment, folder and descriptors (as exec would
    keep them). Signals in PASSED_ON go on to the command itself, not to its group: a supervisor
    and a test signal their child by its PID; torchrun's agent signals the rank's group, where the
    rank's own workers ignore a SIGTERM that is not their parent's (ember.proc). SIGKILL here kills
    the command (the warm process sees this end of the socket close); the exit is the command's, a
    signal's death included."""
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)  # held until the command's PID is known
    fds = []
    for name in os.listdir("/proc/self/fd"):  # what this process inherited (the listing's own is closed by now)
        try:
            os.fstat(int(name))
            fds.append(int(name))
        except OSError:
            pass
    if len(fds) > MAX_FDS:
        raise SystemExit(f"warm stand-in: {len(fds)} inherited descriptors, at most {MAX_FDS}")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds})
    socket.send_fds(conn, [request.encode() + b"\n"], fds)
    lines = conn.makefile("rb")
    pid = json.loads(lines.readline())["pid"]
    for sig in PASSED_ON:
        signal.signal(sig, lambda sig, _: _pass_on(pid, sig))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
    line = lines.readline()
    if not line:
        os._exit(1)  # the warm process is gone: so is the rank
    code = json.loads(line)["returncode"]
    if code < 0:  # die of the command's signal (its default action: SIGKILL's cannot change)
        if -code in PASSED_ON:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _pass_on(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except ProcessLookupError:
            pass


def _command(request: dict, fds: list[int]) -> None:
    """The child: becomes the command (own process group, as `start_new_session` would not do:
    the warm process kills the group) and exits the way the interpreter would."""
    import atexit
    import runpy
    import threading
    import traceback
    code = 1
    try:
        os.setpgid(0, 0)
        targets = request.get("fds", [0, 1, 2])
        above = max([*targets, *fds]) + 1
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]  # out of the way of every target
        for fd in fds:
            os.close(fd)
        for target, fd in zip(targets, high):
            os.dup2(fd, target)  # inheritable, as exec keeps it
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

SHARED = "EMBER_TEST_WARM"  # the folder of the warm process a whole pytest run shares
READY = "ready"             # the file the warm process writes beside its socket once it listens
READY_SECONDS = 600         # ~3-5 s here quiet; imports take 10x that on a loaded machine


class _Warm:
    """A warm process and its folder (socket, stand-in, `pid`, `ready`, `of-*`), as one pytest
    process sees it: the one that started it (`start`, which owns and stops it), or a worker that
    joined it by its folder."""

    def __init__(self, folder: str, proc: subprocess.Popen | None = None) -> None:
        self.folder, self.proc = folder, proc
        self.path = os.path.join(folder, "socket")
        with open(os.path.join(folder, "pid")) as f:
            self.pid = int(f.read())
        self.ready = False

    @classmethod
    def start(cls) -> _Warm:
        folder = tempfile.mkdtemp(prefix="ember-warm-")
        proc = subprocess.Popen([sys.executable, __file__, os.path.join(folder, "socket")], cwd=ROOT,
                                stdout=subprocess.DEVNULL)
        with open(os.path.join(folder, "pid.new"), "w") as f:
            f.write(str(proc.pid))
        os.replace(os.path.join(folder, "pid.new"), os.path.join(folder, "pid"))
        return cls(folder, proc)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        import psutil
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def wait_ready(self) -> None:
        """Until it listens; a clear error if it exits first or takes longer than READY_SECONDS."""
        deadline = time.monotonic() + READY_SECONDS
        while not self.ready:
            if os.path.exists(os.path.join(self.folder, READY)):
                self.ready = True
            elif not self.alive():
                raise RuntimeError(f"the warm ember process (PID {self.pid}, {self.folder}) exited before it "
                                   f"was ready: its error is in the output of the pytest process that started it")
            elif time.monotonic() > deadline:
                raise RuntimeError(f"waited {READY_SECONDS} s for the warm ember process (PID {self.pid}) to "
                                   f"write {self.folder}/{READY}; the folder holds {sorted(os.listdir(self.folder))}")
            else:
                time.sleep(0.02)

    def close(self) -> None:
        """Stop it and remove its folder (the process that started it only)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)  # killed while it wrote an of-* file


_warm: _Warm | None = None
_shared: _Warm | None = None


def start_shared() -> None:
    """In the pytest process that starts the workers (or runs the tests itself), before they
    start: one warm process for all of them (its imports once, not once per worker), importing
    while they collect. Not with EMBER_TEST_COLD, nor when one is already shared."""
    global _shared
    if os.environ.get("EMBER_TEST_COLD") or os.environ.get(SHARED):
        return
    _shared = _Warm.start()
    os.environ[SHARED] = _shared.folder  # the workers start with it


def stop_shared() -> None:
    global _shared
    if _shared is not None:
        os.environ.pop(SHARED, None)
        _shared.close()
        _shared = None


def wait_shared() -> None:
    """Until the shared warm process listens (the process that started it runs tests itself: its
    imports then end before the first test, which may time something)."""
    if _shared is not None:
        _shared.wait_ready()


def _instance() -> _Warm:
    """The warm process of this pytest run (start_shared's), or one of this process's own: from
    the start without $EMBER_TEST_WARM, and in place of the shared one if that one has died."""
    global _warm
    if _warm is None or not _warm.alive():
        folder = os.environ.get(SHARED)
        if folder and _warm is None:
            _warm = _shared or _Warm(folder)  # started here (a run without workers), or joined
        else:
            if _warm is not None:
                print(f"warm ember process {_warm.pid} exited: starting another for this process",
                      file=sys.stderr)
            import atexit
            _warm = _Warm.start()
            atexit.register(_warm.close)
    _warm.wait_ready()
    return _warm


def stand_in_path() -> str:
    """The stand-in for `python -m ember` of this pytest run's warm process (`stand_in`)."""
    return os.path.join(_instance().folder, STAND_IN)


def command_of(pid: int) -> int | None:
    """The PID of the command forked for the stand-in `pid` of this pytest run's warm process, while
    it runs (None: `pid` is no such stand-in, or its command has ended)."""
    if _warm is None:
        return None
    try:
        with open(os.path.join(_warm.folder, f"of-{pid}")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def tree(pid: int) -> list:
    """psutil's processes under `pid`, itself first, as fresh starts would have them: a stand-in's
    command, and every process under that, are under the stand-in too. Those gone meanwhile are
    left out."""
    import psutil
    found, todo = [], [pid]
    while todo:
        try:
            p = psutil.Process(todo.pop(0))
            children = [c.pid for c in p.children()]
        except psutil.Error:
            continue
        found.append(p)
        todo += children + [c for c in [command_of(p.pid)] if c is not None]
    return found


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
    said = [json.loads(line) for line in answer.splitlines()]
    if not said or "returncode" not in said[-1]:
        raise RuntimeError(f"the warm ember process gave no exit status for ember {' '.join(args)}")
    return subprocess.CompletedProcess(["ember", *args], said[-1]["returncode"],
                                       _text(chunks[out_r]), _text(chunks[err_r]))


def _text(chunks: list[bytes]) -> str:
    """As `text=True` decodes: universal newlines."""
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    serve(sys.argv[1])
