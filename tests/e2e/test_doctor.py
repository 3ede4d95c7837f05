"""`ember doctor` names the right top cause for each injected bottleneck, with no false alarm
on a healthy configuration; its top remedy, applied, does what it predicted; --budget bounds
the whole command; contention from other processes is named as a cause.

This machine has 2 cores shared with other test runs, so (a) contention from them is real and
may rank first: the injected cause must be the first cause other than contention, and
contention, when it leads, must show other processes' CPU use; (b) every time is measured
against a baseline taken in the same process, interleaved, never against a fixed figure.

The tests about the command itself (its time bound, DDP, contention, bad input) run it as a
process; the others call the library in this process (`examine`), which spares them the ~13 s
of imports and model loading a cold process takes here when the machine is busy."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import LlamaConfig, LlamaForCausalLM

from ember.cli.doctor import render
from ember.doctor.diagnose import BF16_FASTER, THRESHOLD, Figures, InputFigures, Skipped, diagnose
from ember.doctor.examine import DoctorReport, Headline, examine
from ember.doctor.experiments.real_loop import measure_baselines
from ember.events import Events
from ember.ledger import database as ledger_store
from ember.recipe import load_recipe
from ember.data.tokenizer import ByteTokenizer
from tests.doctor.test_diagnose import around, baseline, shape
from tests.helpers import ROOT, ember_cmd, run_ember, write_recipe

MS = 1e-3
INPUT_BOUND = Figures(shape(), baseline(data=20, forward=2, backward=2.5, optimizer=0.5, checkpoint=0.5, other=0.5),
                      input=InputFigures(around(25.0), around(5.0, shift=4), 20 * MS, 50.0, 50.0, 2))

# What a doctor process costs beyond --budget: the interpreter and the CLI's imports before the
# clock starts (measured per session: `ember doctor --help`, 0.4-1.5 s here), plus this slack
# for the interpreter's exit with torch loaded (1.2 s on this busy 2-core machine; the doctor
# keeps 1.5 s of the budget for it) and a step or a signal arriving late under load.
SLACK_SECONDS = 3.0
BUDGET = 20  # a doctor process spends ~13 s of it importing and loading here when the machine is busy

pytestmark = pytest.mark.serial  # the doctor measures step time and CPU contention: it runs alone


@pytest.fixture(scope="module")
def startup() -> float:
    """Seconds `ember doctor` takes to start and parse its arguments on this machine now."""
    t0 = time.monotonic()
    assert run_ember("doctor", "--help").returncode == 0
    return time.monotonic() - t0


def doctor(recipe, *args, budget: float = BUDGET, env=None, startup: float = 0.0) -> dict:
    """`ember doctor RECIPE --json` as a process, held to its --budget."""
    t0 = time.monotonic()
    result = run_ember("doctor", recipe, "--budget", str(budget), "--json", *args, env=env, timeout=600)
    wall = time.monotonic() - t0
    assert result.returncode == 0, result.stderr
    assert wall <= budget + startup + SLACK_SECONDS, f"--budget {budget}: took {wall:.1f} s"
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def in_process():
    """examine() in this process: torch's settings a job sets (threads, deterministic kernels) are
    put back afterwards, for the tests that follow in the same process."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()

    def run(target, budget: float = 12, plots=None, ledger=None) -> dict:
        t0 = time.monotonic()
        report = examine(Path(target), budget, 1, [], ledger, Events(), plots)
        assert time.monotonic() - t0 <= budget + 1.0, f"--budget {budget}: took {time.monotonic() - t0:.1f} s"
        return json.loads(json.dumps(asdict(report), default=str))
    yield run
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(strict)


def top(report: dict) -> dict:
    """The first cause other than contention from the other tests on this machine; contention,
    when it ranks above, must show other processes taking the cores."""
    for x in report["findings"]:
        if x["cause"] != "contention":
            return x
        assert report["figures"]["contention"]["others_cores"] >= 0.25 or x["saving_seconds"] == 0
    raise AssertionError("no finding but contention")


SCENARIOS = {  # name: (recipe sections, environment, the cause it injects)
    "slow input": ({}, {"EMBER_FAULT_DATA_DELAY": "0.05"}, "input-bound"),
    "sync checkpoint every step": ({"checkpoint": {"every_steps": 1, "async": False}}, {}, "checkpoint-bound"),
    "micro batch 1": ({"train": {"micro_batch": 1}, "checkpoint": {"every_steps": 0}}, {}, "overhead-bound"),
}


