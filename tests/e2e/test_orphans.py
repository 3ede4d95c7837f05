"""Nothing ember starts outlives what started it (issue 24, item 8): SIGKILL the parent of each kind
of child ember starts and the child is gone within 30 s. The jobs of a service are the exception
by design (a restarted service adopts them: tests/e2e/test_serve.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ember.sched.process import start_time
from tests.helpers import GENESIS, ROOT, start_ember, stop, wait_for_step, wait_until, write_recipe
from tests.serve_harness import Serve

pytestmark = pytest.mark.e2e

GONE_SECONDS = 30


def still_running(procs: list[psutil.Process]) -> list[str]:
    """The processes of `procs` that still run (psutil knows each by PID and start time)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {command(p)[:120]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def assert_gone(procs: list[psutil.Process], what: str) -> None:
    deadline = time.monotonic() + GONE_SECONDS
    while still_running(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = still_running(procs)
    assert not left, f"{what}: still running {GONE_SECONDS} s after their parent was SIGKILLed: {left}"


def command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def children(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_a_supervisors_training_process_stops_with_it(tmp_path):
    """`ember run --restarts` SIGKILLed: its training child gets SIGTERM, checkpoints and exits 75."""
    recipe = write_recipe(tmp_path, train={"max_steps": 2000})
    out = tmp_path / "run"
    supervisor = start_ember("run", recipe, "--out", out, "--restarts", "2", env={"EMBER_FAULT_DATA_DELAY": "0.05"})
    try:
        wait_for_step(supervisor, out / "metrics.jsonl", 2, timeout=180)
        trainer = wait_until("the supervisor's training child", lambda: children(supervisor), 120, every=0.05)
        assert supervisor.poll() is None, "test setup: the supervisor ended before it was killed"
        assert stop(supervisor, signal.SIGKILL) == -signal.SIGKILL
        assert_gone(trainer, "the training process of a SIGKILLed supervisor")
        last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        assert (out / "checkpoints" / f"step-{last:09d}").is_dir()  # stopped as SIGTERM stops it: checkpointed
    finally:
        stop(supervisor)


def test_tokenization_workers_stop_with_their_run(tmp_path):
    """A run SIGKILLed while its process pool tokenizes (each worker held at its first shard for
    10 minutes): the workers go with it instead of tokenizing on for nobody."""
    corpus = tmp_path / "big.jsonl"
    texts = [json.loads(line)["text"] for line in GENESIS.read_text().splitlines()]
    with open(corpus, "w") as f:  # over POOL_MIN_BYTES (8 MiB), so that the pool is used
        copy = 0
        while f.tell() < 9 << 20:
            for text in texts:
                f.write(json.dumps({"text": f"{copy}: {text}"}) + "\n")
            copy += 1
    recipe = write_recipe(tmp_path, data={"files": [str(corpus)], "tokenize_workers": 2})
    run = start_ember("run", recipe, "--out", tmp_path / "run",
                      env={"EMBER_FAULT": "tokenize.shard", "EMBER_FAULT_HANG": "600"})
    try:
        def spawned() -> list[psutil.Process]:
            return [p for p in children(run) if "spawn_main" in command(p)]
        wait_until("two tokenization workers", lambda: len(spawned()) >= 2, 180, every=0.05)
        workers = children(run)  # the pool's workers and multiprocessing's resource tracker
        assert run.poll() is None, "test setup: the run ended before it was killed"
        assert stop(run, signal.SIGKILL) == -signal.SIGKILL
        assert_gone(workers, "tokenization workers of a SIGKILLed run")
    finally:
        stop(run)


OWNER = """
[service]
allowed = ["{root}"]
[inference]
seed = 7
"""


def engine_pid(s: Serve) -> int:
    record = s.home / "serve" / "engine.json"
    return wait_until("the service's engine.json", lambda: record.exists() and json.loads(record.read_text())["pid"],
                      120, every=0.05)


def test_the_inference_engine_stops_with_its_service_and_a_leftover_one_is_reaped(tmp_path):
    s = Serve(tmp_path / "home", OWNER.format(root=tmp_path)).start()
    try:
        engine = psutil.Process(engine_pid(s))
        assert s.proc.poll() is None
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(60)
        assert_gone([engine], "the inference engine of a SIGKILLed service")
    finally:
        s.stop()
    # An engine an earlier service left (as one started by an older ember, without the kernel's
    # signal, would be): the next service stops it before it starts its own.
    leftover = subprocess.Popen([sys.executable, "-m", "ember.web.infer_worker", "--model", "builtin:tiny",
                                 "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
                                start_new_session=True)
    try:
        assert leftover.stdout.readline().startswith(b"listening on ")
        (s.home / "serve" / "engine.json").write_text(json.dumps({"pid": leftover.pid,
                                                                  "start": start_time(leftover.pid)}))
        again = Serve(tmp_path / "home", OWNER.format(root=tmp_path)).start()
        try:
            assert leftover.wait(GONE_SECONDS) == -signal.SIGKILL
            assert f"stopped the inference engine an earlier service left running (PID {leftover.pid})" in \
                   wait_until("the reaping said in the log", lambda: "earlier service left" in again.output()
                              and again.output(), 120, every=0.05)
            assert engine_pid(again) != leftover.pid
        finally:
            again.stop()
    finally:
        if leftover.poll() is None:
            leftover.kill()
        leftover.wait()
