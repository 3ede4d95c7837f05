"""Whole runs, interrupted and resumed, must end bit-for-bit where the uninterrupted run ends."""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.artifacts import copy_of, shared
from tests.helpers import (
    GENESIS,
    assert_same_result,
    losses,
    run_ember,
    start_ember,
    stop,
    wait_for_step,
    write_recipe,
)

CONFIGS = {
    "full": {},
    "lora": {"method": {"kind": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.1}},
    "grad_accum": {"train": {"grad_accum": 3, "max_steps": 16}},
    "workers": {"data": {"workers": 2}},
    "fp16": {"precision": {"mode": "fp16"}, "train": {"max_steps": 16}},  # GradScaler state resumes too
    "bf16": {"precision": {"mode": "bf16"}},  # what the doctor names on a CPU with fast bf16 (AMX)
    "int8": {"optimizer": {"state_dtype": "int8"}},  # bitsandbytes' 8-bit AdamW state, checkpointed as is
    # QLoRA: the 4-bit base is quantized again at each start; the checkpoint holds the adapters
    "qlora": {"method": {"kind": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.1, "quantize": "nf4"}},
    # QLoRA over a GGUF file's own blocks (tests/gguf_files.py: its model path is filled in by
    # `sections`), read again from the file at each start
    "gguf": {"method": {"kind": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.1, "quantize": "gguf"}},
}


def sections(name: str) -> dict:
    """CONFIGS[name], with the tiny GGUF model (built once for every worker) where it needs one."""
    if CONFIGS[name].get("method", {}).get("quantize") != "gguf":
        return CONFIGS[name]
    from tests.gguf_files import shared_tiny_gguf
    return {**CONFIGS[name], "model": {"path": str(shared_tiny_gguf())}}


def uninterrupted(name: str, sections: dict) -> Path:
    """The uninterrupted run of a tiny recipe with these sections, made once for all workers."""
    def build(folder: Path) -> None:
        result = run_ember("run", write_recipe(folder, **sections), "--out", folder / "run")
        assert result.returncode == 0, result.stderr
    return shared(f"resume-{name}", sections, build) / "run"


@pytest.fixture
def baselines() -> Callable[[str], Path]:
    """Uninterrupted runs, one per configuration, made on first use."""
    return lambda name: uninterrupted(name, sections(name))


def resume_to_end(recipe: Path, out: Path) -> None:
    result = run_ember("run", recipe, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "resuming from" in result.stderr


@pytest.mark.parametrize("name", CONFIGS)
def test_sigkill_at_random_moments_resumes_bit_exact(name, baselines, tmp_path):
    rng = random.Random(f"kills-{name}")
    recipe = write_recipe(tmp_path, **sections(name))
    out = tmp_path / "run"
    accum = CONFIGS[name].get("train", {}).get("grad_accum", 1)
    # A kill right after the first commit (so every restart has a checkpoint: persists run in
    # the background and may lag the steps), one mid-step (after the backward of a random
    # micro-batch), one inside a commit (files written, manifest not yet); a restart after each.
    kills = ["ckpt.renamed@1",
             f"train.micro_batch@{rng.randint(2, 8 * accum)}",
             f"ckpt.files_written@{rng.randint(1, 2)}"]
    for fault in kills:
        result = run_ember("run", recipe, "--out", out, env={"EMBER_FAULT": fault})
        assert result.returncode == -signal.SIGKILL, (fault, result.stderr)
    assert list((out / "checkpoints").glob("step-*"))
    assert not list((out / "checkpoints").glob("corrupt-*"))  # a kill never leaves a torn commit
    resume_to_end(recipe, out)
    assert_same_result(out, baselines(name))
    attempts = (out / "attempts.jsonl").read_text().splitlines()
    assert len(attempts) == len(kills) + 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP])
