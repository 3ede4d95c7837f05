"""Chat data, document packing and held-out evaluation in whole runs: interrupted and resumed,
a run ends bit-for-bit where the uninterrupted one did, evaluations included; records longer than
seq_len: a run with nothing left to learn refuses, many emptied records are warned of, an empty
step is a guarded fault, and no figure is given over zero tokens."""

from __future__ import annotations

import json
import math
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

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
                        eval={"holdout": 0.15, "every_steps": 4, "prompts": ["in the", "god created"],
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
    # each prompt a user turn through the chat template, as the training records were; and said
    assert [g["rendered"] for g in kept["generations"]] == ["<|user|>\nin the\n<|assistant|>\n",
                                                            "<|user|>\ngod created\n<|assistant|>\n"]
    for g in kept["generations"]:
        assert f"step 12: {g['prompt']!r} -> {g['completion']!r}" in done.stderr
    generations = (base / "eval" / "generations.jsonl").read_text()
    assert [(g["step"], g["prompt"]) for g in map(json.loads, generations.splitlines())] == [
        (s, p) for s in (4, 8, 12) for p in ("in the", "god created")]

    out = tmp_path / "run"  # stopped after its first evaluation, resumed with the same command
    proc = start_ember("run", recipe, "--out", out, "--set", "train.max_steps=12", warm=True)
    wait_for_step(proc, out / "metrics.jsonl", 6)
    assert stop(proc, signal.SIGTERM) in (0, 75)
    if losses(out)[-1][0] < 12:
        resumed = run_ember("run", recipe, "--out", out, "--set", "train.max_steps=12")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_result(out, base)
    assert evals(out) == evals(base)
    again = json.loads((out / "eval" / "step-000000012.json").read_text())
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in kept.items() if k != "seconds"}
    assert (out / "eval" / "generations.jsonl").read_text() == generations
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
    newest = json.loads((a / "eval" / "step-000000008.json").read_text())
    said = {g["prompt"]: g["completion"] for g in newest["generations"]}
    assert "generations at step 8:" in report.stdout
    assert all(f"{p!r} -> {c!r}" in report.stdout for p, c in said.items()), report.stdout
    cmp = run_ember("compare", a, b)
    assert "held-out loss" in cmp.stdout, cmp.stdout + cmp.stderr
    assert "generations (A at step 8, B at step 8):" in cmp.stdout
    assert all(f"A: {c!r}" in cmp.stdout for c in said.values()), cmp.stdout
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


