"""`pytest --cpu-by-test`: the CPU seconds each test costs the machine, its children included.

The parallel part of `make test` is CPU-bound (tests/README.md): the way to a shorter run is less
CPU, and most of it is spent outside the pytest workers, in the processes the tests start (runs,
services, torchrun's ranks, Slurm's jobs) and in the commands the warm process forks for them. A
worker's own rusage sees none of that, and the kernel's process accounting loses which test a
process belonged to once it is reparented. A control group does not: every process started
while a test runs, whatever becomes of its parent, is counted in the test's group until it ends.

How: the process that starts the workers makes a group under the CPU accounting hierarchy
(cgroup v1's `cpuacct`, or v2's `cpu.stat`) and names it in $EMBER_TEST_CPU_CGROUP; each worker
moves itself into a group of the test's own before the test and back after it; a command the
warm process forks joins the group of the process that asked for it (tests/warm.py). At the end
the first process reads every group (a process the test left running is counted up to then),
prints the most expensive tests and files and writes them all to cpu-by-test.json in the test
cache. It needs root and a writable hierarchy; without them it says so and the run goes on
uncounted. Diagnosis only: `make test` does not turn it on.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path

from ember.cgroup import group_of, hierarchy, join, usage_seconds

ENV = "EMBER_TEST_CPU_CGROUP"  # the run's group: a folder in the hierarchy
_serial = itertools.count()


def start(log: Path) -> str | None:
    """In the first process: make the run's group and name it in $ENV for the workers; the reason
    it cannot be counted, or None."""
    found = hierarchy()
    if found is None:
        return "no cgroup hierarchy with CPU accounting is mounted"
    root, usage = found
    group = root / f"ember-tests-{os.getpid()}"
    try:
        group.mkdir()
        join(group, os.getpid())  # a trial: the first process itself stays out, it hands out work
        join(root, os.getpid())
    except OSError as e:
        shutil.rmtree(group, ignore_errors=True)
        return f"cannot make a control group in {root} ({e.strerror}): it takes root and a writable hierarchy"
    if not (group / usage).exists():
        group.rmdir()
        return f"{root} keeps no {usage} for its groups"
    log.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = json.dumps({"group": str(group), "log": str(log)})
    return None


def join_the_clients(pid: int) -> None:
    """In a command the warm process forked for process `pid`: count it where `pid` is counted."""
    group = group_of(pid)
    if group is not None:
        join(group, os.getpid())


class PerTest:
    """In a worker (or a run without workers): each test in a group of its own, the worker's own
    time between tests (its collection included) in the run's group."""

    def __init__(self, setting: str) -> None:
        said = json.loads(setting)
        self.run, self.log = Path(said["group"]), Path(said["log"]) / f"{os.getpid()}.jsonl"
        join(self.run, os.getpid())

    def begin(self) -> None:
        self.group = self.run / f"{os.getpid()}-{next(_serial)}"
        self.group.mkdir()
        join(self.group, os.getpid())
        self.began = time.monotonic()

    def end(self, nodeid: str) -> None:
        join(self.run, os.getpid())  # the rest of the worker's time is not this test's
        with open(self.log, "a") as f:
            f.write(json.dumps({"id": nodeid, "group": str(self.group),
                                "wall": time.monotonic() - self.began}) + "\n")


def finish(log: Path, top: int = 25) -> list[str]:
    """In the first process, at the end: every test's CPU from its group (the groups removed where
    nothing runs in them any more), written to the test cache; the lines to print."""
    from tests.artifacts import cache_root
    setting = json.loads(os.environ.pop(ENV))
    rows = []
    for f in sorted(log.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            group = Path(row.pop("group"))
            row["cpu"] = usage_seconds(group)
            rows.append(row)
            try:
                group.rmdir()
            except OSError:
                pass  # a process the test left is still in it
    run = Path(setting["group"])
    total = usage_seconds(run)
    try:
        run.rmdir()
    except OSError:
        pass
    shutil.rmtree(log, ignore_errors=True)
    rows.sort(key=lambda r: -r["cpu"])
    files: dict[str, float] = defaultdict(float)
    for r in rows:
        files[r["id"].split("::")[0]] += r["cpu"]
    out = cache_root() / "cpu-by-test.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tests": rows, "files": files, "workers_and_tests": total}, indent=1))
    lines = [f"CPU seconds by test, children included ({len(rows)} tests, {sum(r['cpu'] for r in rows):.0f} CPU-s; "
             f"{total:.0f} with the workers' own time between tests; all of them in {out}):"]
    lines += [f"{r['cpu']:8.1f} {r['wall']:8.1f} s  {r['id']}" for r in rows[:top]]
    lines += ["by file:"] + [f"{c:8.1f}  {name}" for name, c in sorted(files.items(), key=lambda x: -x[1])[:top]]
    return lines
