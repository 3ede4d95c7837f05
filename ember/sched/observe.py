"""Readings of the machine for the owner's rules: input idle time, other processes' CPU load,
battery, running programs, foreign processes on accelerators. No torch; psutil and NVML.
Other processes' load is the machine's busy CPU time, or [cpu] cgroup's usage (ember.cgroup),
less that of ember's processes counted in it.

Input idle time, first that answers: X11's screensaver extension through `xprintidle` (where
DISPLAY is set and it is installed), then logind's IdleHint/IdleSinceHint of graphical sessions
(`loginctl`, which asks logind over D-Bus; Wayland compositors and GNOME/KDE set it). Text
sessions (ssh, a console) say nothing about a person at the machine and are not counted.
Without a graphical session, idle time is unknown and the activity rules do not hold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections import deque
from pathlib import Path

import psutil

from ember.cgroup import group_of, usage_seconds
from ember.errors import EmberError
from ember.hardware import foreign_accelerator_pids
from ember.paths import ascii_digits
from ember.sched.owner_rules import Observation, OwnerRules, cpu_group


def _answer(argv: list[str]) -> str | None:
    """What `argv` printed, or None when it failed, did not answer within 2 s (logind busy on
    D-Bus, an X server that hangs) or could not run: a reading that does not come is no reading,
    and the scheduler's pass goes on."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=2)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return r.stdout if r.returncode == 0 else None


def idle_seconds() -> tuple[float | None, str]:
    """Seconds since the last input at the desktop, and where that came from."""
    if os.environ.get("DISPLAY") and shutil.which("xprintidle"):
        out = _answer(["xprintidle"])
        if out is not None and ascii_digits(out.strip()):
            return int(out) / 1000, "X11 screensaver extension (xprintidle)"
    if shutil.which("loginctl"):
        sessions = _answer(["loginctl", "list-sessions", "--no-legend"])
        best: float | None = None
        for line in (sessions or "").splitlines():
            if not line.split():
                continue
            shown = _answer(["loginctl", "show-session", line.split()[0], "-p", "Type", "-p", "IdleHint",
                             "-p", "IdleSinceHint", "-p", "Active"])
            props = dict(p.split("=", 1) for p in (shown or "").splitlines() if "=" in p)
            if props.get("Type") not in ("x11", "wayland", "mir") or props.get("Active") != "yes":
                continue
            idle = 0.0
            if props.get("IdleHint") == "yes" and ascii_digits(props.get("IdleSinceHint", "0")):
                idle = max(0.0, time.time() - int(props["IdleSinceHint"]) / 1e6)
            best = idle if best is None else min(best, idle)
        if best is not None:
            return best, "logind IdleHint"
    return None, "no graphical session"


def machine_busy_seconds() -> float:
    """The machine's busy CPU seconds so far, all cores: user, nice, system, irq, softirq, steal."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)


def _inside(pid: int, group: Path) -> bool:
    """Whether process `pid` is in control group `group` (its folder in the hierarchy) or under it."""
    try:
        mine = group_of(pid)
    except OSError:  # gone
        return False
    return mine is not None and group in (mine, *mine.parents)


def process_tree(pids: set[int]) -> set[int]:
    """The PIDs and all their descendants that are alive."""
    out = set()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.add(pid)
            out |= {c.pid for c in p.children(recursive=True)}
        except psutil.Error:
            continue
    return out


class WindowMean:
    """The time-weighted mean of readings, each taken over the interval before it, across the last
    `window` seconds (a reading that ends inside the window counts whole; 0: the last one alone)."""

    def __init__(self) -> None:
        self.readings: deque[tuple[float, float, float]] = deque()  # (end, seconds, value)

    def add(self, end: float, seconds: float, value: float, window: float) -> float:
        """Take a reading; return the mean over the window that ends with it."""
        self.readings.append((end, seconds, value))
        while len(self.readings) > 1 and self.readings[0][0] <= end - window:
            self.readings.popleft()
        weight = sum(s for _, s, _ in self.readings)
        return value if weight <= 0 else sum(s * v for _, s, v in self.readings) / weight


class Observer:
    """Takes an Observation per call; CPU shares are over the time since the previous call,
    averaged over [cpu] average_seconds, of the machine or of [cpu] cgroup."""

    def __init__(self) -> None:
        self._busy: float | None = None
        self._source: str | None = None  # what _busy counts: "" the machine, else the group's name
        self._when = time.monotonic()
        self._ours: dict[int, float] = {}
        self._mean = WindowMean()

    def _cpu(self, ours: set[int], rules: OwnerRules) -> float:
        group = rules.cpu.cgroup
        now = time.monotonic()
        try:  # the group's folder, found once a reading
            where = cpu_group(group) if group else None
            busy = machine_busy_seconds() if where is None else usage_seconds(where)
        except (OSError, EmberError):
            where, busy = None, None  # the group is gone since the rules were read: nothing of it runs
        if group:
            ours = {pid for pid in ours if where is not None and _inside(pid, where)}
        seconds = {}
        for pid in ours:
            try:
                c = psutil.Process(pid).cpu_times()
                seconds[pid] = c.user + c.system
            except psutil.Error:
                continue
        if self._busy is None or busy is None or self._source != group:
            share, interval = 0.0, 0.0  # no earlier reading of the same thing to take a difference from
        else:
            ours_delta = sum(s - self._ours.get(pid, 0.0) for pid, s in seconds.items())
            interval = max(1e-3, now - self._when)
            share = min(1.0, max(0.0, (busy - self._busy) - ours_delta) / (interval * (psutil.cpu_count() or 1)))
        self._busy, self._source, self._when, self._ours = busy, group, now, seconds
        return self._mean.add(now, interval, share, rules.cpu.average_seconds)

    def observe(self, rules: OwnerRules, ours: set[int]) -> Observation:
        """What the rules need, read now; `ours`: the PIDs of ember's jobs and the service."""
        tree = process_tree(ours)
        idle, source = idle_seconds()
        battery = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
        programs: frozenset[str] = frozenset()
        if rules.programs.suspend_while:
            wanted = set(rules.programs.suspend_while)
            names = set()
            for p in psutil.process_iter(["name"]):
                if p.info["name"] in wanted and p.pid not in tree:
                    names.add(p.info["name"])
            programs = frozenset(names)
        foreign = {i: (len(pids), 0) for i, pids in foreign_accelerator_pids(tree).items()}
        on_battery = None if battery is None else not battery.power_plugged
        return Observation(idle, source, self._cpu(tree, rules), on_battery, programs, foreign)
