"""The gate: one pure function, `check(request, registry, targets, ledger_view) -> Decision`.

Deny by default: a job may go to a remote target only when nothing below is violated, and every
violation is listed at once (a user fixes them all in one go). Nothing here reads a file, the
clock or the ledger: the caller hashes the data (`Request.observed`), reads the month's spend
(`LedgerView`) and passes the time (`Request.now`), so a decision is a function of its inputs
and the tests are tables.

A data file counts as every dataset that holds it (ember.policy.registry.holdings: by path after
realpath, or by content): each one's allowed_targets and expiry apply, and its classification is
the most restrictive of theirs. It is staged from the dataset that lists it most closely, and that
dataset is staged whole: every path it lists counts so too, though the job reads only some of it.

    code                 violated when
    unknown-target       the target is not in targets.toml
    unregistered-file    a data file the recipe reads is listed by no registered dataset
    dataset-target       the allowed_targets of a dataset holding a file the job reads or stages do not name
                         the target
    classification       the target does not allow a file's classification (its most restrictive dataset's)
    fingerprint          a staged dataset's files changed since it was registered (or were not hashed)
    expired              the permission of a dataset holding a file the job reads or stages ended
    recipe-changed       a continued job's recipe no longer resolves to the one it was submitted with
    missing-limit        max wall hours, device-hours, cost or nodes not stated
    invalid-limit        a limit (or --nodes) that is not a positive finite number
    nodes                the job asks for more nodes than its own limit
    above-cap            a limit above the target's cap for one job
    prediction-unknown   the plan cannot predict the job's device-hours or cost
    predicted-over       the plan's prediction above a limit (or above the cap, where the limit is missing)
    monthly-budget       this month's committed spend on the target plus this job's cost limit above
                         the target's monthly cap
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ember.policy.registry import Registry, holdings, most_restrictive
from ember.policy.targets import Target, Targets


@dataclass(frozen=True)
class Limits:
    """What a remote job may spend; None is a missing limit (a refusal, never a default)."""
    max_wall_hours: float | None = None
    max_device_hours: float | None = None
    max_cost: float | None = None
    max_nodes: int | None = None


@dataclass(frozen=True)
class Prediction:
    """The plan's figures for the job on the target; None where the plan cannot tell."""
    device_hours: float | None
    cost: float | None
    wall_hours: float | None
    how: str = ""


@dataclass(frozen=True)
class Request:
    recipe_digest: str
    files: tuple[str, ...]                # every data path the recipe reads, resolved (realpath)
    observed: Mapping[str, str]           # dataset name -> its fingerprint as hashed just now
    target: str
    limits: Limits
    nodes: int
    prediction: Prediction
    now: float                            # seconds since the epoch, UTC
    # data path (read, or listed by a staged dataset) -> its files' SHA-256
    contents: Mapping[str, frozenset[str]] = field(default_factory=dict)
    registered: Mapping[str, frozenset[str]] = field(default_factory=dict)  # dataset -> its files' SHA-256
    continues: str = ""                   # a continued job: the recipe digest it was submitted with


@dataclass(frozen=True)
class LedgerView:
    """What the ledger says about spending: the month's committed spend on the request's target
    (finished jobs at their cost, unfinished ones at their cost limit)."""
    month: str
    month_spend: float


@dataclass(frozen=True)
class Violation:
    code: str
    message: str


@dataclass(frozen=True)
class DatasetUse:
    name: str
    fingerprint: str        # as registered
    observed: str | None    # as hashed for this decision (staged datasets)
    classification: str
    staged: bool = True     # False: it only holds files the job reads through another dataset


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reasons: tuple[Violation, ...]
    datasets: tuple[DatasetUse, ...] = field(default=())

    @property
    def codes(self) -> list[str]:
        return [v.code for v in self.reasons]


LIMIT_CAPS = (("max_wall_hours", "max_wall_hours", "h"), ("max_device_hours", "max_device_hours", "device-h"),
              ("max_cost", "max_cost_per_job", ""), ("max_nodes", "max_nodes", "nodes"))