def test_stop_signal_checkpoints_exits_75_and_resumes_bit_exact(sig, baselines, tmp_path):
    # 150 steps: the signal is sent within milliseconds of step 7 (wait_for_step polls every
    # 2 ms), and lands at the next micro-batch; the rest of the run is resumed, so every step
    # beyond what the test needs is CPU spent twice (here and in the baseline).
    recipe = write_recipe(tmp_path, train={"max_steps": 150})
    out = tmp_path / "run"
    proc = start_ember("run", recipe, "--out", out, warm=True)
    wait_for_step(proc, out / "metrics.jsonl", 7)
    assert stop(proc, sig) == 75, proc.stderr.read() if proc.stderr else ""
    stopped_at = losses(out)[-1][0]
    assert 7 <= stopped_at < 150
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert (out / "checkpoints" / f"step-{stopped_at:09d}").is_dir(), (saved, _tail(proc))  # checkpointed where it stopped
    # The baseline for a 150-step schedule: uninterrupted.
    resume_to_end(recipe, out)
    assert_same_result(out, uninterrupted("150", {"train": {"max_steps": 150}}))


def test_a_stop_signal_landing_as_the_step_decides_whether_to_save_still_checkpoints_where_it_stops(tmp_path):
    """A signal that lands after the loop asked the checkpoint policy what is due (nothing, at step
    7) but before the ranks agreed to stop: the run stopped at step 7 with no checkpoint there
    ('newest committed checkpoint is step 5 (stopped at step 7)', seen once in CI). The loop now
    reads the stop request once per step: the signal stops the run at the next step, saved."""
    recipe = write_recipe(tmp_path, train={"max_steps": 150})
    out = tmp_path / "run"
    result = run_ember("run", recipe, "--out", out,
                       env={"EMBER_FAULT": "train.save_decided@7", "EMBER_FAULT_SIGNAL": "SIGTERM"})
    assert result.returncode == 75, result.stderr[-2000:]
    stopped_at = losses(out)[-1][0]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert (out / "checkpoints" / f"step-{stopped_at:09d}").is_dir(), (stopped_at, saved, result.stderr[-2000:])
    resume_to_end(recipe, out)
    assert_same_result(out, uninterrupted("150", {"train": {"max_steps": 150}}))


