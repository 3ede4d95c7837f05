"""A crash-consistency harness: run a short training in a child process, SIGKILL it at random
moments and at named fault points (during the snapshot, during the persist, between the rename
and the parent fsync, during retention), restart it after every kill, and check after each kill
that no committed checkpoint is torn and none was lost. `power_cuts` does the same with a
simulated power cut after every kill (tests/powercut_fs.py). Used by the bounded CI tests and by
the long soak in bench/crash_soak.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ember.ckpt.store import CheckpointStore
from tests.helpers import losses, warm_cmd

ROOT = Path(__file__).resolve().parents[1]
FAULT_POINTS = ["ckpt.snapshot_taken", "ckpt.files_written", "ckpt.manifest_written",
                "ckpt.renamed", "ckpt.retired", "train.micro_batch"]


@dataclass
class CrashStats:
    kills: int = 0
    by_fault: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    violations: list[str] = field(default_factory=list)


def ember(recipe: Path, out: Path, env: dict[str, str]) -> subprocess.Popen:
    """`ember run` as a process of this harness's own, forked from the tests' warm process
    (tests.helpers.warm_cmd): a SIGKILL to it kills the run a millisecond later, at another
    random moment, and `communicate` returns once the run and its workers are gone (they hold
    its standard error). A fresh interpreter's start-up (~2.7 CPU-s) was most of an attempt."""
    return subprocess.Popen(warm_cmd("run", recipe, "--out", out, "--no-ledger"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env}, cwd=ROOT)


def lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:  # not yet written, or being replaced by a resume's rewind
        return 0


def check(out: Path, newest_before: int, stats: CrashStats) -> int:
    """After a kill: every committed checkpoint verifies, and the newest did not go back."""
    store = CheckpointStore(out / "checkpoints", keep_last=100)
    committed = store.committed()
    for step, path in committed:
        try:
            store.verify(path)
        except ValueError as e:
            stats.violations.append(f"kill {stats.kills}: committed {path.name} is torn: {e}")
    newest = committed[-1][0] if committed else 0
    if newest < newest_before:
        stats.violations.append(f"kill {stats.kills}: newest committed went from {newest_before} to {newest}")
    return newest


def attempt(recipe: Path, out: Path, rng: random.Random, max_delay: float,
            env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen]:
    """One attempt of the run, killed either at a random moment while it trains or at a named
    fault point; returns what killed it and the reaped process."""
    env = env or {}
    if rng.random() < 0.5:
        fault = f"{rng.choice(FAULT_POINTS)}@{rng.randint(1, 3)}"
        proc = ember(recipe, out, {**env, "EMBER_FAULT": fault})
    else:
        fault = "random moment"
        proc = ember(recipe, out, env)
        before = lines(out / "metrics.jsonl")
        deadline = time.monotonic() + 60
        while proc.poll() is None and lines(out / "metrics.jsonl") <= before and time.monotonic() < deadline:
            time.sleep(0.005)  # wait until this attempt trains: the start-up is not the target
        time.sleep(rng.uniform(0, max_delay))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    proc.err = proc.communicate(timeout=300)[1]
    return fault, proc


def died(fault: str, proc: subprocess.Popen, stats: CrashStats) -> bool:
    """Count a kill; False when the attempt instead finished or failed on its own."""
    if proc.returncode == 0:
        return False  # it finished before the kill landed: the run is complete
    if proc.returncode != -signal.SIGKILL:
        stats.violations.append(f"kill {stats.kills} ({fault}): exit {proc.returncode}: {proc.err[-500:]}")
        return False
    stats.kills += 1
    name = fault.split("@")[0]
    stats.by_fault[name] = stats.by_fault.get(name, 0) + 1
    return True


def crash_and_resume(recipe: Path, out: Path, kills: int, seed: int, max_delay: float = 0.6,
                     progress: Callable[[CrashStats], None] | None = None) -> CrashStats:
    """Kill the run `kills` times (half at random moments while it trains, half at fault
    points), restarting after each; finish it; return what happened."""
    rng = random.Random(seed)
    stats = CrashStats()
    newest = 0
    while stats.kills < kills:
        if not died(*attempt(recipe, out, rng, max_delay), stats):
            break
        newest = check(out, newest, stats)
        stats.restarts += 1
        if progress is not None and stats.kills % 50 == 0:
            progress(stats)
    final = ember(recipe, out, {})
    _, err = final.communicate(timeout=600)
    if final.returncode != 0:
        stats.violations.append(f"final resume exited {final.returncode}: {err[-500:]}")
    return stats


class PowerCutMount:
    """`tests/powercut_fs.py` mounted over `backing` for one attempt; leaving the block
    unmounts it, which cuts the power: the backing folder then holds only what was durable."""

    def __init__(self, backing: Path, mountpoint: Path):
        self.backing, self.mountpoint = backing, mountpoint

    def __enter__(self) -> Path:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "powercut_fs.py"),
                                      str(self.backing), str(self.mountpoint)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"powercut_fs did not mount: {self.proc.communicate()[1][-500:]}")
            time.sleep(0.02)
        return self.mountpoint

    def __exit__(self, *exc) -> None:
        for _ in range(100):
            if subprocess.run(["fusermount", "-u", str(self.mountpoint)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)  # still busy: the killed child's files are being closed
        _, err = self.proc.communicate(timeout=120)
        if self.proc.returncode != 0:
            raise RuntimeError(f"powercut_fs failed: {err[-1000:]}")


def power_cuts(recipe: Path, work: Path, cuts: int, seed: int, baseline: list[tuple[int, float]],
               max_delay: float = 0.6, progress: Callable[[CrashStats], None] | None = None) -> CrashStats:
    """Like crash_and_resume, but every kill is followed by a power cut: whatever was not
    fsynced is forgotten. After each cut, the newest checkpoint whose commit the run had
    reported durable must be there and verify, and the loss history up to it must equal the
    baseline's. The run ends in `work/disk/run`."""
    rng = random.Random(seed)
    stats = CrashStats()
    disk, mnt, trace = work / "disk", work / "mnt", work / "commits.txt"
    disk.mkdir(parents=True, exist_ok=True)
    env = {"EMBER_TRACE_COMMITS": str(trace)}
    newest = 0
    while stats.kills < cuts:
        with PowerCutMount(disk, mnt) as root:
            fault, proc = attempt(recipe, root / "run", rng, max_delay, env)
        if not died(fault, proc, stats):
            break
        newest = check(disk / "run", newest, stats)
        reported = max(map(int, trace.read_text().split()), default=0) if trace.exists() else 0
        kept = [(step, loss) for step, loss in losses(disk / "run")
                ] if (disk / "run" / "metrics.jsonl").exists() else []
        if newest < reported:
            stats.violations.append(f"cut {stats.kills} ({fault}): step {reported} was committed "
                                    f"durably, the disk has only up to {newest}")
        if kept[:reported] != baseline[:reported] or len(kept) < reported:
            stats.violations.append(f"cut {stats.kills} ({fault}): loss history up to step "
                                    f"{reported} differs from the baseline: {len(kept)} lines kept")
        stats.restarts += 1
        if progress is not None and stats.kills % 50 == 0:
            progress(stats)
    # No cut follows the last attempt, so it runs on the disk itself: through the simulated one,
    # whose every write is a call into Python, the rest of the run cost about 20 CPU-seconds.
    final = ember(recipe, disk / "run", env)
    _, err = final.communicate(timeout=600)
    if final.returncode != 0:
        stats.violations.append(f"final resume exited {final.returncode}: {err[-500:]}")
    return stats