def check(request: Request, registry: Registry, targets: Targets, ledger_view: LedgerView) -> Decision:
    """Whether the request may go to its target, with every reason it may not."""
    out: list[Violation] = []
    target = targets.get(request.target)
    if target is None:
        known = ", ".join(sorted(targets)) or "none defined (targets.toml)"
        out.append(Violation("unknown-target", f"target '{request.target}' is not in targets.toml; known: {known}"))
    uses = _datasets(request, registry, target, out)
    if request.continues and request.continues != request.recipe_digest:
        out.append(Violation("recipe-changed", f"the recipe resolves to {request.recipe_digest[:12]}..., the job "
                             f"was submitted with {request.continues[:12]}...: a job continues the recipe it "
                             f"ran; restore it (and give the same --set), or submit a new job"))
    _limits(request, target, out)
    if target is not None:  # a prediction is for a target: with none, unknown-target says it all
        _prediction(request, target, out)
    if target is not None and request.limits.max_cost is not None:
        total = ledger_view.month_spend + request.limits.max_cost
        if total > target.max_cost_per_month:
            out.append(Violation("monthly-budget", f"{ledger_view.month}: {ledger_view.month_spend:.4g} "
                                 f"{target.currency} committed on '{target.name}' so far + this job's max cost "
                                 f"{request.limits.max_cost:g} = {total:.4g} > the monthly cap "
                                 f"{target.max_cost_per_month:g}"))
    return Decision(not out, tuple(out), tuple(uses))


def _datasets(request: Request, registry: Registry, target: Target | None,
              out: list[Violation]) -> list[DatasetUse]:
    read = holdings(list(request.files), registry, request.contents, request.registered)
    for f, h in read.items():
        if h.source is None:
            out.append(Violation("unregistered-file", f"{f} is listed in no registered dataset: it may be used "
                                 f"locally, never remotely; `ember data register` it"))
    staged = {h.source for h in read.values() if h.source is not None}
    # A staged dataset is sent whole, not only the files the job reads: every path it lists is
    # held too (by path, or by content: `request.contents[path]`), and whoever holds one constrains the job.
    sent = {p: name for name in sorted(staged) for p in registry[name].paths if p not in read}
    held = read | holdings(list(sent), registry, request.contents, request.registered)
    uses = []
    for name in sorted({n for h in held.values() for n in h.holders}):
        ds = registry[name]
        observed = request.observed.get(name) if name in staged else None
        uses.append(DatasetUse(name, ds.fingerprint, observed, ds.classification, name in staged))
        reads = [f for f, h in read.items() if name in h.holders]
        why = ([", ".join(reads) + ", which this job reads"] if reads else []) + [
            f"a file of {p}, which this job stages with '{by}'" for p, by in sent.items() if name in held[p].holders]
        via = "" if name in staged else f" (it holds {'; '.join(why)})"
        if request.target not in ds.allowed_targets:
            allowed = ", ".join(ds.allowed_targets) or "none (local only)"
            out.append(Violation("dataset-target", f"dataset '{name}'{via} may not go to '{request.target}'; its "
                                 f"allowed_targets: {allowed}"))
        if name in staged and observed != ds.fingerprint:
            what = "was not hashed" if observed is None else "changed since it was registered"
            out.append(Violation("fingerprint", f"dataset '{name}' {what} ({ds.source}); check it, then "
                                 f"`ember data register` it again"))
        end = ds.expiry()
        if end is not None and request.now >= end:
            out.append(Violation("expired", f"dataset '{name}'{via}: its permission ended with {ds.expires}"))
    if target is not None:
        _classification(held, registry, target, out)
    return uses


def _classification(held: dict, registry: Registry, target: Target, out: list[Violation]) -> None:
    """Each file is as restricted as the most restrictive dataset holding it: one violation per
    deciding dataset whose classification the target does not allow."""
    decided: dict[str, list[str]] = {}
    for f, h in held.items():
        if h.holders:
            worst = most_restrictive([registry[n].classification for n in h.holders])
            decider = next(n for n in h.holders if registry[n].classification == worst)
            decided.setdefault(decider, []).append(f)
    allowed = ", ".join(target.allowed_classifications) or "none"
    for name, files in sorted(decided.items()):
        ds = registry[name]
        if ds.classification in target.allowed_classifications:
            continue
        message = f"dataset '{name}' is {ds.classification}; '{target.name}' allows {allowed}"
        for f in files:
            also = [f"'{n}' ({registry[n].classification})" for n in held[f].holders if n != name]
            if also:
                message += (f"; {f} is also in {', '.join(also)}, and a file counts as the most restrictive "
                            f"dataset that holds it")
        out.append(Violation("classification", message))


