"""Linux control groups, for CPU accounting only: the mounted hierarchy that counts CPU time, the
CPU seconds a group and the groups under it have used, and the group a process is in.

The kernel charges every process's CPU time to its group as it runs, exited processes included,
so a group's reading is exact where summing its live processes' times would miss a build's
short-lived compilers. cgroup v1's `cpuacct` controller keeps `cpuacct.usage` (nanoseconds);
v2 keeps `usage_usec` in each group's `cpu.stat`. Used by the owner's CPU rule scoped to a group
([cpu] cgroup in owner.toml) and by the tests' per-test CPU count (tests/cpu_by_test.py).
"""

from __future__ import annotations

from pathlib import Path


def hierarchy() -> tuple[Path, str] | None:
    """The mounted CPU accounting hierarchy and its usage file: cgroup v1's cpuacct or, where only
    v2 is mounted, its cpu.stat; None where neither is mounted."""
    v2 = None
    with open("/proc/self/mounts") as f:
        for line in f:
            _, where, kind, options, *_ = line.split()
            if kind == "cgroup" and "cpuacct" in options.split(","):
                return Path(where), "cpuacct.usage"
            if kind == "cgroup2" and v2 is None:
                v2 = Path(where)
    return (v2, "cpu.stat") if v2 is not None else None


def usage_seconds(group: Path) -> float:
    """CPU seconds charged to `group` and the groups under it so far (OSError where it is gone)."""
    if (group / "cpuacct.usage").exists():
        return int((group / "cpuacct.usage").read_text()) / 1e9
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) / 1e6


def group_of(pid: int) -> Path | None:
    """The group of the accounting hierarchy that process `pid` is in; None where no hierarchy is
    mounted (OSError where the process is gone)."""
    found = hierarchy()
    if found is None:
        return None
    root, usage = found
    v1 = usage == "cpuacct.usage"
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (v1 and "cpuacct" in controllers.split(",")) or (not v1 and controllers == ""):
                return root / path.lstrip("/")
    return None


def join(group: Path, pid: int) -> None:
    """Move process `pid`, all its threads, into `group` (root, or the group's owner)."""
    (group / "cgroup.procs").write_text(str(pid))