@pytest.fixture(scope="module")
def injected(tmp_path_factory, in_process) -> dict:
    """Each scenario's doctor's report, and, measured right after the report,
    the recipe and its remedied form with the doctor's own baseline (the real loop), their
    stretches in turn. Right after: the share a remedy saves cancels a load that slows the whole
    step alike, not one that slows its parts unlike (a CPU-heavy neighbour slows the compute, not
    the fsync of a checkpoint), so the measurement follows the report it checks as closely as it can.
    (Measured at the end of the module, after the other scenarios' reports, a synchronous
    checkpoint's saving came out 0.59 of the step against 0.82 predicted, beside a `make demo`.)"""
    out = {}
    for name, (sections, env, _) in SCENARIOS.items():
        recipe = write_recipe(tmp_path_factory.mktemp("doctor"), **sections)
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)  # read at each micro-batch (ember.faults)
            report = in_process(recipe)
            r = load_recipe(recipe)
            measured = measure_baselines([r, r.with_changes(top(report)["changes"])], 4.0, Events())
        out[name] = (report, measured)
    return out


def test_slow_input_pipeline_is_input_bound(injected):
    report, _ = injected["slow input"]
    first = top(report)
    assert first["cause"] == "input-bound"
    assert "with an in-memory micro-batch" in first["evidence"][0]
    assert report["figures"]["input"]["loader_batches_per_second"] < 20  # 50 ms a micro-batch
    assert first["changes"] == {"data.workers": report["figures"]["input"]["suggested_workers"]}


def test_synchronous_checkpoint_every_step_is_checkpoint_bound(injected):
    report, _ = injected["sync checkpoint every step"]
    first = top(report)
    assert first["cause"] == "checkpoint-bound"
    # a time-based interval: every_steps must stop forcing its saves
    assert first["changes"]["checkpoint.every_steps"] == 0 and first["changes"]["checkpoint.every_seconds"] == "auto"
    # the real loop's phases: the checkpoint is there, and all of them add up to the step
    b = report["figures"]["baseline"]
    assert b["phases"]["checkpoint"] > 0.3 * b["step_seconds"]
    assert sum(b["phases"].values()) == pytest.approx(b["step_seconds"], rel=0.05)


def test_micro_batch_one_is_overhead_bound(injected):
    report, _ = injected["micro batch 1"]
    first = top(report)
    assert first["cause"] == "overhead-bound"
    assert first["changes"]["train.micro_batch"] >= 4


# Predicted against measured, as the share of the step the remedy saves (which cancels the
# drift of this shared machine's load between the doctor's run and the re-measurement): over
# eight runs of this test, bench/doctor_accuracy.py and a check by hand, at load averages
# 1.7-5.3 on 2 cores, the two differed by at most 0.07 (input 0.00-0.07, checkpoint 0.00-0.06,
# micro batch 0.01-0.03; DDP, in the bench only, 0.11-0.13), while the same recipe's step
# drifted up to 20% between runs a minute apart. 0.2 keeps a margin of ~3x over that and still fails a prediction wrong in
# kind (the reported miss at micro batch 1 was 0.25 of the step).
SHARE_TOLERANCE = 0.20


def test_each_top_remedy_applied_saves_what_it_predicted(injected):
    """The recipe and its remedied form measured with the doctor's own baseline (the real loop),
    their stretches in turn, so the load of other test runs falls on both (`injected`)."""
    for name, (report, (before, after)) in injected.items():
        first = top(report)
        f = report["figures"]["shape"]
        changed = {"train.micro_batch": f["micro_batch"], "train.grad_accum": f["grad_accum"], **first["changes"]}
        # per the original step's tokens: a remedy that grows the optimizer step is scaled back
        scale = f["micro_batch"] * f["grad_accum"] / (changed["train.micro_batch"] * changed["train.grad_accum"])
        predicted = 1 - first["predicted_step_seconds"] / report["figures"]["step_seconds"]
        measured = 1 - after.step_seconds * scale / before.step_seconds
        assert measured > THRESHOLD, f"{name}: the remedy saved {measured:.0%} of the step"
        assert predicted == pytest.approx(measured, abs=SHARE_TOLERANCE), name


