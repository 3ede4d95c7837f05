"""bench/gpu.sh, the GPU script, made to run here: `--cpu-smoke` takes its whole pipeline (the
environment checks, the model folder it writes, ember's real `ember run`, `ember report --json`,
`ember plan --calibrate --json`, the table and the files under $OUT) on CPU with a tiny model and
2 steps, so it is ready for the day a GPU machine is at hand. `make test` runs its two MFU rows
(about 25 s on 2 cores); `make soak` every row (about 2 minutes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, warm_children_env

ROWS = ["full, eager", "full, compiled", "doctor, full, eager", "LoRA, eager", "checkpoint, synchronous",
        "checkpoint, asynchronous", "memory, full", "QLoRA", "memory, QLoRA", "full, 8-bit optimizer states", "memory, LoRA", "LoRA, compiled",
        "full, eager, deterministic off", "co-serving"]
MFU_ROWS = ("full, eager", "LoRA, eager", "QLoRA", "full, 8-bit optimizer states", "full, eager, deterministic off")
MEMORY_ROWS = ("memory, full", "memory, QLoRA", "memory, LoRA")


def gpu_sh(*args: str, out: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """`bash bench/gpu.sh ARGS` with this test's Python; told to stop (and so to stop its command)
    when it outlives `timeout`."""
    env = {**os.environ, "OUT": str(out), "EMBER_PYTHON": sys.executable}
    env.update(warm_children_env(env))  # the ember commands bench/gpu.py starts are forked warm: they skip the imports
    proc = subprocess.Popen(["bash", "bench/gpu.sh", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script is bench/gpu.py by then (exec): it ends its command and exits
        stdout, stderr = proc.communicate()
        pytest.fail(f"bench/gpu.sh ran past {timeout} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def table(text: str) -> dict[str, tuple[str, str, str]]:
    """The markdown table's rows: name -> (configuration, result, detail)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0] not in ("row", "---"):
            rows[cells[0]] = (cells[1], cells[2], cells[3])
    return rows


@pytest.mark.soak
def test_the_gpu_scripts_cpu_smoke_prints_every_row_with_figures_or_the_reason_there_are_none(tmp_path, soak):
    out = tmp_path / "out"
    only = [] if soak else ["--only", "full-eager,lora-eager"]
    done = gpu_sh("--cpu-smoke", "--work", str(tmp_path / "work"), *only, out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = table(done.stdout)
    assert list(rows) == ROWS
    for name in MFU_ROWS if soak else ("full, eager", "LoRA, eager"):
        config, result, detail = rows[name]
        assert config == "fp32, 8 x 64, 2 steps"
        assert re.fullmatch(r"MFU \d+\.\d% \(steps 2-2\)", result), result  # from ember's own report and metrics
        assert re.search(r"[\d,]+ tokens/s; step p50 [\d.]+ ms", detail) and "report over all steps" in detail
    for name in ("full, compiled", "LoRA, compiled"):  # train.compile is absent here, or too slow for a CPU smoke
        assert rows[name][1].startswith("skipped: "), rows[name]
    assert rows["co-serving"][1].startswith("not in this script yet: "), rows["co-serving"]
    if soak:
        for name in ("checkpoint, synchronous", "checkpoint, asynchronous"):
            assert re.match(r"blocked \d+\.\d{3} s \(median of 1 after the first\)", rows[name][1]), rows[name]
            assert rows[name][2].startswith("2 checkpoints of "), rows[name]
        config, result, detail = rows["doctor, full, eager"]  # ember doctor's own ranking and profile
        assert config == "fp32, 8 x 64, --budget 25"
        assert re.fullmatch(r"compute-bound: \d+% of the step|[a-z-]+: its remedy saves [\d.]+ ms \(\d+%\) of a step"
                            r"|no cause above the noise", result), result
        assert detail.startswith("top operators: aten::"), detail
        for name in MEMORY_ROWS:
            assert re.fullmatch(r"plan [\d.]+ MiB, measured [\d.]+ MiB \([+-]\d+\.\d%\)", rows[name][1]), rows[name]
    else:
        for name in ROWS:
            if name not in ("full, eager", "LoRA, eager", "full, compiled", "LoRA, compiled", "co-serving"):
                assert rows[name][1] == "not run (--only)", rows[name]
    # What it printed is what it wrote, with the raw figures and every command's log beside it.
    assert table((out / "gpu-table.md").read_text()) == rows
    raw = json.loads((out / "gpu-raw.json").read_text())
    full = next(r for r in raw["rows"] if r["name"] == "full, eager")
    assert full["figures"]["mfu_report"] > 0 and full["figures"]["steady"]["last_step"] == 2
    assert (out / "logs" / "full-eager.log").exists() and (out / "runs" / "full-eager.report.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the GPU script would run for real")
def test_without_a_cuda_device_the_gpu_script_says_what_is_missing_and_downloads_nothing(tmp_path):
    done = gpu_sh(out=tmp_path / "out", timeout=120)
    assert done.returncode == 3, done.stderr
    assert "no Python here has torch with a CUDA device" in done.stderr
    assert f"{sys.executable}: torch {torch.__version__}" in done.stderr  # what each Python lacks
    assert "|" not in done.stdout and not (tmp_path / "out").exists()
