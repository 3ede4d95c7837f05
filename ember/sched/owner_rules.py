"""The owner's rules: `$EMBER_HOME/owner.toml`, validated like a recipe (the same config engine,
ember.config, and the same errors), and one pure function saying which rules hold training right
now. The dataclasses below are the one definition of the file: docs/owner.md is generated from
them (ember.sched.owner_reference), and `ember owner check` prints them resolved. A running service reads the file again when it
changes: RESTART_KEYS wait for a restart, the rest hold at once, and a file that does not validate
leaves the rules in force as they were (`merge`, `RulesStatus`).

    holds(rules, observation, now) -> list[Hold]

Each hold is soft (stop after the micro-batch in progress, keep the process, release cached memory) or
hard (checkpoint and exit: the device is free). Soft holds become hard after
[pause] hard_after_minutes. `ember serve --explain` prints the holds on each job.

    rule                           default       pause   applies to
    activity.suspend_while_active  false         soft    every job, while input was seen within idle_minutes
    activity.accelerators_while_active false     soft    accelerator jobs, while the user is active
    cpu.max_other_load             0 (off)       soft    every job, while non-ember load (mean over
                                                          cpu.average_seconds; of cpu.cgroup alone
                                                          where set) exceeds the share
    schedule.<day>                 all day       hard    every job, outside the day's windows
    power.run_on_battery           false         hard    every job, on battery
    programs.suspend_while         []            soft    every job, while one of these programs runs
    accelerators.pause_on_foreign_process true   soft    the jobs on that accelerator
    accelerators.foreign_memory_max "1GiB"       soft    the jobs on that accelerator
    memory.max_share_active/idle   0.5 / 0.9     admission: jobs' planned host memory within the share
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Literal
from pathlib import Path

from ember.config import build_file, read_toml, setting
from ember.errors import EmberError
from ember.paths import home

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
WINDOW = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-(([01]\d|2[0-3]):[0-5]\d|24:00)$")  # 24:00 ends a day


@dataclass
class ServiceRules:
    host: str = setting("127.0.0.1", "Address the service listens on (`ember serve --host` overrides); "
                        "anything but loopback requires the token for every request.")
    port: int = setting(8765, "Port the service listens on (0: any free port; `--port` overrides).",
                        min=0, max=65535)
    allowed: list[str] = setting(lambda: ["~"], "Folders recipes (and run folders) must lie under, "
                                 "resolved through links; checked at each submit, requeue and job start.", factory=True)
    max_body_bytes: int = setting(1 << 20, "Largest request body accepted, in bytes; a larger one is "
                                  "answered 413 as soon as it passes the limit.", min=1024)
    open_on_loopback: bool = setting(False, "Bound to loopback, answer reading requests (pages, "
                                     "/api GETs, /metrics) and /v1 inference without the token; "
                                     "changes still need it. Off: any program or user of this "
                                     "machine could read the queue and use the model.")


@dataclass
class ActivityRules:
    idle_minutes: float = setting(3.0, "The user is active when input was seen within this many "
                                  "minutes: X11's idle time (xprintidle), else logind's IdleHint of "
                                  "graphical sessions; without a graphical session nobody is active.",
                                  min=0)
    suspend_while_active: bool = setting(False, "Pause all training while the user is active.")
    accelerators_while_active: bool = setting(False, "Allow accelerator jobs while the user is active "
                                              "(BOINC's 'GPU work while in use'; off by default).")


@dataclass
class CpuRules:
    max_other_load: float = setting(0.0, "Pause (soft) while processes other than ember's use more than "
                                    "this share of all cores, e.g. 0.5 = half the machine: the machine's "
                                    "busy CPU time (user, nice, system, irq, softirq, steal) less that of "
                                    "the service, its jobs and their children alive at each reading, "
                                    "averaged over average_seconds; training resumes once the mean is "
                                    "at or below the share (0 = no such rule).", min=0, max=1)
    average_seconds: float = setting(10.0, "The window max_other_load's share is averaged over, in "
                                     "seconds (time-weighted over the service's readings, one every "
                                     "0.5 s), so that a burst shorter than this (a compile, a page "
                                     "load) does not pause training; 0 = the last reading alone.",
                                     min=0, max=600)
    cgroup: str = setting("", "Count only the CPU time of this control group and the groups under "
                          "it, a path in the cgroup hierarchy (/sys/fs/cgroup), e.g. 'user.slice' "
                          "(systemd: what people logged in run, not system services) or "
                          "'user.slice/user-1000.slice' (one person's): the kernel's own count "
                          "(cpu.stat, or cgroup v1's cpuacct.usage), exited processes included, less "
                          "ember's processes inside it. Empty: every process on the machine. It must "
                          "exist when the rules are read; a group removed later counts as idle.")


@dataclass
class MemoryRules:
    max_share_active: float = setting(0.5, "Share of host RAM (0 to 1) that jobs may plan to use while "
                                      "the user is active; admission starts no job past it.", min=0, max=1)
    max_share_idle: float = setting(0.9, "Share of host RAM (0 to 1) that jobs may plan to use while "
                                    "idle.", min=0, max=1)


@dataclass
class PowerRules:
    run_on_battery: bool = setting(False, "Train while the machine runs on battery.")


@dataclass
class ProgramRules:
    suspend_while: list[str] = setting(list, "Pause (soft) while a process of one of these names runs, "
                                       "e.g. ['blender', 'steam']. A name is compared exactly (case "
                                       "too) with the process name the kernel reports (Linux: the "
                                       "executable's file name cut to 15 characters, the full name "
                                       "when the command line's first word starts with it), never "
                                       "with the command line: a script run by an interpreter is "
                                       "'python3', not its file. Processes of ember's jobs do not "
                                       "count. Checked every 0.5 s.", factory=True)


@dataclass
class AcceleratorRules:
    pause_on_foreign_process: bool = setting(True, "Pause jobs on an accelerator when a process that "
                                             "is not ember's appears on it (NVML).")
    foreign_memory_max: str = setting("1GiB", "Pause jobs on an accelerator when processes that are "
                                      "not ember's use more than this much of its memory: a size such "
                                      "as '512MiB' or '2GiB'.")


@dataclass
class ScheduleRules:
    mon: list[str] | None = setting(None, "Monday's windows when training may run, e.g. "
                                    "['00:00-08:00', '18:00-24:00']; unset: all day; []: not at all.")
    tue: list[str] | None = setting(None, "Tuesday's windows.")
    wed: list[str] | None = setting(None, "Wednesday's windows.")
    thu: list[str] | None = setting(None, "Thursday's windows.")
    fri: list[str] | None = setting(None, "Friday's windows.")
    sat: list[str] | None = setting(None, "Saturday's windows.")
    sun: list[str] | None = setting(None, "Sunday's windows.")


@dataclass
class PauseRules:
    hard_after_minutes: float = setting(10.0, "A soft pause (by a rule or by hand) that lasts longer "
                                        "than this many minutes becomes hard: the job checkpoints and "
                                        "exits, freeing its device.", min=0)


@dataclass
class InferenceRules:
    upstream: str = setting("", "Forward /v1 requests to this engine (llama.cpp's llama-server, vLLM, "
                            "Ollama), e.g. 'http://127.0.0.1:8080'; empty: the built-in engine.")
    model: str = setting("builtin:tiny", "The built-in engine's base model (a recipe's model.path).")
    runs: list[str] = setting(list, "Run folders whose latest adapters the built-in engine serves "
                              "(the service's own jobs are added).", factory=True)
    seed: int = setting(0, "builtin:tiny only: the seed its runs were trained with (the base is a "
                        "random initialisation from it).", min=0)
    device: int = setting(0, "The device inference runs on: training there pauses during requests.",
                          min=0)
    idle_gap_seconds: float | Literal["auto"] = setting(
        2.0, "Training resumes after inference has been idle this many seconds; 'auto': chosen from "
        "the measured arrivals and pause latency (hold when the next request is likely near, resume "
        "when it is far; the rule is in ember/sched/idle_gap.py), 2 s until 8 idle periods are seen. "
        "`/api/stats` shows the gap in use.", min=0)
    pause_lease_seconds: float = setting(15.0, "A pause for inference is a lease the service renews "
                                         "while requests run: if the service dies, the job resumes "
                                         "by itself this long after the last renewal.", min=1, max=30)
    enabled: bool = setting(True, "Answer /v1 requests at all.")


@dataclass
class OwnerRules:
    service: ServiceRules = field(default_factory=ServiceRules)
    activity: ActivityRules = field(default_factory=ActivityRules)
    cpu: CpuRules = field(default_factory=CpuRules)
    memory: MemoryRules = field(default_factory=MemoryRules)
    power: PowerRules = field(default_factory=PowerRules)
    programs: ProgramRules = field(default_factory=ProgramRules)
    accelerators: AcceleratorRules = field(default_factory=AcceleratorRules)
    schedule: ScheduleRules = field(default_factory=ScheduleRules)
    pause: PauseRules = field(default_factory=PauseRules)
    inference: InferenceRules = field(default_factory=InferenceRules)


SECTIONS: dict[str, type] = typing.get_type_hints(OwnerRules)


# Read once when the service starts: the address it binds, its HTTP app's limit and access, the
# inference engine it launches and the device it guards. A change to one of these waits for a
# restart (`merge`); every other key is read again at each observation and holds within a second.
RESTART_KEYS = ("service.host", "service.port", "service.max_body_bytes", "service.open_on_loopback",
                "inference.upstream", "inference.model", "inference.runs", "inference.seed",
                "inference.device", "inference.enabled")


def owner_file() -> Path:
    """$EMBER_HOME/owner.toml, the file `ember serve` reads."""
    return home().owner_toml


def load_rules(path: Path | None = None) -> OwnerRules:
    """owner.toml (absent: every default), parsed by the config engine (ember.config): unknown keys,
    wrong types, bad ranges and bad windows, sizes and URLs are refused naming the file, the line
    and the key."""
    from ember.hardware import parse_size
    path = path or owner_file()
    if not path.is_file():
        return OwnerRules()
    raw, source = read_toml(path)
    rules = build_file(OwnerRules, raw, source)
    for day in DAYS:
        for w in getattr(rules.schedule, day) or []:
            if not WINDOW.match(w) or minutes(w.split("-")[0]) >= minutes(w.split("-")[1]):
                raise EmberError(f"{source.where('schedule', day)}: window {w!r}: write HH:MM-HH:MM "
                                 f"with the start before the end, e.g. '18:00-24:00'")
    for i, folder in enumerate(rules.service.allowed):
        try:
            Path(folder).expanduser()
        except RuntimeError as e:  # '~nosuchuser/x': checked at each submit, where it would be a 500
            raise EmberError(f"{source.where('service', 'allowed')}[{i}]: {folder!r}: {e} (no such user's "
                             f"home); write the folder's absolute path") from None
    if rules.cpu.cgroup:
        cpu_group(rules.cpu.cgroup, source.where("cpu", "cgroup"))
    parse_size(rules.accelerators.foreign_memory_max, source.where("accelerators", "foreign_memory_max"))
    if rules.inference.upstream and not re.match(r"^https?://[^/\s]+", rules.inference.upstream):
        raise EmberError(f"{source.where('inference', 'upstream')} = {rules.inference.upstream!r}: "
                         f"write a URL like 'http://127.0.0.1:8080'")
    return rules


def cpu_group(name: str, where: str = "[cpu] cgroup") -> Path:
    """The folder of control group `name` in the CPU accounting hierarchy; refused naming `where`
    when the name is not a path inside it, no hierarchy is mounted or the group does not exist."""
    from ember.cgroup import hierarchy
    parts = Path(name).parts
    if Path(name).is_absolute() or not parts or ".." in parts:
        raise EmberError(f"{where} = {name!r}: write a group's path inside the cgroup hierarchy, "
                         f"e.g. 'user.slice' (`systemd-cgls` lists them)")
    found = hierarchy()
    if found is None:
        raise EmberError(f"{where} = {name!r}: no cgroup hierarchy that counts CPU time is mounted "
                         f"here; remove the key to count every process")
    group = found[0] / name
    if not (group / found[1]).is_file():
        raise EmberError(f"{where} = {name!r}: no such group in {found[0]} (no {group / found[1]}); "
                         f"`systemd-cgls` lists the groups")
    return group


def merge(running: OwnerRules, new: OwnerRules) -> tuple[OwnerRules, list[dict]]:
    """What a running service applies of `new`: every key but RESTART_KEYS, which keep their
    running values; and those whose value in `new` differs, as {key, file, in_force}."""
    merged, waiting = copy.deepcopy(new), []
    for dotted in RESTART_KEYS:
        section, key = dotted.split(".")
        now, wanted = getattr(getattr(running, section), key), getattr(getattr(new, section), key)
        setattr(getattr(merged, section), key, copy.deepcopy(now))
        if wanted != now:
            waiting.append({"key": dotted, "file": wanted, "in_force": now})
    return merged, waiting


@dataclass
class RulesStatus:
    """What a running service made of owner.toml: for `ember queue` and the dashboard."""
    path: str
    loaded_at: float                      # when the rules in force were read (seconds since the epoch)
    error: str | None = None              # the file as it is now does not validate: the rules before it hold
    restart: list[dict] = field(default_factory=list)  # {key, file, in_force}: changes waiting for a restart

    def notes(self) -> list[str]:
        """The status in words; empty when the service applies the file as it is."""
        out = []
        if self.error:
            when = dt.datetime.fromtimestamp(self.loaded_at).strftime("%Y-%m-%d %H:%M:%S")
            out.append(f"owner.toml does not validate, so the service keeps the rules it loaded at {when}: "
                       f"{self.error}. Fix the file (`ember owner check` says what is wrong); the service "
                       f"reads it again as soon as it changes.")
        if self.restart:
            changes = "; ".join(f"{c['key']} = {json.dumps(c['file'])} (in force: {json.dumps(c['in_force'])})"
                                for c in self.restart)
            out.append(f"{self.path}: {changes}: read only when the service starts; restart it for this to "
                       f"take effect (`systemctl --user restart ember`, or stop and start `ember serve`).")
        return out


def minutes(hhmm: str) -> int:
    h, m = hhmm.split(":")
    return int(h) * 60 + int(m)


@dataclass(frozen=True)
class Observation:
    """The machine as the service saw it a moment ago (ember.sched.observe)."""
    idle_seconds: float | None                 # since the last input; None: no desktop session found
    idle_source: str
    other_cpu_share: float                     # of all cores, processes other than ember's jobs
                                               # (in [cpu] cgroup where set), mean over average_seconds
    on_battery: bool | None
    programs: frozenset[str] = frozenset()     # names of running processes the rules mention
    foreign: dict[int, tuple[int, int]] = field(default_factory=dict)  # accelerator -> (processes, bytes)


@dataclass(frozen=True)
class Hold:
    rule: str                      # the owner.toml key that holds, or "yield"
    kind: str                      # "soft" or "hard"
    devices: tuple[int, ...] | None  # None: every device
    accelerators_only: bool
    detail: str


def in_window(schedule: ScheduleRules, now: dt.datetime) -> tuple[bool, str]:
    """Whether `now` (local time) is inside the day's windows, and the day's rule."""
    day = DAYS[now.weekday()]
    windows = getattr(schedule, day)
    if windows is None:
        return True, f"{day}: all day"
    t = now.hour * 60 + now.minute
    ok = any(minutes(w.split("-")[0]) <= t < minutes(w.split("-")[1]) for w in windows)
    return ok, f"{day}: {', '.join(windows) or 'no windows'}"


def active(rules: OwnerRules, obs: Observation) -> bool:
    return obs.idle_seconds is not None and obs.idle_seconds < rules.activity.idle_minutes * 60


def holds(rules: OwnerRules, obs: Observation, now: dt.datetime) -> list[Hold]:
    """The owner's rules that hold training now (see the module docstring)."""
    from ember.hardware import parse_size
    out = []
    if active(rules, obs):
        idle = f"input {obs.idle_seconds:.0f} s ago ({obs.idle_source}), within idle_minutes = " \
               f"{rules.activity.idle_minutes:g}"
        if rules.activity.suspend_while_active:
            out.append(Hold("activity.suspend_while_active", "soft", None, False, idle))
        elif not rules.activity.accelerators_while_active:
            out.append(Hold("activity.accelerators_while_active", "soft", None, True, idle))
    limit = rules.cpu.max_other_load
    if limit and obs.other_cpu_share > limit:
        who = f"group {rules.cpu.cgroup} uses" if rules.cpu.cgroup else "other processes use"
        out.append(Hold("cpu.max_other_load", "soft", None, False,
                        f"{who} {obs.other_cpu_share:.0%} of all cores (mean over "
                        f"{rules.cpu.average_seconds:g} s), above {limit:.0%}"))
    ok, which = in_window(rules.schedule, now)
    if not ok:
        out.append(Hold(f"schedule.{DAYS[now.weekday()]}", "hard", None, False,
                        f"{now:%a %H:%M} is outside the windows ({which})"))
    if obs.on_battery and not rules.power.run_on_battery:
        out.append(Hold("power.run_on_battery", "hard", None, False, "the machine runs on battery"))
    running = sorted(obs.programs & set(rules.programs.suspend_while))
    if running:
        out.append(Hold("programs.suspend_while", "soft", None, False, f"{', '.join(running)} running"))
    cap = parse_size(rules.accelerators.foreign_memory_max, "foreign_memory_max")
    for index, (count, used) in sorted(obs.foreign.items()):
        if count and rules.accelerators.pause_on_foreign_process:
            out.append(Hold("accelerators.pause_on_foreign_process", "soft", (index,), True,
                            f"{count} process(es) that are not ember's on accelerator {index}"))
        elif used > cap:
            out.append(Hold("accelerators.foreign_memory_max", "soft", (index,), True,
                            f"other processes use {used / 2**30:.2f} GiB on accelerator {index}"))
    return out


def applies(hold: Hold, devices: tuple[int, ...], accelerator: bool) -> bool:
    """Whether a hold stops a job on `devices` (accelerator: not host RAM)."""
    if hold.accelerators_only and not accelerator:
        return False
    return hold.devices is None or bool(set(hold.devices) & set(devices))


def ram_share(rules: OwnerRules, obs: Observation) -> float:
    """The share of host RAM jobs may plan to use now."""
    return rules.memory.max_share_active if active(rules, obs) else rules.memory.max_share_idle
