"""A crash-consistency harness: run a short training in a child process, SIGKILL it at random
moments and at named fault points (during the snapshot, during the persist, between the rename
and the parent fsync, during retention), restart it after every kill, and check after each kill
that no committed checkpoint is torn and none was lost. Used by the bounded CI test and by the
long soak in bench/crash_soak.py."""

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
    return subprocess.Popen([sys.executable, "-m", "ember", "run", str(recipe), "--out", str(out),
                             "--no-ledger"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env}, cwd=ROOT)


def lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


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


def crash_and_resume(recipe: Path, out: Path, kills: int, seed: int, max_delay: float = 0.6,
                     progress: Callable[[CrashStats], None] | None = None) -> CrashStats:
    """Kill the run `kills` times (half at random moments while it trains, half at fault
    points), restarting after each; finish it; return what happened."""
    rng = random.Random(seed)
    stats = CrashStats()
    newest = 0
    while stats.kills < kills:
        if rng.random() < 0.5:
            fault = f"{rng.choice(FAULT_POINTS)}@{rng.randint(1, 3)}"
            proc = ember(recipe, out, {"EMBER_FAULT": fault})
        else:
            fault = "random moment"
            proc = ember(recipe, out, {})
            before = lines(out / "metrics.jsonl")
            deadline = time.monotonic() + 60
            while proc.poll() is None and lines(out / "metrics.jsonl") <= before and time.monotonic() < deadline:
                time.sleep(0.005)  # wait until this attempt trains: the start-up is not the target
            time.sleep(rng.uniform(0, max_delay))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
        if proc.returncode == 0:
            break  # it finished before the kill landed: the run is complete
        if proc.returncode != -signal.SIGKILL:
            stats.violations.append(f"kill {stats.kills} ({fault}): exit {proc.returncode}: {err[-500:]}")
            break
        stats.kills += 1
        name = fault.split("@")[0]
        stats.by_fault[name] = stats.by_fault.get(name, 0) + 1
        newest = check(out, newest, stats)
        stats.restarts += 1
        if progress is not None and stats.kills % 50 == 0:
            progress(stats)
    final = ember(recipe, out, {})
    _, err = final.communicate(timeout=600)
    if final.returncode != 0:
        stats.violations.append(f"final resume exited {final.returncode}: {err[-500:]}")
    return stats
