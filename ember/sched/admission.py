"""Which queued jobs start where, and which running jobs make room: one pure function.

    decide(queue, running, devices, now) -> Decision

Rules, in order:
  - Order: effective priority = priority + seconds waited / AGEING_SECONDS (one level per ten
    minutes), ties by the longer wait. Ageing is the no-starvation rule: a job that waits long
    enough overtakes any newer job of a higher priority. Waited is time spent queued without a
    hold of its own: a job back from a preemption or a yield ages from where it left off, not
    over the time it ran, nor over the time it was held by hand (ember.ledger.job_rows.waited_seconds).
  - Packing: a job needs `count` devices with `memory` bytes each (its plan's peak with margin).
    It goes to the devices with the least room that still fit it (best fit), so small jobs share
    a device and a large one keeps a whole device; jobs already placed count against a device.
  - Preemption: a job that does not fit may preempt running jobs of a strictly lower (base)
    priority, lowest first, then the most recently started; only as many as it needs, and only
    when the room they free makes it fit. It starts on a later decision, once they have
    checkpointed and exited; their room is reserved for it meanwhile.
  - Backfill: a lower job may start in room the jobs ahead of it cannot use, unless one of them
    has waited longer than AGEING_SECONDS; then the queue is strict until that one starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.plan.memory import GiB

AGEING_SECONDS = 600.0


@dataclass(frozen=True)
class Want:
    job: int
    priority: int
    submitted: float      # now less the seconds it has waited queued (ageing counts from here)
    memory: int           # bytes per device
    count: int = 1        # devices


@dataclass(frozen=True)
class Holding:
    job: int
    priority: int
    started: float
    memory: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Room:
    index: int
    capacity: int         # bytes jobs may use on it (total less foreign use)


@dataclass
class Decision:
    start: dict[int, tuple[int, ...]] = field(default_factory=dict)   # job -> devices
    preempt: list[int] = field(default_factory=list)
    waiting: dict[int, str] = field(default_factory=dict)            # job -> why it waits


def effective_priority(w: Want, now: float) -> float:
    return w.priority + max(0.0, now - w.submitted) / AGEING_SECONDS


def place(free: dict[int, int], memory: int, count: int) -> tuple[int, ...] | None:
    """Best fit: the `count` devices with the least room that still hold `memory` each."""
    fitting = sorted((room, i) for i, room in free.items() if room >= memory)
    if len(fitting) < count:
        return None
    return tuple(sorted(i for _, i in fitting[:count]))


def decide(queue: list[Want], running: list[Holding], devices: list[Room], now: float) -> Decision:
    """See the module docstring."""
    d = Decision()
    free = {r.index: r.capacity for r in devices}
    for h in running:
        for i in h.devices:
            free[i] = free.get(i, 0) - h.memory
    strict = False
    candidates = sorted(running, key=lambda h: (h.priority, -h.started))
    for w in sorted(queue, key=lambda w: (-effective_priority(w, now), w.submitted, w.job)):
        if strict:
            d.waiting[w.job] = "behind a job that has waited longest (no backfill past it)"
            continue
        where = place(free, w.memory, w.count)
        if where is not None:
            d.start[w.job] = where
            for i in where:
                free[i] -= w.memory
            continue
        # Would preempting lower-priority jobs make room?
        trial, victims = dict(free), []
        for h in candidates:
            if h.priority >= w.priority or h.job in d.preempt:
                continue
            victims.append(h)
            for i in h.devices:
                trial[i] += h.memory
            where = place(trial, w.memory, w.count)
            if where is not None:
                break
        if where is not None:
            d.preempt += [h.job for h in victims]
            for i in where:  # w's share is reserved; the victims hold the rest until they exit
                free[i] = min(free[i], trial[i] - w.memory)
            d.waiting[w.job] = f"preempting job(s) {', '.join(str(h.job) for h in victims)} to make room"
        else:
            d.waiting[w.job] = _no_room(w, devices)
        if now - w.submitted > AGEING_SECONDS:
            strict = True
    return d


def _no_room(w: Want, devices: list[Room]) -> str:
    """Why `w` cannot start even by preempting: too big for any device, too few devices, or
    taken by jobs of its priority or higher."""
    if not devices:
        return "no device may take jobs now (the owner's rules hold every device)"
    usable = [r for r in devices if r.capacity >= w.memory]
    if not usable:
        return (f"memory: it needs {w.memory / GiB:.2f} GiB per device and no device may give a job more "
                f"than {max(r.capacity for r in devices) / GiB:.2f} GiB ([memory] max_share_*, foreign use)")
    if len(usable) < w.count:
        return f"devices: it needs {w.count} devices of {w.memory / GiB:.2f} GiB and only {len(usable)} could hold it"
    return ("priority: the devices that could hold it are taken by jobs of equal or higher priority; "
            "it starts when one ends (or ages past them: one level per ten minutes)")