def test_healthy_configuration_is_compute_bound(tmp_path, in_process):
    plots = tmp_path / "plots"
    # a 0.1-0.6 s step here, and 2 s of the budget for the plot. Checkpoints at Young/Daly's
    # interval, the doctor's own rule: one every 5 steps (the helper's default) is a checkpoint
    # every second here, which the doctor rightly names when a slow fsync makes its cost show.
    report = in_process(write_recipe(tmp_path, train={"micro_batch": 32}, data={"seq_len": 128},
                                     checkpoint={"every_steps": 0, "every_seconds": "auto"}), plots=plots)
    first = top(report)
    assert first["cause"] == "compute-bound"
    rest = report["findings"][report["findings"].index(first) + 1:]
    assert all(x["saving_share"] < THRESHOLD for x in rest)
    assert all(x["saving_share"] >= 0 for x in report["findings"])
    h = report["headline"]
    assert h["tokens_per_second_per_device"] > 0 and 0 < h["mfu"] and h["step_p99"] >= h["step_p50"]
    assert (plots / "doctor.png").stat().st_size > 10_000
    # an fp32 recipe on a CPU: this CPU's bf16 matmuls measured beside its fp32 ones, and named
    # in the finding where they are much faster (AMX); or, where a loaded machine left too little
    # of the budget for them, skipped, saying so
    peaks = report["figures"]["cpu_peaks"]
    if not peaks:
        assert [s for s in report["skipped"] if s["experiment"] == "precision"], report["skipped"]
        return
    assert set(peaks) == {"fp32", "bf16"} and min(peaks.values()) > 0, peaks
    named = any("bf16 matmuls measured" in e for e in first["evidence"])
    assert named == (peaks["bf16"] >= BF16_FASTER * peaks["fp32"]), (peaks, first["evidence"])


