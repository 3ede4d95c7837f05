"""What each rank of a distributed run did, and which one the others waited for.

At the end of each attempt every rank hands rank 0 its figures (steps, step-time median and
p99, tokens, seconds per phase of the step breakdown); rank 0 keeps them in OUT/ranks.json and
`ember report` shows them. The rank the others wait for is the one that spends the least time
in `sync` (waiting at the step's loss all-reduce for the slowest rank); what made it slow is the
largest of its own phases: input (`data`), or compute (`forward`, `backward`, `optimizer`).
DDP's gradient all-reduce runs inside backward, so on a rank that waits for a slower one part of
`backward` is waiting too; `sync` is the part that shows on its own. A pipeline stage's wait on
the other stages inside the schedule is its `bubble` (ember.parallel.stages): each rank's median
share of its schedule's time (forward + backward + bubble) over the attempt's steps, against the
schedule's (stages - 1) / (micro-batches + stages - 1).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ember.metrics.stats import percentile

FILE = "ranks.json"
COMPUTE = ("forward", "backward", "optimizer")


@dataclass
class RankFigures:
    rank: int
    steps: int
    step_p50: float
    step_p99: float
    tokens: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    bubble: float | None = None   # a pipeline stage's median bubble share (None off a pipeline)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def sync_share(self) -> float:
        return self.phases.get("sync", 0.0) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RanksSummary:
    attempt: int
    ranks: list[RankFigures]
    tokens_per_second: float      # all ranks together
    spread: float                 # (slowest rank's median step - fastest's) / fastest's
    slowest: int                  # the rank the others wait for
    slowest_cause: str            # "input" or "compute"
    sync_share: float             # mean share of the step spent waiting at the step's all-reduce
    bubble: float | None = None            # a pipeline's: the stages' mean measured bubble share
    bubble_predicted: float | None = None  # and the schedule's (stages - 1) / (micro-batches + stages - 1)


def bubble_share(phases: dict[str, float]) -> float | None:
    """A pipeline stage's bubble as a share of its schedule's time in one step; None off a pipeline."""
    if "bubble" not in phases:
        return None
    schedule = phases.get("forward", 0.0) + phases.get("backward", 0.0) + phases["bubble"]
    return phases["bubble"] / schedule if schedule > 0 else 0.0


def figures(rank: int, seconds: list[float], tokens: int, phases: dict[str, float],
            bubbles: list[float] | None = None) -> RankFigures:
    """One rank's figures; its percentiles are the ones `ember report` gives the run's steps;
    `bubbles`: a pipeline stage's bubble share in each step."""
    p50, p99 = (percentile(seconds, 50), percentile(seconds, 99)) if seconds else (0.0, 0.0)
    return RankFigures(rank, len(seconds), p50, p99, tokens, sum(seconds), dict(phases),
                       statistics.median(bubbles) if bubbles else None)


def summarize(attempt: int, ranks: list[RankFigures], bubble_predicted: float | None = None) -> RanksSummary:
    """The run's view of its ranks (see the module docstring); `bubble_predicted`: a pipeline's."""
    waits = {r.rank: r.phases.get("sync", 0.0) for r in ranks}
    slowest = min(ranks, key=lambda r: (waits[r.rank], -r.step_p50))
    data = slowest.phases.get("data", 0.0)
    compute = sum(slowest.phases.get(k, 0.0) for k in COMPUTE)
    p50s = [r.step_p50 for r in ranks if r.steps]
    spread = (max(p50s) - min(p50s)) / min(p50s) if p50s and min(p50s) > 0 else 0.0
    bubbles = [r.bubble for r in ranks if r.bubble is not None]
    return RanksSummary(attempt, ranks, sum(r.tokens_per_second for r in ranks), spread, slowest.rank,
                        "input" if data > compute else "compute",
                        statistics.fmean(r.sync_share for r in ranks) if ranks else 0.0,
                        statistics.fmean(bubbles) if bubbles else None, bubble_predicted)


def save(folder: Path, summary: RanksSummary) -> None:
    (folder / FILE).write_text(json.dumps(asdict(summary), indent=1))


def load(folder: Path) -> RanksSummary | None:
    try:
        d: dict[str, Any] = json.loads((folder / FILE).read_text())
    except (OSError, ValueError):
        return None
    d["ranks"] = [RankFigures(**r) for r in d["ranks"]]
    return RanksSummary(**d)
