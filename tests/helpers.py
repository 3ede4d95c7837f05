"""Helpers to write tiny recipes and run `ember` for real in child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from ember.recipe import to_toml

ROOT = Path(__file__).resolve().parents[1]
GENESIS = ROOT / "examples" / "data" / "genesis.jsonl"


def with_cpu_peak(home: Path) -> Path:
    """`home` (a fresh $EMBER_HOME) given the CPU peaks this pytest run measured once while the
    machine was quiet (conftest.py's measure_peaks): without them a fresh home's first `ember plan`
    imports torch to measure (2.0 of its 2.1 CPU-s here), its first run spends 0.7 CPU-s more,
    and a record measured among the other tests' load is measured again whenever the machine is
    quieter. Copied as measured, date and load with it; a home that has a record keeps it. What
    the measurement and its cache do: tests/metrics/test_peaks.py."""
    source = os.environ.get("EMBER_TEST_PEAKS")
    target = home / "cache" / "cpu_peak.json"
    if source and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(Path(source).read_bytes())
    return home


def _with_peaks_in(env: dict | None) -> None:
    """The home a command runs with (its EMBER_HOME: given, or this process's) with the run's CPU
    peaks (with_cpu_peak), where it is a folder or is still to be made."""
    home = {**os.environ, **(env or {})}.get("EMBER_HOME")
    if home and not Path(home).is_file():
        try:
            with_cpu_peak(Path(home))
        except OSError:
            pass  # a home the test made unwritable: ember says so itself


def write_recipe(folder: Path, text: str = "", **sections: dict) -> Path:
    """A tiny-model recipe in `folder`; `sections` override keys, `text` is appended verbatim."""
    base = {
        "model": {"path": "builtin:tiny"},
        "data": {"files": [str(GENESIS)], "seq_len": 32},
        "optimizer": {"lr": 1e-3},
        "schedule": {"warmup_steps": 3},
        "train": {"max_steps": 24, "micro_batch": 4, "seed": 7, "threads": 1},
        "checkpoint": {"every_steps": 5, "keep_last": 2},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.toml"
    path.write_text(to_toml(base) + "\n" + text)
    return path


def ember_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ember", *map(str, args)]


def run_ember(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the CLI to completion in a child process: forked from a process that has already
    imported what a run needs (tests/warm.py), or a fresh interpreter with EMBER_TEST_COLD=1."""
    _with_peaks_in(env)
    if not os.environ.get("EMBER_TEST_COLD"):
        from tests import warm
        return warm.run(list(map(str, args)), {**os.environ, **(env or {})}, ROOT, timeout)
    return subprocess.run(ember_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def warm_children_env(env: dict[str, str]) -> dict[str, str]:
    """The variables that make a fresh interpreter started with `env` (a service, bench/gpu.py)
    have the `python -m ember ...` it starts, but a supervisor, forked from the pytest run's warm
    process (tests/warm_jobs/sitecustomize.py): a service's jobs' training processes and its
    plans. None with EMBER_TEST_COLD."""
    if os.environ.get("EMBER_TEST_COLD"):
        return {}
    from tests import warm
    site = str(ROOT / "tests" / "warm_jobs")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")])),
            "EMBER_TEST_WARM_JOBS": warm.stand_in_path()}


def warm_cmd(*args: str) -> list[str]:
    """`ember_cmd(*args)`, but the process it starts has the command forked from the warm process
    (tests/warm.py's stand-in; a fresh interpreter with EMBER_TEST_COLD=1). It is a process of
    this test's own: a signal to it reaches the command's process group, a SIGKILL kills the
    command within a millisecond, and it exits as the command did. Its standard streams close
    only once the command and every process it started are gone. For a test that kills or signals
    a run by the PID it started; one that walks the process tree under it wants `ember_cmd`."""
    if os.environ.get("EMBER_TEST_COLD"):
        return ember_cmd(*args)
    from tests import warm
    return [warm.stand_in_path(), *map(str, args)]


def start_ember(*args: str, env: dict | None = None, warm: bool = False) -> subprocess.Popen:
    """`ember ...` started, its streams piped; `warm`: through the warm stand-in (warm_cmd), for
    a test that signals or kills the process by the PID it started and nothing under it."""
    _with_peaks_in(env)
    return subprocess.Popen(warm_cmd(*args) if warm else ember_cmd(*args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, cwd=ROOT)


def wait_for_step(proc: subprocess.Popen, metrics: Path, step: int, timeout: float = 120) -> None:
    """Block until the run logged `step` (or exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= step:
            return
        time.sleep(0.002)


def post_and_leave(app, path: str, body: dict, headers: dict[str, str] | None = None,
                   when=lambda: True) -> list[dict]:
    """POST `body` as JSON to the ASGI app, in-process, as a client that leaves once it has sent
    the request and `when()` is true: a receive() after the body waits for that, then says the
    client disconnected. What the app sent (to nobody)."""
    import asyncio
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        while not when():
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
    fields = {"host": "127.0.0.1", "content-type": "application/json", **(headers or {})}
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in fields.items()],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    return sent


def wait_until(what: str, check, timeout: float, every: float = 0.5):
    """Poll `check()` until it returns something true, at most `timeout` seconds; on timeout, say
    what was waited for and what was seen last."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s; last saw {check()!r}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> int:
    """Signal the child we started (by PID) and reap it."""
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.outputs = proc.communicate(timeout=120)  # (stdout, stderr), for a failing test to show
    return proc.returncode


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def assert_same_result(run: Path, baseline: Path) -> None:
    """Per-step losses and final weights bit-for-bit equal to the uninterrupted baseline."""
    assert losses(run) == losses(baseline)
    files = sorted(p.name for p in (baseline / "final").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (run / "final").glob("*.safetensors"))
    for f in files:
        a, b = load_file(run / "final" / f), load_file(baseline / "final" / f)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"{f}: {name}"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _zero_block(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = (len(data) // 2) & ~4095 if len(data) > 4096 else 0
    end = min(len(data), start + 4096)
    data[start:end] = bytes(end - start) if any(data[start:end]) else b"\xff" * (end - start)
    path.write_bytes(bytes(data))


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x04
    path.write_bytes(bytes(data))


MANIFEST_DAMAGE = {"truncate": _truncate, "zero_4k_block": _zero_block, "flip_bit": _flip_bit}


def callers_of(module: str, function: str) -> list[str]:
    """The files under ember/ that call `module.function` (imported by name, as a module, or
    through its package), relative to ember/: the guard of a state machine's one writer."""
    import ast
    package, _, leaf = module.rpartition(".")
    ember = Path(__file__).resolve().parents[1] / "ember"
    callers = []
    for path in sorted(ember.rglob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == package:
                aliases |= {a.asname or a.name for a in node.names if a.name == leaf}
            if isinstance(node, ast.ImportFrom) and node.module == module and \
                    any(a.name == function for a in node.names):
                callers.append(str(path.relative_to(ember)))
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name == module}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == function and ast.unparse(node.value) in aliases:
                callers.append(str(path.relative_to(ember)))
    return callers


def measured_peak(r) -> int:
    """Recipe `r`'s step peak as ember.doctor.measure.calibrate measures it (one step), less the
    tensors this test process held before: the measurement counts every live tensor of the
    process, here other tests' too. torch's thread count is put back (the measurement sets the
    recipe's)."""
    import gc

    from ember.doctor.measure import calibrate, live_tensor_bytes
    threads = torch.get_num_threads()
    gc.collect()
    held = live_tensor_bytes(torch.device("cpu"))
    try:
        return calibrate(r, steps=1).peak_bytes - held
    finally:
        torch.set_num_threads(threads)
