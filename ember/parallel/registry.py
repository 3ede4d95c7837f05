"""The strategies ember runs, by the name a recipe's [distributed] strategy gives, in the order
`ember plan` lists them. A new strategy is a module of ember/parallel and one line here."""

from __future__ import annotations

from collections.abc import Iterable

from ember.parallel.ddp import DDP
from ember.parallel.fsdp import FSDP
from ember.parallel.fsdp_tp import FSDPTP
from ember.parallel.pp import PP
from ember.parallel.pp_ddp import PPDDP
from ember.parallel.strategy import Strategy
from ember.parallel.tp import TP

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (DDP(), FSDP(), TP(), FSDPTP(), PP(), PPDDP())}


def either(names: Iterable[str]) -> str:
    """'a', 'a' or 'b', 'a', 'b' or 'c': for a message's "use strategy ..."."""
    quoted = [f"'{n}'" for n in names]
    return " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)


def summaries() -> str:
    """Every strategy by name with what it does, for the recipe's documentation."""
    return "; ".join(f"'{s.name}' {s.summary}" for s in STRATEGIES.values())
