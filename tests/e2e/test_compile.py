"""[train] compile = true on the CPU, for real, with LoRA (peft) and activation checkpointing:
a compiled run killed mid-run and resumed ends bit-identical to an uninterrupted compiled run,
with the eager model's checkpoint names, no graph break, its kernels loaded from $EMBER_HOME's
compile cache and its compile seconds a goodput bucket. Compiling takes minutes on 2 busy
cores: one cold compile in all (the shared baseline); the resumed run's load from the cache.
(Full fine-tuning compiles the same function over a plain model; graph breaks and their
warning: tests/train/test_compiled.py.)"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

from safetensors.torch import load_file

from tests.artifacts import shared
from tests.helpers import assert_same_result, losses, run_ember, write_recipe

SECTIONS = {"train": {"max_steps": 6, "compile": True, "activation_checkpointing": True},
            "method": {"kind": "lora"}, "checkpoint": {"every_steps": 3, "async": False}}
SLOW = 1200  # seconds: a cold compile on 2 shared cores


def compiled_baseline() -> Path:
    """An uninterrupted compiled run in a fresh $EMBER_HOME (its compile cache starts empty)."""
    def build(folder: Path) -> None:
        result = run_ember("run", write_recipe(folder, **SECTIONS), "--out", folder / "run",
                           env={"EMBER_HOME": str(folder / "home")}, timeout=SLOW)
        assert result.returncode == 0, result.stderr
    return shared("compiled-run", SECTIONS, build)


def compile_records(run: Path) -> dict[str, dict]:
    return json.loads((run / "run.json").read_text())["compile"]


def test_a_compiled_lora_run_killed_and_resumed_ends_bit_identical_from_the_compile_cache(tmp_path):
    base = compiled_baseline()
    home = tmp_path / "home"  # this run's own home, holding the kernels the baseline compiled
    shutil.copytree(base / "home" / "cache" / "inductor", home / "cache" / "inductor")
    env = {"EMBER_HOME": str(home)}
    recipe, out = write_recipe(tmp_path, **SECTIONS), tmp_path / "run"
    killed = run_ember("run", recipe, "--out", out, env={**env, "EMBER_FAULT": "train.micro_batch@5"}, timeout=SLOW)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "checkpoints" / "step-000000003").is_dir()
    done = run_ember("run", recipe, "--out", out, env=env, timeout=SLOW)
    assert done.returncode == 0, done.stderr
    steps = losses(out)
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 6] and steps[-1][1] < steps[0][1]
    assert_same_result(out, base / "run")  # every loss and every final weight, bit for bit
    # the checkpoint is the eager model's: no torch.compile wrapper's '_orig_mod.' in its names
    names = load_file(out / "checkpoints" / "step-000000006" / "model.safetensors").keys()
    assert names == load_file(base / "run" / "checkpoints" / "step-000000006" / "model.safetensors").keys()
    assert not [n for n in names if "_orig_mod" in n]
    # the baseline compiled everything; both attempts here loaded it from $EMBER_HOME's cache
    cold = compile_records(base / "run")["1"]
    assert cold["fx_cache_misses"] > 0 and cold["fx_cache_hits"] == 0
    warm = compile_records(out)
    assert set(warm) == {"1", "2"}
    for attempt in warm.values():
        assert attempt["cache_dir"] == str(home / "cache" / "inductor")
        assert attempt["fx_cache_hits"] > 0 and attempt["fx_cache_misses"] == 0, attempt
        assert attempt["graph_breaks"] == 0, attempt["break_reasons"]  # AC's input-grad hooks are gone
    assert "compiled the step" in done.stderr and "0 miss(es)" in done.stderr
    assert "graph break(s), which run eagerly" not in done.stderr
    # its compile seconds are a goodput bucket of their own, taken out of productive time
    report = run_ember("report", out, "--json", env=env)
    assert report.returncode == 0, report.stderr
    buckets = json.loads(report.stdout)["goodput"]["buckets"]
    assert buckets["compile"] > 0 and buckets["productive"] > 0