def test_slow_gradient_synchronisation_is_communication_bound(tmp_path, startup):
    """Two processes, DDP over gloo on loopback, a wide layer (54 MB of gradients) and 8 tokens
    of compute a step. On a CPU the all-reduce of a model's gradients costs about what its
    optimizer update costs, so fewer, larger optimizer steps (overhead-bound) may rank level
    with it; synchronisation must be named, with its saving, above compute."""
    folder = tmp_path / "wide"
    LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                                 num_attention_heads=8, max_position_embeddings=64)).save_pretrained(folder)
    ByteTokenizer().save(folder)
    recipe = write_recipe(tmp_path, model={"path": str(folder)}, train={"micro_batch": 1}, data={"seq_len": 8},
                          checkpoint={"every_steps": 0})
    # the DDP processes start from one that imports torch and transformers as this one did:
    # 10-30 s of the budget when the machine is busy (load average 4-5 on its 2 cores)
    report = doctor(recipe, "--ddp", "2", budget=50, startup=startup)
    causes = [x["cause"] for x in report["findings"]]
    assert "communication-bound" in causes, report["skipped"]
    comm = report["findings"][causes.index("communication-bound")]
    assert causes.index("communication-bound") < causes.index("compute-bound"), comm["evidence"]
    assert comm["saving_share"] >= THRESHOLD and comm["changes"] == {"train.grad_accum": 4}
    g = report["figures"]["ddp"]
    assert sorted(g["synced"])[len(g["synced"]) // 2] > sorted(g["unsynced"])[len(g["unsynced"]) // 2]
    assert min(g["allreduce"]) > 0


def test_contention_from_other_processes_is_named(tmp_path):
    """Busy loops on every core, started once the doctor's real loop begins (started earlier,
    they would slow its imports fourfold, and a 2-thread step then takes 0.5-3 s here); a
    recipe that uses both cores."""
    recipe = write_recipe(tmp_path, train={"threads": 2}, checkpoint={"every_steps": 0})
    proc = subprocess.Popen(ember_cmd("doctor", recipe, "--budget", "40", "--json"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    busy = []
    try:
        for line in proc.stderr:
            if "the real loop" in line:
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
                break
        out, err = proc.communicate(timeout=300)
    finally:
        for p in busy:  # ours, by their handles
            p.kill()
            p.wait()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    report = json.loads(out)
    causes = [f["cause"] for f in report["findings"]]
    # Contention leads, or follows only the recipe's own overhead (micro batch 4 of a tiny model:
    # larger micro-batches are measurably cheaper per sample, and under the busy loops the two
    # savings came out 50% and 57% of the step in one CI run).
    assert "contention" in causes and set(causes[:causes.index("contention")]) <= {"overhead-bound"}, \
        json.dumps([report["findings"], report["skipped"], report["figures"].get("contention")], indent=1)
    first = report["findings"][causes.index("contention")]
    assert first["saving_share"] >= THRESHOLD, first
    # Fewer threads is the remedy when it measured faster (25x here, mostly); when the busy loops
    # happened to leave the doctor alone meanwhile, the remedy is the free machine, by the wait.
    if first["changes"] or "run when the machine is free" not in first["remedy"]:
        assert first["changes"] == {"train.threads": 1}, json.dumps([first["evidence"], report["skipped"]], indent=1)
    c = report["figures"]["contention"]
    assert c["others_cores"] >= 0.5
    # Fewer threads measured, or skipped saying why (rounds 25x slower than estimated can leave
    # too few of them): never a figure without samples.
    skipped = [s["reason"] for s in report["skipped"] if s["experiment"] == "contention"]
    assert c["fewer_threads"] == 1 or skipped, json.dumps([c, report["skipped"]], indent=1)


def test_a_small_budget_is_a_bound(tmp_path, startup):
    """--budget 4: a report of what fitted (or, when loading the model alone takes longer, as on
    this machine when it is busy, an error saying so) within 4 s + start-up + slack."""
    t0 = time.monotonic()
    result = run_ember("doctor", write_recipe(tmp_path), "--budget", "4", "--json")
    wall = time.monotonic() - t0
    assert wall <= 4 + startup + SLACK_SECONDS, f"--budget 4 took {wall:.1f} s"
    if result.returncode != 0:
        assert "--budget 4: used up while" in result.stderr or "--budget 4: too small" in result.stderr
        return
    report = json.loads(result.stdout)
    assert report["skipped"] and all(s["reason"] for s in report["skipped"])


def test_a_run_folder_gives_the_runs_own_figures(tmp_path, in_process):
    recipe = write_recipe(tmp_path, train={"max_steps": 12})
    assert run_ember("run", recipe, "--out", tmp_path / "run").returncode == 0
    report = in_process(tmp_path / "run")
    h = report["headline"]
    assert h["source"].startswith("run ") and h["goodput"] > 0
    assert isinstance(h["mfu"], float) and h["mfu"] > 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert set(rows[-1]["phases"]) == {"data", "h2d", "forward", "backward", "sync", "optimizer", "checkpoint"}
    assert sum(rows[-1]["phases"].values()) == pytest.approx(rows[-1]["step_seconds"], rel=0.2, abs=2e-3)
    # Kept in the run folder for the dashboard's run page, which shows the newest diagnosis.
    from ember.doctor.examine import saved_diagnosis
    saved = saved_diagnosis(tmp_path / "run")
    assert saved["headline"] == h and saved["findings"] == report["findings"]


def test_the_checkpoint_interval_counts_this_machines_interruptions(tmp_path, in_process):
    """The ledger's history of this machine: its attempts' time over those killed, as `ember plan`
    and the loop's every_seconds = "auto" count it; not the 24 h default."""
    ledger = tmp_path / "ledger.db"
    con = ledger_store.connect(ledger)
    ledger_store.register_run(con, "r1", tmp_path / "r1", "r1", "digest", {}, 10)
    here = socket.gethostname()
    attempts = [(here, 0, 3600, "killed"), (here, 4000, 7600, "completed"), (here, 8000, 8600, "crashed"),
                ("elsewhere", 0, 99999, "killed")]
    for n, (host, start, end, outcome) in enumerate(attempts, 1):
        ledger_store.start_attempt(con, "r1", n, start, host, 100 + n, "cpu x1", None)
        ledger_store.Ledger(con, "r1", n, print).finish(outcome)
        con.execute("UPDATE attempts SET end = ? WHERE run_id = ? AND attempt = ?", (end, "r1", n))
    con.close()
    report = in_process(write_recipe(tmp_path, checkpoint={"every_steps": 1, "async": False}), ledger=ledger)
    # 3600 + 3600 + 600 s of attempts here, one of them killed: M = 7800 s = 2.17 h
    assert report["figures"]["checkpoint"]["mtbf_seconds"] == 7800, report["skipped"]
    finding = next(x for x in report["findings"] if x["cause"] == "checkpoint-bound")
    assert any("2.17 h between interruptions" in e for e in finding["evidence"]), finding["evidence"]


def test_the_cli_shows_the_breakdown_and_what_was_skipped():
    """In-process: the report of hand-built figures, rendered as the CLI prints it."""
    report = DoctorReport(Headline("the doctor's baseline", 1000.0, None, 0.02, 0.03, None),
                          diagnose(INPUT_BOUND), INPUT_BOUND, None,
                          [Skipped("checkpoint", "the recipe makes no checkpoints")])
    con = Console(file=io.StringIO(), width=200)
    render(report, con)
    text = con.file.getvalue()
    assert "the real loop's step, 26.00 ms" in text and "other 0.50 ms" in text
    assert "skipped checkpoint: the recipe makes no checkpoints" in text
    assert "changes: data.workers = 2; predicted step 11.00 ms" in text
    assert "-%" not in text and "-0" not in text


def test_bad_input(tmp_path):
    result = run_ember("doctor", tmp_path / "nothing")
    assert result.returncode == 1 and "no such run folder or recipe" in result.stderr
    result = run_ember("doctor", write_recipe(tmp_path), "--budget", "0")
    assert result.returncode == 1 and "--budget" in result.stderr