def test_a_stop_signal_during_start_up_stops_the_run_before_its_first_step(tmp_path):
    """A scheduler's warning (SIGUSR1) that arrives while the run is still starting (held here
    for 3 s in tokenizing its data) no longer kills it: it exits 75 at its first step boundary,
    having trained nothing, and the same command then runs it as an uninterrupted run."""
    import time
    data = tmp_path / "data.txt"  # data of its own: tokenized by this run, not found in the cache
    data.write_text(GENESIS.read_text() + f"\n{tmp_path.name}\n")
    recipe = write_recipe(tmp_path, data={"files": [str(data)]})
    out = tmp_path / "run"
    # A home of its own: a work folder another test left in the shared token cache (a run killed
    # while tokenizing) would otherwise be taken for this run's, and the signal sent too early.
    home = {"EMBER_HOME": str(tmp_path / "home")}
    proc = start_ember("run", recipe, "--out", out,
                       env={**home, "EMBER_FAULT": "tokenize.shard", "EMBER_FAULT_HANG": "3"})
    cache = tmp_path / "home" / "cache" / "tokens"
    deadline = time.monotonic() + 120
    while not list(cache.glob(".*.work/plan.json")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text(), "it trained"
    base = tmp_path / "base"
    assert run_ember("run", recipe, "--out", base, env=home).returncode == 0
    done = run_ember("run", recipe, "--out", out, env=home)
    assert done.returncode == 0, done.stderr
    assert_same_result(out, base)


@pytest.mark.parametrize("restarts", ["0", "2"])
def test_a_stop_signal_as_the_command_begins_exits_75_not_143(tmp_path, restarts):
    """SIGTERM in the first seconds of `ember run` (before its imports and its memory plan: ~7 s
    on a busy machine) killed it, exit 143 with nothing said; with --restarts the supervisor died
    of it. The command's stop handlers are now the first thing it installs: exit 75, nothing
    trained, and the same command then runs the whole run. (The signal is sent by the run itself
    at the fault point `run.start`, the top of ember.launch.run, once: the supervisor's.)"""
    recipe = write_recipe(tmp_path)
    out = tmp_path / "run"
    env = {"EMBER_FAULT": "run.start", "EMBER_FAULT_SIGNAL": "SIGTERM", "EMBER_FAULT_ONCE": str(tmp_path / "once")}
    stopped = run_ember("run", recipe, "--out", out, "--restarts", restarts, env=env)
    assert stopped.returncode == 75, (stopped.returncode, stopped.stderr[-2000:])
    assert "SIGTERM before training began: nothing was trained" in stopped.stderr or restarts == "0", stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text(), "it trained"
    done = run_ember("run", recipe, "--out", out, "--restarts", restarts)
    assert done.returncode == 0 and len(losses(out)) == 24, done.stderr[-2000:]


def test_a_supervised_child_killed_by_the_stop_signal_it_was_sent_is_stopped_not_crashed(tmp_path):
    """A child that dies of the signal its supervisor forwards (it had no handler yet) made the
    supervisor exit with -15, i.e. 241, a code nobody documents: it was stopped, and is resumable."""
    import os
    import sys
    import threading
    from ember.events import Events
    from ember.supervise import supervise
    ready = tmp_path / "ready"
    child = [sys.executable, "-c", f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"]
    said = []

    def stop_when_ready() -> None:
        for _ in range(6000):  # 60 s
            if ready.exists():
                os.kill(os.getpid(), signal.SIGTERM)  # this process: supervise() forwards it to the child
                return
            threading.Event().wait(0.01)
    threading.Thread(target=stop_when_ready, daemon=True).start()
    code = supervise(child, 2, 0.1, Events(lambda e: said.append(e.message)))
    assert code == 75, (code, said)
    assert "killed by SIGTERM" in said[-1]


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_after_the_last_step_leaves_the_run_completed(sig, tmp_path):
    """A scheduler's warning that lands as a completed run exits (its last step and final weights
    written, the process closing its files): exit 0, the run completed. Before, the loop took its
    handlers down as it wound down, and the signal's default action killed the finished run
    (seen under Slurm: exit 138 after 'final weights written', the job recorded as failed)."""
    recipe = write_recipe(tmp_path, train={"max_steps": 3})
    out = tmp_path / "run"
    done = run_ember("run", recipe, "--out", out, env={"EMBER_FAULT": "train.ended", "EMBER_FAULT_SIGNAL": sig})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert [s for s, _ in losses(out)] == [1, 2, 3] and (out / "final").is_dir()
    again = run_ember("run", recipe, "--out", out)
    assert again.returncode == 0 and "resuming" not in again.stderr, again.stderr[-2000:]


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "drop_manifest"])
def test_damaged_newest_checkpoint_falls_back_and_still_ends_identical(damage, baselines, tmp_path):
    sync = {"checkpoint": {"async": False}}  # both commits done by the kill

    def kill(folder: Path) -> None:
        result = run_ember("run", write_recipe(folder, **sync), "--out", folder / "run",
                           env={"EMBER_FAULT": "train.micro_batch@13"})
        assert result.returncode == -signal.SIGKILL, result.stderr
    recipe = write_recipe(tmp_path, **sync)
    out = copy_of(shared("killed-at-13", sync, kill) / "run", tmp_path / "run")
    newest = out / "checkpoints" / "step-000000010"
    assert newest.is_dir() and (out / "checkpoints" / "step-000000005").is_dir()
    target = newest / "model.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip_byte":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[: len(data) - 100]))
    else:
        (newest / "MANIFEST.json").unlink()
    result = run_ember("run", recipe, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "step-000000010 is damaged" in result.stderr
    assert "resuming from" in result.stderr and "step-000000005" in result.stderr
    assert list((out / "checkpoints").glob("corrupt-step-000000010.*"))  # kept for inspection
    assert_same_result(out, baselines("full"))


def _tail(proc) -> str:
    """The end of what a stopped run printed (tests.helpers.stop keeps it)."""
    outputs = getattr(proc, "outputs", None) or ("", "")
    return "\n".join(str(x or "")[-3000:] for x in outputs)
