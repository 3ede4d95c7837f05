"""Interconnect measurements in the ledger (`ember doctor --comm`): one row per measurement, the
newest for a set of hosts is what `ember plan` advises from. Only SQL lives here."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class InterconnectRow:
    time: float
    hosts: list[str]
    ranks: int
    nodes: int
    backend: str
    links: dict[str, dict[str, float]]      # collective -> {"latency": s, "bandwidth": B/s}
    samples: dict[str, dict[str, float]]    # collective -> {bytes: seconds}


def record(con: sqlite3.Connection, row: InterconnectRow) -> None:
    with con:
        con.execute("INSERT INTO interconnects (time, hosts, ranks, nodes, backend, links, samples) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (row.time or time.time(), json.dumps(sorted(set(row.hosts))), row.ranks, row.nodes,
                     row.backend, json.dumps(row.links), json.dumps(row.samples)))


def newest(con: sqlite3.Connection, host: str | None = None) -> InterconnectRow | None:
    """The newest measurement (among those that include `host`, when given)."""
    for r in con.execute("SELECT * FROM interconnects ORDER BY time DESC"):
        hosts = json.loads(r["hosts"])
        if host is None or host in hosts:
            return _row(r, hosts)
    return None


def _row(r: sqlite3.Row, hosts: list[str]) -> InterconnectRow:
    d: dict[str, Any] = dict(r)
    return InterconnectRow(d["time"], hosts, d["ranks"], d["nodes"], d["backend"], json.loads(d["links"]),
                           json.loads(d["samples"]))
