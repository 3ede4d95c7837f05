"""M, the expected time between interruptions of a machine, for Young/Daly's checkpoint interval:
one pure function used by the training loop (checkpoint.every_seconds = "auto"), `ember plan`
and `ember doctor`; the ledger's history of the machine's attempts comes in as a list
(ledger/history.py reads it).

Only attempts that died without saying ("killed": SIGKILL, the OOM killer, a power cut) count as
interruptions: a stop on request checkpoints first and loses nothing, and an error ("failed",
"crashed") says nothing about the machine. Every attempt's time counts, whatever its outcome:
it is time the machine ran without being interrupted."""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_MTBF_HOURS = 24.0
INTERRUPTIONS = ("killed",)


class AttemptTime(NamedTuple):
    """One attempt in the ledger: how long it ran (start to its end or last sign of life), how it ended."""
    seconds: float
    outcome: str | None


class Mtbf(NamedTuple):
    seconds: float
    source: str  # where the figure comes from, in words


def mtbf(setting_hours: float, history: list[AttemptTime], host: str) -> Mtbf:
    """M: the recipe's setting (hours, > 0), else `host`'s attempt time over its interruptions, else the default."""
    if setting_hours > 0:
        return Mtbf(setting_hours * 3600, "[checkpoint] interruption_hours")
    seconds = sum(max(0.0, a.seconds) for a in history)
    failures = sum(1 for a in history if a.outcome in INTERRUPTIONS)
    if failures and seconds > 0:
        return Mtbf(seconds / failures, f"{failures} interruption{'' if failures == 1 else 's'} in "
                                        f"{seconds / 3600:.1f} h of attempts on {host}")
    return Mtbf(DEFAULT_MTBF_HOURS * 3600, f"default {DEFAULT_MTBF_HOURS:g} h (no interruption on record)")
