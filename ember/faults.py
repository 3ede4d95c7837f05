"""Named fault-injection points for crash tests: `EMBER_FAULT=name[@k]` SIGKILLs the process
the k-th time (default the first) execution reaches `point(name)`. With `EMBER_FAULT_ONCE=FILE`
the fault fires only while FILE does not exist, and creates it first: one crash across restarts.
`EMBER_FAULT_RANK=R` limits the fault to rank R of a distributed run; `EMBER_FAULT_HANG=seconds`
makes the fault a hang instead of a kill (the process sleeps there: a deadlocked loader, a rank
that never reaches the collective); `EMBER_FAULT_SIGNAL=SIGTERM` (any signal's name) sends that
signal instead, at that very point (a preemption landing between two micro-batches).
`EMBER_FAULT_DATA_DELAY=seconds` slows every micro-batch the input pipeline produces.
`EMBER_FAULT_FLAGS=name,...` switches on named misbehaviours (flag()). Unset, a point costs one
dict lookup. `EMBER_TRACE_COMMITS=FILE` appends the step of every
checkpoint commit, once it is durable, so a power-cut test knows what it may never lose."""

from __future__ import annotations

import os
import signal
import time

_hits: dict[str, int] = {}


def point(name: str) -> None:
    """Die here, by SIGKILL (or the signal asked), if the environment asks for a fault at this point."""
    spec = os.environ.get("EMBER_FAULT")
    if not spec:
        return
    target, _, nth = spec.partition("@")
    if target != name:
        return
    rank = os.environ.get("EMBER_FAULT_RANK")  # a distributed run: only this rank dies
    if rank is not None and os.environ.get("RANK", "0") != rank:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(nth or 1):
        once = os.environ.get("EMBER_FAULT_ONCE")
        if once:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
        hang = os.environ.get("EMBER_FAULT_HANG")
        if hang:
            time.sleep(float(hang))
            return
        os.kill(os.getpid(), signal.Signals[os.environ.get("EMBER_FAULT_SIGNAL", "SIGKILL")])


def loss_factor(ordinal: int) -> float:
    """A poisoned batch for guard tests: `EMBER_FAULT_LOSS=ordinal:factor,...` multiplies the
    loss of those micro-batches (by micro-batch ordinal in the data stream) by factor ('nan' ok)."""
    spec = os.environ.get("EMBER_FAULT_LOSS")
    if not spec:
        return 1.0
    for item in spec.split(","):
        at, _, factor = item.partition(":")
        if int(at) == ordinal:
            return float(factor)
    return 1.0


def data_delay() -> None:
    """A slow input pipeline for the doctor's tests: `EMBER_FAULT_DATA_DELAY=seconds` per micro-batch."""
    delay = os.environ.get("EMBER_FAULT_DATA_DELAY")
    if delay:
        time.sleep(float(delay))


def flag(name: str) -> bool:
    """A behaviour fault named in `EMBER_FAULT_FLAGS=name,...` (e.g. resume.fresh_optimizer)."""
    return name in os.environ.get("EMBER_FAULT_FLAGS", "").split(",")


def committed(step: int) -> None:
    """Record a durable commit for a crash test watching from outside (`EMBER_TRACE_COMMITS`)."""
    trace = os.environ.get("EMBER_TRACE_COMMITS")
    if trace:
        with open(trace, "a") as f:
            f.write(f"{step}\n")
