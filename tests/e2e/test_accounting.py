"""Accountable runs end to end: a run killed twice and resumed, its report, compare and repro."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.helpers import run_ember, write_recipe


def report(out, *extra):
    result = run_ember("report", out, "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory):
    """One run: SIGKILLed mid-step twice (losing steps each time), then resumed to the end."""
    tmp = tmp_path_factory.mktemp("killed")
    # Synchronous checkpoints: which steps are lost must not depend on a background persist's pace.
    recipe = write_recipe(tmp, train={"max_steps": 30}, checkpoint={"every_steps": 10, "async": False},
                          cost={"device_hour_price": 3.6})
    out = tmp / "run"
    # The lifetimes below are the commands' own: start this worker's warm process (tests/warm.py,
    # a few seconds of imports the first time) before the clock runs.
    assert run_ember("--help").returncode == 0
    lifetimes = []  # (started, ended) around each process, by this process's clock
    for fault in ("train.micro_batch@17", "train.micro_batch@14", None):
        t0 = time.time()
        result = run_ember("run", recipe, "--out", out, env={"EMBER_FAULT": fault} if fault else {})
        lifetimes.append((t0, time.time()))
        assert result.returncode == (-signal.SIGKILL if fault else 0), result.stderr
    return out, lifetimes


def test_buckets_sum_to_the_wall_clock_and_lost_progress_is_the_recomputed_steps(killed_twice):
    out, lifetimes = killed_twice
    r = report(out)
    g = r["goodput"]
    assert r["run"]["status"] == "completed" and r["run"]["attempts"] == 3
    assert [a["outcome"] for a in r["attempts"]] == ["killed", "killed", "completed"]
    # Killed at step 17 with a checkpoint at 10: 6 steps lost (11-16); then resumed from 10 and
    # killed at micro-batch 14 = step 24 with a checkpoint at 20: 3 steps lost (21-23).
    lost = [json.loads(line) for line in (out / "metrics.lost.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lost] == [11, 12, 13, 14, 15, 16, 21, 22, 23]
    assert g["lost_steps"] == 9
    assert g["buckets"]["wasted_progress"] == pytest.approx(sum(x["step_seconds"] for x in lost))
    assert sum(g["buckets"].values()) == pytest.approx(g["wall_seconds"], rel=0.01)
    # Each attempt's recorded span lies within the life of its process as this test saw it, and
    # the run's wall-clock is no more than those lives. (Not a share of them: a bound like "at
    # least 80%" failed once the start-up got faster, 1.77 s of 2.31 s, since the part of a
    # life outside its record, the fork and the exit, is a fixed cost and not a fraction.)
    clock = 0.05  # seconds: a process's start time is read in jiffies (10 ms here)
    for a, (t0, t1) in zip(r["attempts"], lifetimes):
        assert t0 - clock <= a["start"] <= (a["end"] or a["last_seen"]) <= t1 + clock, (a, t0, t1)
    assert g["wall_seconds"] <= sum(t1 - t0 for t0, t1 in lifetimes)
    assert g["buckets"]["other"] >= -0.01 * g["wall_seconds"]
    assert g["buckets"]["checkpoint_restore"] > 0 and g["buckets"]["program_startup"] > 0
    kept = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in kept] == list(range(1, 31))
    assert g["buckets"]["productive"] == pytest.approx(
        sum(x["step_seconds"] - x["data_wait_seconds"] for x in kept), rel=1e-6)
    c = r["cost"]
    assert c["completed"] and c["total"] == pytest.approx(g["wall_seconds"] / 3600 * 3.6)
    assert r["mfu"]["value"] > 0 and r["mfu"]["peak_source"].startswith("measured")
    assert r["where_time_goes"][0]["bucket"] == "program_startup"


def test_report_plots_and_runs_table(killed_twice, tmp_path):
    out, _ = killed_twice
    r = report(out, "--plots", tmp_path / "plots")
    assert sorted(p.rsplit("/", 1)[1] for p in r["plots"]) == ["attempts.png", "goodput.png",
                                                                 "loss.png", "step_time.png"]
    assert all((tmp_path / "plots" / n).stat().st_size > 5000 for n in ("loss.png", "attempts.png"))
    runs = run_ember("runs")
    assert runs.returncode == 0 and r["run"]["id"][:6] in runs.stdout
    text = run_ember("report", r["run"]["id"])  # by run id, human output
    assert text.returncode == 0 and "wasted_progress" in text.stdout and "p99" in text.stdout


def test_compare_identical_perturbed_and_changed(tmp_path):
    base = write_recipe(tmp_path / "a", train={"max_steps": 8})
    runs = {}
    for name, extra in {"a": [], "b": [], "seed": ["--set", "train.seed=8"],
                        "lr": ["--set", "optimizer.lr=0.002"]}.items():
        runs[name] = tmp_path / f"run-{name}"
        assert run_ember("run", base, "--out", runs[name], *extra).returncode == 0

    def compare(x, y, *extra):
        result = run_ember("compare", runs[x], runs[y], "--json", *extra)
        out = json.loads(result.stdout)
        # Each verdict has its own exit code, for scripts (README): 1 stays "error", 2 "usage".
        assert result.returncode == {"identical": 0, "close": 3, "diverged": 4}[out["verdict"]], result.stderr
        return out

    same = compare("a", "b")
    assert same["verdict"] == "identical" and same["weights_equal"] and same["first_differing_step"] is None
    seed = compare("a", "seed")
    assert seed["verdict"] == "diverged" and seed["first_differing_step"] == 1
    assert seed["recipe_changes"] == {"train.seed": [7, 8]}
    lr = compare("a", "lr", "--tolerance", "10")
    assert lr["verdict"] == "close" and lr["recipe_changes"] == {"optimizer.lr": [0.001, 0.002]}
    assert lr["first_differing_step"] == 2  # step 1's loss is computed before the first update


def test_repro_reruns_from_the_record_and_finds_it_identical(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 6})
    assert run_ember("run", recipe, "--out", tmp_path / "orig").returncode == 0
    result = run_ember("repro", tmp_path / "orig", "--out", tmp_path / "again")
    assert result.returncode == 0, result.stderr
    assert "verdict: identical" in result.stdout


def test_report_bad_inputs(tmp_path):
    assert "no such run folder" in run_ember("report", tmp_path / "nope").stderr or \
        "neither a run folder" in run_ember("report", tmp_path / "nope").stderr
    (tmp_path / "foreign").mkdir()
    result = run_ember("report", tmp_path / "foreign")
    assert result.returncode == 1 and "not an ember run folder" in result.stderr
    recipe = write_recipe(tmp_path, train={"max_steps": 4})
    out = tmp_path / "run"
    assert run_ember("run", recipe, "--out", out).returncode == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a torn last line, as a crash mid-write leaves
    before = (out / "metrics.jsonl").read_bytes()
    r = report(out)
    assert any("torn last line" in n for n in r["notes"]) and r["run"]["steps"] == 4
    assert (out / "metrics.jsonl").read_bytes() == before  # nothing rewritten


def test_capacity_reports_duty_cycle_and_prices(killed_twice, ember_home):
    (ember_home / "machine.toml").write_text(
        "[capacity]\non_demand_hour = 2.5\nreserved_hour = 1.6\nhardware_price = 30000\n"
        "watts = 700\nenergy_price_kwh = 0.15\n")
    try:
        result = run_ember("capacity")
        assert result.returncode == 0, result.stderr
        assert "duty cycle" in result.stdout and "break-even duty cycle 64.0%" in result.stdout
        bad = run_ember("capacity", "--since", "last week")
        assert bad.returncode == 1 and "not a date" in bad.stderr
    finally:
        (ember_home / "machine.toml").unlink()


def test_a_background_checkpoint_is_recorded_as_soon_as_it_is_durable(tmp_path):
    """An asynchronous checkpoint is in the ledger and on the console at the first step boundary
    after its persist ends, not at the next checkpoint: a run killed between the two keeps the
    row (report) and the user saw the commit when it happened. Steps are slowed to 0.2 s so the
    persist (milliseconds for this model) ends long before the kill, 6 steps after it began."""
    recipe = write_recipe(tmp_path, train={"max_steps": 40}, checkpoint={"every_steps": 10, "async": True})
    out = tmp_path / "run"
    result = run_ember("run", recipe, "--out", out,
                       env={"EMBER_FAULT": "train.micro_batch@16", "EMBER_FAULT_DATA_DELAY": "0.2"})
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert (out / "checkpoints" / "step-000000010").is_dir()
    assert "checkpoint step-000000010 committed" in result.stderr
    assert [c["step"] for c in report(out)["checkpoints"]] == [10]


def test_a_share_of_peak_above_100_percent_is_never_printed_as_a_figure(tmp_path):
    """A peak below what the run achieves (issue 26, item 5): the recipe's, which is kept and
    flagged; and a CPU peak measured while the machine was busy (seeded here, far too low, in
    the machine's cache), which is measured again at the attempt's end and then used, by name."""
    from ember.metrics.peaks import cpu_peak_key
    recipe = write_recipe(tmp_path / "given", train={"max_steps": 6}, cost={"peak_tflops": 1e-6})
    given = run_ember("run", recipe, "--out", tmp_path / "given" / "run")
    assert given.returncode == 0, given.stderr
    line = next(x for x in given.stdout.splitlines() if "tokens/s per device" in x)
    assert "MFU n/a (the run achieved " in line and "x the peak of 1e-06 TFLOP/s (recipe [cost] peak_tflops), " \
        "which cannot be" in line, line
    assert report(tmp_path / "given" / "run")["mfu"]["value"] is None

    home = tmp_path / "home"
    (home / "cache").mkdir(parents=True)
    seeded = {"flops": 1e3, "at": time.time(), "others": 0.0}  # 1 kFLOP/s, today, on a quiet machine
    (home / "cache" / "cpu_peak.json").write_text(json.dumps({cpu_peak_key(1): seeded}))
    recipe = write_recipe(tmp_path / "busy", train={"max_steps": 6})
    busy = run_ember("run", recipe, "--out", tmp_path / "busy" / "run", env={"EMBER_HOME": str(home)})
    assert busy.returncode == 0, busy.stderr
    assert "which cannot be true: that measurement was low (a busy machine, " in busy.stderr, busy.stderr
    assert "Measured again now" in busy.stderr, busy.stderr
    line = next(x for x in busy.stdout.splitlines() if "tokens/s per device" in x)
    assert "(measured again: at the end of the attempt): fp32 1024x1024 matmul, 1 threads)" in line, line
    share = float(line.split("MFU ")[1].split("%")[0]) / 100
    assert 0 < share <= 1, line
    assert json.loads((home / "cache" / "cpu_peak.json").read_text())[cpu_peak_key(1)]["flops"] > 1e3