def _limits(request: Request, target: Target | None, out: list[Violation]) -> None:
    lim = request.limits
    missing = [name for name, _, _ in LIMIT_CAPS if getattr(lim, name) is None]
    if missing:
        out.append(Violation("missing-limit", f"{', '.join(missing)} not stated: a remote job states every "
                             f"limit (--max-wall-hours, --max-device-hours, --max-cost, --max-nodes)"))
    given = [(name, getattr(lim, name)) for name, _, _ in LIMIT_CAPS if getattr(lim, name) is not None]
    for name, value in given + [("nodes", request.nodes)]:
        if not valid(value):
            out.append(Violation("invalid-limit", f"{name} = {value:g}: a limit (and --nodes) is a positive "
                                 f"finite number"))
    if valid(lim.max_nodes) and request.nodes > lim.max_nodes:
        out.append(Violation("nodes", f"--nodes {request.nodes} is above the job's max_nodes {lim.max_nodes}"))
    if target is None:
        return
    for name, cap_name, unit in LIMIT_CAPS:
        value, cap = getattr(lim, name), getattr(target, cap_name)
        if valid(value) and value > cap:  # an invalid one: invalid-limit says it
            out.append(Violation("above-cap", f"{name} {value:g}{' ' + unit if unit else ''} is above "
                                 f"'{target.name}''s cap {cap_name} = {cap:g}"))
    if lim.max_nodes is None and request.nodes > target.max_nodes:
        out.append(Violation("above-cap", f"--nodes {request.nodes} is above '{target.name}''s cap max_nodes "
                             f"= {target.max_nodes}"))


def _prediction(request: Request, target: Target, out: list[Violation]) -> None:
    p, lim = request.prediction, request.limits
    unknown = [n for n in ("device_hours", "cost", "wall_hours") if getattr(p, n) is None]
    if unknown:
        out.append(Violation("prediction-unknown", f"the plan cannot predict the job's {', '.join(unknown)} "
                             f"({p.how or 'no estimate'}): it cannot be shown to fit its limits"))
    pairs = (("device_hours", "max_device_hours", "max_device_hours"), ("cost", "max_cost", "max_cost_per_job"),
             ("wall_hours", "max_wall_hours", "max_wall_hours"))
    for field_name, limit_name, cap_name in pairs:
        value = getattr(p, field_name)
        if value is None:
            continue
        bound, what = getattr(lim, limit_name), limit_name
        if bound is not None and not valid(bound):
            continue  # invalid-limit says it
        if bound is None:
            bound, what = getattr(target, cap_name), f"'{target.name}''s cap {cap_name}"
        if bound is not None and value > bound:
            out.append(Violation("predicted-over", f"the plan predicts {field_name.replace('_', ' ')} "
                                 f"{value:.4g}, above {what} {bound:g}"))


def valid(value: float | None) -> bool:
    """Whether a stated limit is usable: a positive finite number."""
    return value is not None and math.isfinite(value) and value > 0


def wall_budget_seconds(limits: Limits, devices: int, price: float) -> float:
    """The wall-clock a job may hold on `devices` devices before one of its limits is reached:
    the least of its wall time, its device-hours over its devices, and its cost over their price."""
    seconds = [limits.max_wall_hours * 3600, limits.max_device_hours * 3600 / devices]
    if price > 0:
        seconds.append(limits.max_cost / (price * devices) * 3600)
    return min(seconds)


def month_of(now: float) -> tuple[str, float]:
    """The calendar month (UTC) of `now`: its name and its first second."""
    d = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    start = dt.datetime(d.year, d.month, 1, tzinfo=dt.timezone.utc)
    return start.strftime("%Y-%m"), start.timestamp()
