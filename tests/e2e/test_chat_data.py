"""Chat data, document packing and held-out evaluation in whole runs: interrupted and resumed,
a run ends bit-for-bit where the uninterrupted one did, evaluations included."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pytest

from tests.helpers import assert_same_result, losses, run_ember, start_ember, stop, wait_for_step, write_recipe

pytestmark = pytest.mark.e2e
WORDS = "in the beginning god created heaven and earth light darkness waters firmament day night".split()


def chat_file(folder: Path, n: int = 120) -> Path:
    rng = random.Random(0)
    path = folder / "chat.jsonl"
    with open(path, "w") as f:
        for _ in range(n):
            msgs = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))},
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def chat_recipe(folder: Path, steps: int = 12) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_recipe(folder, data={"files": [str(chat_file(folder))], "seq_len": 96},
                        train={"max_steps": steps, "micro_batch": 2, "grad_accum": 2},
                        checkpoint={"every_steps": 4},
                        eval={"holdout": 0.15, "every_steps": 4, "prompts": ["<|user|>\nin the\n<|assistant|>\n"],
                              "max_new_tokens": 6})


def evals(run: Path) -> list[dict]:
    return [{k: r[k] for k in ("step", "eval_loss", "eval_tokens")}
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]


def test_chat_run_with_evaluation_resumes_bit_for_bit(tmp_path):
    recipe = chat_recipe(tmp_path, steps=400)
    base = tmp_path / "base"
    done = run_ember("run", recipe, "--out", base, "--set", "train.max_steps=12")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out loss" in done.stderr
    e = evals(base)
    assert [r["step"] for r in e] == [4, 8, 12] and all(r["eval_tokens"] > 0 for r in e)
    kept = json.loads((base / "eval" / "step-000000012.json").read_text())
    assert kept["generations"][0]["tokens"] > 0 and len(kept["row_loss"]) == kept["rows"]

    out = tmp_path / "run"  # stopped after its first evaluation, resumed with the same command
    proc = start_ember("run", recipe, "--out", out, "--set", "train.max_steps=12")
    wait_for_step(proc, out / "metrics.jsonl", 6)
    assert stop(proc, signal.SIGTERM) in (0, 75)
    if losses(out)[-1][0] < 12:
        resumed = run_ember("run", recipe, "--out", out, "--set", "train.max_steps=12")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_result(out, base)
    assert evals(out) == evals(base)
    again = json.loads((out / "eval" / "step-000000012.json").read_text())
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in kept.items() if k != "seconds"}
    record = json.loads((base / "run.json").read_text())
    assert record["data"]["format"] == "chat" and record["data"]["packing"] == "documents"
    assert record["data"]["eval"]["documents"] > 0 and record["data"]["train"]["targets"] < record["data"]["train"]["tokens"]


def test_report_and_compare_show_the_held_out_loss(tmp_path):
    recipe = chat_recipe(tmp_path, steps=8)
    a, b = tmp_path / "a", tmp_path / "b"
    for out, lr in ((a, "1e-3"), (b, "3e-3")):
        done = run_ember("run", recipe, "--out", out, "--set", f"optimizer.lr={lr}")
        assert done.returncode == 0, done.stderr[-3000:]
    report = run_ember("report", a)
    assert report.returncode == 0 and "held-out loss" in report.stdout, report.stdout + report.stderr
    cmp = run_ember("compare", a, b)
    assert "held-out loss" in cmp.stdout, cmp.stdout + cmp.stderr
    same = run_ember("compare", a, a)
    assert "held-out loss" in same.stdout and "within the noise" in same.stdout, same.stdout


def test_two_ranks_weigh_tokens_as_one_process_does(tmp_path):
    """Records with different counts of learned tokens on each rank: the step's loss is still
    the token-weighted mean over both (the count is all-reduced first), bit for bit here."""
    recipe = chat_recipe(tmp_path, steps=6)
    one, two = tmp_path / "one", tmp_path / "two"
    for out, extra in ((one, ()), (two, ("--nproc", "2"))):
        done = run_ember("run", recipe, "--out", out, "--no-ledger", "--set", "eval.prompts=[]", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
    assert losses(two) == losses(one) and evals(two) == evals(one)
    for step_file in sorted((one / "eval").glob("step-*.json")):  # the ranks shared the split: every row as one process
        a, b = json.loads(step_file.read_text()), json.loads((two / "eval" / step_file.name).read_text())
        assert (a["row_loss"], a["row_tokens"]) == (b["row_loss"], b["row_tokens"]) and len(a["row_tokens"]) > 2
    assert len({r["tokens"] for r in map(json.loads, (one / "metrics.jsonl").read_text().splitlines())}) > 1
