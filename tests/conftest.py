"""Shared fixtures: an isolated EMBER_HOME and no model hub."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true",
                     help="run the soak tests at their full counts (`make soak`); without it they "
                          "run at the smaller counts of `make test`")
    parser.addoption("--cpu-by-test", action="store_true",
                     help="count the CPU seconds of each test, the processes it starts included, in "
                          "control groups (root; tests/cpu_by_test.py), and print the most expensive")


# How `make test` spreads the tests over its four workers (on two cores: two workers' waits on
# Slurm's minute, shaped links and paced inputs are filled by the others): a test file is one unit of
# work, kept on one worker (its module fixtures are built once), unless it is listed in SPLIT; each
# test of those is a unit of its own (their expensive inputs are shared across workers:
# tests/artifacts.py). The units are handed out in the order below, the longest first
# (`--no-loadscope-reorder`), so that no long one is left for the end while the others idle: every
# file of 8 s or more, by the sum of its tests' durations (four workers, a quiet run of 2026-12-05;
# tests/README.md), the rest after them in their collection order. A file missing here runs late:
# test_gguf_blocks.py (34 s) was the last unit to start, and the others idled 15-27 s at the end.
SPLIT = {"tests/e2e/test_crash_consistency.py", "tests/e2e/test_resume.py", "tests/e2e/test_defects.py",
         "tests/e2e/test_distributed.py", "tests/e2e/test_distributed_faults.py", "tests/e2e/test_cli.py",
         "tests/e2e/test_distributed_lora.py", "tests/e2e/test_distributed_tp_lora.py",
         "tests/e2e/test_plan.py", "tests/e2e/test_guards.py", "tests/e2e/test_supervise.py",
         "tests/e2e/test_rerun.py", "tests/e2e/test_serve.py"}
# The files whose tests start ranks from a forkserver (tests/parallel/ranks.py): one unit, so that
# one worker starts one forkserver for all of them (its preload imports torch, the Llama model's
# module and peft, ~6 CPU-s), not each worker that drew one of them.
ONE_FORKSERVER = {"tests/parallel/test_ddp.py", "tests/parallel/test_fsdp.py", "tests/parallel/test_fsdp_tp.py",
                  "tests/parallel/test_tp.py"}
# test_serve.py's tests mostly wait (paced jobs, forked warm) and each is a unit: handed out
# second, three of them went to three workers at once beside Slurm's, and the cores idled ~16 s
# at the start of run X (vmstat); after compile's and traced's, which keep both cores busy, they fill in.
LONGEST_FIRST = ["tests/remote/test_slurm.py", "tests/e2e/test_compile.py", "tests/plan/test_traced.py",
                 "tests/e2e/test_serve.py", "tests/e2e/test_resume.py", "tests/e2e/test_crash_consistency.py",
                 "tests/e2e/test_rerun.py", "tests/e2e/test_distributed_faults.py", "tests/infer/test_export.py",
                 "tests/web/test_browser.py", "tests/e2e/test_distributed.py", "tests/plan/test_memory.py",
                 "tests/e2e/test_two_nodes.py", "tests/e2e/test_pipeline.py", "tests/e2e/test_group_signals.py",
                 "tests/e2e/test_pipeline_ddp.py", "tests/bench/test_gpu_script.py",
                 "tests/e2e/test_distributed_tp_lora.py", "tests/e2e/test_defects.py", "tests/e2e/test_coserve.py",
                 "tests/e2e/test_orphans.py", "tests/web/test_dashboard_api.py", "tests/train/test_gguf_blocks.py",
                 "tests/data/test_tokenize.py", "tests/e2e/test_plan.py", "tests/infer/test_engine.py",
                 "tests/train/test_qlora.py", "tests/plan/test_fit.py", "tests/e2e/test_accounting.py",
                 "tests/parallel/test_tp.py", "tests/test_startup.py", "tests/e2e/test_chat_data.py",
                 "tests/test_restart_path.py", "tests/remote/test_second_backend.py", "tests/test_warm.py",
                 "tests/train/test_compiled.py", "tests/parallel/test_fsdp_tp.py",
                 "tests/infer/test_export_checkpoint.py", "tests/test_launchspec.py", "tests/train/test_schedule.py",
                 "tests/sched/test_api.py", "tests/data/test_formats.py", "tests/parallel/test_ddp.py",
                 "tests/e2e/test_distributed_lora.py"]


PEAKS = "EMBER_TEST_PEAKS"  # the cpu_peak.json the pytest run's homes start with (measure_peaks)
RATES = ("recomputed op, ", "nf4 linear, ")  # the CPU's other measured rates, measured with its peaks


def measure_peaks(folder: Path) -> Path:
    """This CPU's matmul peaks, one thread and all its cores (the counts the tests' recipes train
    with), and its other measured rates (RATES: what a recomputed op and a 4-bit linear call cost,
    for the plans' times), measured by ember in a home of their own while the machine is still
    quiet: before the warm process and the workers start. (Measured among the workers' load, a
    4-bit call's extra time came out anything from 0 to 30 ms, and a plan's pick with it: a test
    that asked --fit for LoRA got QLoRA once in seven runs.) tests.helpers.with_cpu_peak gives
    the record to every home the tests hand ember, as a user's home has it after its first run. A record measured under
    load is measured again once the machine is quieter, so one measured among the tests' load was
    measured again tens of times a run, most of them in processes that then imported torch for it.
    Kept in the test cache for the next pytest run (`make test`'s serial part) while it is less
    than a day old, measured quiet and of this machine's keys; each run reads a copy of its own in
    `folder` (another run may replace the cached one meanwhile)."""
    from ember.metrics.peaks import LOADED, cpu_peak_key
    from ember.proc import dies_with_us
    from tests.artifacts import cache_root
    cached = cache_root() / "cpu-peaks" / "cpu_peak.json"
    rates = RATES if importlib.util.find_spec("bitsandbytes") else RATES[:1]  # no 4-bit linear to time without it
    keys = {f"{what}{cpu_peak_key(n)}" for n in {1, os.cpu_count() or 1} for what in ("", *rates)}
    try:
        known = json.loads(cached.read_text())
        fresh = keys <= set(known) and all(time.time() - known[k]["at"] < 86400 and known[k]["others"] is not None
                                           and known[k]["others"] < LOADED for k in keys)
    except (OSError, ValueError, KeyError, TypeError):
        fresh = False
    if not fresh:
        home = folder / "home"
        each = "measured_cpu_peak(n); with_op_cost(Peak(1.0, ''), 'cpu', n)" + \
            ("; measured_dequant_rate(n, dequantize_once)" if len(rates) > 1 else "")
        code = ("import os; from ember.metrics.peaks import Peak, measured_cpu_peak, measured_dequant_rate, "
                "with_op_cost; from ember.plan.dequant import dequantize_once\n"
                f"for n in sorted({{1, os.cpu_count() or 1}}):\n    {each}")
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "EMBER_HOME": str(home)}, cwd=ROOT,
                       check=True, timeout=600, preexec_fn=dies_with_us())  # gone with pytest
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(home / "cache" / "cpu_peak.json", folder / "cached.new")
        os.replace(folder / "cached.new", cached)  # whole, for a run that reads it meanwhile
    mine = folder / "cpu_peak.json"
    shutil.copyfile(cached, mine)
    return mine


_peaks_key = pytest.StashKey[Path]()


_per_test = None  # tests.cpu_by_test.PerTest, under --cpu-by-test
_cpu_log = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    global _per_test
    from tests import cpu_by_test
    if config.getoption("--cpu-by-test") and not hasattr(config, "workerinput"):
        log = Path(tempfile.mkdtemp(prefix="ember-test-cpu-"))
        why = cpu_by_test.start(log)
        if why is None:
            config.stash[_cpu_log] = log
        else:
            print(f"--cpu-by-test: not counted: {why}", file=sys.stderr)
    if cpu_by_test.ENV in os.environ and (hasattr(config, "workerinput") or not config.getoption("numprocesses", None)):
        _per_test = cpu_by_test.PerTest(os.environ[cpu_by_test.ENV])
    if not hasattr(config, "workerinput"):  # the process that starts the workers, or runs the tests
        if not os.environ.get(PEAKS):
            folder = Path(tempfile.mkdtemp(prefix="ember-test-peaks-"))
            config.stash[_peaks_key] = folder
            os.environ[PEAKS] = str(measure_peaks(folder))  # the workers start with it
        from tests import warm
        warm.start_shared()


def pytest_collection_finish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # a run without workers: its tests run here
        from tests import warm
        warm.wait_shared()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        from tests import warm
        warm.stop_shared()
        folder = config.stash.get(_peaks_key, None)
        if folder is not None:
            os.environ.pop(PEAKS, None)
            shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A case marked soak_only runs in `make soak` alone; `make test` deselects it (not a skip: a
    # skip in CI fails the run, see below), and -rs has nothing to explain.
    if not config.getoption("--soak"):
        dropped = [item for item in items if item.get_closest_marker("soak_only")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if not item.get_closest_marker("soak_only")]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.location[0], len(rank)))  # stable: file order within


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Units of work as described above. (xdist's own `loadgroup` cannot do this under pytest 9.2:
    it renames items through `_nodeid`, which pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileOrTest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            if file in ONE_FORKSERVER:
                return "tests/parallel/ranks.py"
            return nodeid if file in SPLIT else file
    return FileOrTest(config, log)


@pytest.fixture(scope="session")
def soak(request: pytest.FixtureRequest) -> bool:
    """True under `make soak`: the tests marked `soak` pick their full counts."""
    return request.config.getoption("--soak")


@pytest.fixture(scope="session", autouse=True)
def ember_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("ember_home")
    os.environ["EMBER_HOME"] = str(home)
    from tests.helpers import with_cpu_peak
    return with_cpu_peak(home)


@pytest.fixture
def cpu_group():
    """A control group of the test's own (root and a writable hierarchy, else skipped saying so);
    every process put in it is killed and the group removed after."""
    from ember.cgroup import hierarchy
    found = hierarchy()
    if found is None or os.geteuid() != 0:
        pytest.skip("a CPU rule scoped to a control group is tested in a group of the test's own: "
                    "it takes root and a mounted cgroup hierarchy that counts CPU time")
    group = found[0] / f"ember-test-cpu-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a control group in {found[0]} ({e.strerror})")
    procs = []
    yield group, procs
    for p in procs:
        p.kill()
        p.wait()
    group.rmdir()


@pytest.fixture
def small_disk(tmp_path):
    """small_disk("1m") mounts a tmpfs of that size: a real full disk. Needs root and mount(2);
    the test is skipped, with the reason, where that is not allowed."""
    mounted = []

    def make(size: str) -> Path:
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(mnt)
        return mnt
    yield make
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=True)


# Every skip says why (`make test` runs pytest -rs), and in CI (CI=true) on a machine that can run
# everything here (root, /dev/fuse) a skipped test fails the run: a green CI must mean the mount,
# full-disk and power-cut tests ran. Skips for hardware this machine lacks (a GPU) are exempt.
_skipped: list[tuple[str, str]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    counted = _per_test
    if counted is not None:
        counted.begin()
    yield
    if counted is not None:
        counted.end(item.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    log = config.stash.get(_cpu_log, None)
    if log is not None:
        from tests import cpu_by_test
        for line in cpu_by_test.finish(log):
            terminalreporter.write_line(line)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason))


def ci_must_run_everything() -> bool:
    return os.environ.get("CI") == "true" and os.geteuid() == 0 and Path("/dev/fuse").exists()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    missed = [(n, r) for n, r in _skipped if "GPU" not in r and "accelerator" not in r]
    if missed and ci_must_run_everything():
        lines = "\n".join(f"  {n}: {r}" for n, r in missed)
        session.config.get_terminal_writer().line(
            f"\nCI runs as root with /dev/fuse, so every test can run here, but these were skipped:\n{lines}",
            red=True)
        session.exitstatus = 1