# Records whose user turn is longer than a row (seq_len 64): cut at the end, nothing of the
# answer is left; the first `short` records have a short user turn instead.
def long_chats(folder: Path, n: int = 40, short: int = 0, name: str = "long.jsonl") -> Path:
    rng = random.Random(1)
    path = folder / name
    with open(path, "w") as f:
        for i in range(n):
            words = rng.choices(WORDS, k=rng.randint(1, 3) if i < short else rng.randint(30, 60))
            msgs = [{"role": "user", "content": " ".join(words)}, {"role": "assistant", "content": f"so {i}"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def rendered_lengths(path: Path) -> list[int]:
    """Tokens per record through the byte model's template ('<|role|>' lines) and its EOS."""
    out = []
    for line in path.read_text().splitlines():
        u, a = (m["content"] for m in json.loads(line)["messages"])
        out.append(len(f"<|user|>\n{u}\n<|assistant|>\n{a}\n".encode()) + 1)
    return out


def long_recipe(folder: Path, data: dict, **sections: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_recipe(folder, data={"seq_len": 64, **data}, **{
        "train": {"max_steps": 4, "micro_batch": 2}, "checkpoint": {"every_steps": 0}, **sections})


def metric_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_nothing_left_to_learn_refuses_before_its_first_step(tmp_path):
    data = long_chats(tmp_path)
    recipe = long_recipe(tmp_path, {"files": [str(data)], "long_records": "truncate"})
    out = tmp_path / "out"
    done = run_ember("run", recipe, "--out", out)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    p95 = int(np.ceil(np.percentile(rendered_lengths(data), 95)))
    assert "nothing to learn: none of the 40 training records keeps a learned token in rows of seq_len 64" in done.stderr
    assert f"seq_len = {p95} would keep 95% of them whole" in done.stderr, done.stderr[-3000:]
    assert f"longest records have {max(rendered_lengths(data))}" in done.stderr
    assert not (out / "metrics.jsonl").exists() or not metric_rows(out)  # not one step
    assert not list((out / "checkpoints").glob("step-*")) and not (out / "final").exists()


def test_keeping_the_answer_learns_at_every_step(tmp_path):
    """The same records with the default long_records = "keep_answer": the prompt loses its
    beginning, every answer is learned whole, and so every step learns tokens."""
    data = long_chats(tmp_path)
    recipe = long_recipe(tmp_path, {"files": [str(data)]})
    out = tmp_path / "out"
    done = run_ember("run", recipe, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "40 longer than seq_len 64: prompt's beginning cut" in done.stderr
    rows = metric_rows(out)
    assert len(rows) == 4 and all(r["tokens"] > 0 and "skipped" not in r for r in rows)
    learning = json.loads((out / "run.json").read_text())["data"]["learning"]
    answers = sum(len(f"so {i}\n") + 1 for i in range(40))  # content, newline, end-of-sequence
    assert learning["learned"] == learning["before"] == answers and learning["emptied"] == 0
    assert f"40 for training ({answers:,} tokens learned)" in done.stderr


def test_many_records_losing_all_their_tokens_are_warned_of_on_console_record_and_dashboard(tmp_path):
    from fastapi.testclient import TestClient

    from ember.ledger import database as store
    from ember.web.api import create_app
    data = long_chats(tmp_path, short=32)  # 8 of 40 (20%) lose all their learned tokens
    assert [n > 64 for n in rendered_lengths(data)] == [False] * 32 + [True] * 8
    recipe = long_recipe(tmp_path, {"files": [str(data)], "long_records": "truncate"},
                         train={"max_steps": 2, "micro_batch": 4}, guard={"max_bad_steps": 50})
    out, ledger = tmp_path / "out", tmp_path / "ledger.db"
    done = run_ember("run", recipe, "--out", out, "--ledger", ledger)
    assert done.returncode == 0, done.stderr[-3000:]
    said = "8 of 40 training records (20%) lose all their learned tokens in rows of seq_len 64"
    assert f"warning: {said}" in done.stderr and "seq_len = " in done.stderr
    notes = json.loads((out / "run.json").read_text())["data"]
    assert said in notes["warnings"][0] and notes["learning"]["emptied"] == 8 and notes["learning"]["cut"] == 8
    assert ": 8 records lost some, 8 all of theirs" in done.stderr
    report = run_ember("report", out, "--ledger", ledger)
    assert f"warning: {said}" in report.stdout, report.stdout + report.stderr
    con = store.connect(ledger)
    run_id = store.find_run(con, str(out))["id"]
    con.close()
    page = TestClient(create_app(None, "t", True, None, ledger=ledger), base_url="http://127.0.0.1",
                      headers={"Authorization": "Bearer t"}).get(f"/runs/{run_id}")
    assert page.status_code == 200 and said in page.text


def test_steps_without_a_learned_token_are_guarded_faults(tmp_path):
    """One record per row (padded packing), three in four of them emptied by the cut: an empty
    step is warned of with its rows and records and never applied; a run of them stops with the
    cause; tokens/s is measured over the steps that learned; a run whose every step was empty
    does not say it completed."""
    data = long_chats(tmp_path, short=10)
    recipe = long_recipe(tmp_path, {"files": [str(data)], "long_records": "truncate", "packing": "padded"},
                         train={"max_steps": 12, "micro_batch": 1})
    stopped = run_ember("run", recipe, "--out", tmp_path / "stopped", "--set", "guard.max_bad_steps=3")
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert "3 bad steps in a row" in stopped.stderr and "no row of these steps holds a learned token" in stopped.stderr
    assert "empty (no learned token in rows [" in stopped.stderr and "completed" not in stopped.stderr

    out = tmp_path / "out"
    done = run_ember("run", recipe, "--out", out, "--set", "guard.max_bad_steps=50")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metric_rows(out)
    empty = [r for r in rows if r["tokens"] == 0]
    assert empty and len(empty) < len(rows) and all(r["skipped"] == "empty" and math.isnan(r["loss"]) for r in empty)
    assert f"step {empty[0]['step']}: empty (no learned token in rows [" in done.stderr
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    bad = torch.load(newest / "train_state.pt", weights_only=True)["run_state"]["bad_steps"]
    assert [b["step"] for b in bad] == [r["step"] for r in empty]
    assert all(b["why"] == "empty" and len(b["rows"]) == 1 and b["records"][0] >= 10 for b in bad)  # a long record
    learned = [r for r in rows if r["tokens"]]
    report = json.loads(run_ember("report", out, "--json").stdout)
    expected = sum(r["tokens"] for r in learned) / sum(r["step_seconds"] for r in learned)
    assert report["throughput"]["tokens_per_second"] == pytest.approx(expected)
    assert report["loss"]["first"] == learned[0]["loss"] and "loss - (no learned token)" in done.stderr

    first_learning = learned[0]["step"]  # a run that ends before it: every step was empty
    assert first_learning > 1
    nothing = run_ember("run", recipe, "--out", tmp_path / "nothing", "--set", "guard.max_bad_steps=50",
                        "--set", f"train.max_steps={first_learning - 1}")
    assert nothing.returncode == 1 and "no step of this run learned a token" in nothing.stderr, nothing.stderr[-3000:]
    assert "completed" not in nothing.stdout and not (tmp_path / "nothing" / "final").exists()


@pytest.mark.parametrize("rule", ["truncate", "drop"])
def test_a_held_out_split_with_nothing_to_evaluate_refuses_before_its_first_step(tmp_path, rule):
    """Every held-out record loses its answer (truncate) or is left out (drop): the training
    split learns, the held-out one has no learned token. With "truncate" the run trained to its
    end, each evaluation 'no tokens', [eval] patience never able to act, and said completed; with
    "drop" it began training, then failed on 'the held-out documents hold 856 tokens, fewer than
    one sequence of seq_len' (untrue, and its remedy, a lower seq_len, drops more). Both are now
    refused before the first step, as a training split with nothing to learn is, saying why."""
    held = long_chats(tmp_path, n=6, name="held.jsonl")
    recipe = long_recipe(tmp_path, {"files": [str(chat_file(tmp_path))], "long_records": rule},
                         eval={"files": [str(held)], "every_steps": 2, "patience": 1})
    out = tmp_path / "out"
    done = run_ember("run", recipe, "--out", out)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    why = {"truncate": "6 of them lost all of theirs: long_records = \"truncate\" keeps the first 64 tokens of each",
           "drop": "all 6 longer than seq_len 64, and long_records = \"drop\" leaves them out"}[rule]
    assert ("[eval] nothing to evaluate: none of the 6 held-out records keeps a learned token in rows of seq_len 64 "
            "(they held ") in done.stderr and why in done.stderr, done.stderr[-3000:]
    assert "Raise [data] seq_len" in done.stderr and "fewer than one sequence" not in done.stderr
    assert not (out / "metrics.jsonl").exists() or not metric_rows(out)  # not one step
    assert not (out / "final").exists()


def test_an_eval_file_that_is_a_training_file_or_a_copy_of_one_is_refused(tmp_path):
    """[eval] files naming a [data] file (or a copy of it) ran, said 'N held out for evaluation'
    and reported a 'held-out loss' over what it trained on, which early stopping and keep_best
    then followed."""
    data = chat_file(tmp_path)
    copy = tmp_path / "copy" / "held.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(data.read_bytes())
    for held, how in ((data, "the same file as"), (copy, "a copy of")):
        recipe = chat_recipe(tmp_path / how.replace(" ", "-"), steps=2)
        done = run_ember("run", recipe, "--out", tmp_path / how.replace(" ", "-") / "out",
                         "--set", f"data.files=['{data}']", "--set", f"eval.files=['{held}']")
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert f"[eval] files: {held} is {how} [data] files' {data}: a held-out loss over the data" in done.stderr
    different = long_chats(tmp_path, n=6, short=6, name="other.jsonl")  # a file of its own is fine
    recipe = chat_recipe(tmp_path / "fine", steps=2)
    done = run_ember("run", recipe, "--out", tmp_path / "fine" / "out", "--set", f"eval.files=['{different}']",
                     "--set", "eval.holdout=0")
    assert done.returncode == 0 and "6 held out for evaluation" in done.stderr, done.stderr[-3000:]


def test_tool_calls_and_completion_records_train_in_one_chat_run(tmp_path):
    """OpenAI tool-call records (tools, tool_calls with content null, tool turns, text parts,
    weight 0) and a file of completion records, in one run: every record a conversation
    through the template, each learning what ember.data.formats.encode says it learns."""
    from ember.data.formats import encode
    from ember.data.tokenizer import ByteTokenizer
    rng = random.Random(2)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    chats, completions = [], []
    for i in range(16):
        word = " ".join(rng.choices(WORDS, k=2))
        call = {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": word})}}
        chats.append({"tools": tools, "messages": [
            {"role": "user", "content": [{"type": "text", "text": f"what is {word}?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": rng.choice(WORDS)},
            {"role": "assistant", "content": f"it is {word}", "weight": i % 2}]})
        completions.append({"prompt": word, "completion": " " + rng.choice(WORDS)})
    for name, records in (("tools.jsonl", chats), ("plain.jsonl", completions)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = long_recipe(tmp_path, {"files": [str(tmp_path / "tools.jsonl"), str(tmp_path / "plain.jsonl")],
                                    "seq_len": 256}, train={"max_steps": 4, "micro_batch": 2})
    out = tmp_path / "out"
    done = run_ember("run", recipe, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("data: chat records (detected; the completion records of plain.jsonl as one-turn conversations)"
            in done.stderr)
    tok = ByteTokenizer()
    as_chat = [{"messages": [{"role": "user", "content": r["prompt"]},
                             {"role": "assistant", "content": r["completion"]}]} for r in completions]
    expected = sum(sum(encode(r, "chat", tok, "text", "assistant", "x").targets) for r in chats + as_chat)
    data = json.loads((out / "run.json").read_text())["data"]
    assert data["format"] == "chat" and data["learning"]["before"] == expected
    assert len(metric_rows(out)) == 4
