"""The gate's audit log in the ledger: one row per decision, allowed or refused (who, when, the
recipe's hash, the datasets with their fingerprints, the target, the limits, the prediction, the
decision and its reasons). Rows are only ever appended: triggers refuse UPDATE and DELETE, and
each row carries the SHA-256 of its own fields and of the row before it, so a row edited, removed
or inserted behind SQLite's back breaks the chain (`verify`). What a chain cannot show alone is
rows cut from its end; remote jobs name the audit row that let them go (ember.ledger.remote_rows), and
`verify` checks those too. Only SQL and the hashing live here."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import asdict, dataclass
from typing import Any

GENESIS = "0" * 64
FIELDS = ("id", "time", "who", "action", "recipe", "recipe_digest", "target", "datasets", "limits",
          "prediction", "decision", "reasons", "prev_hash")


@dataclass
class AuditRow:
    id: int
    time: float
    who: str
    action: str            # check (a dry run) | submit
    recipe: str
    recipe_digest: str
    target: str
    datasets: list[dict[str, Any]]
    limits: dict[str, Any]
    prediction: dict[str, Any]
    decision: str          # allowed | refused
    reasons: list[dict[str, str]]
    prev_hash: str
    hash: str


def row_hash(fields: dict[str, Any]) -> str:
    """SHA-256 over a row's fields (FIELDS, the previous row's hash among them), canonical JSON."""
    body = json.dumps({k: fields[k] for k in FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def append(con: sqlite3.Connection, entry: dict[str, Any]) -> AuditRow:
    """Append one decision (every FIELDS key but id and prev_hash) after the newest row."""
    con.execute("BEGIN IMMEDIATE")  # the newest row cannot change under us
    try:
        last = con.execute("SELECT id, hash FROM audit ORDER BY id DESC LIMIT 1").fetchone()
        fields = {**entry, "id": (last[0] + 1) if last else 1, "prev_hash": last[1] if last else GENESIS}
        row = AuditRow(**fields, hash=row_hash(fields))
        con.execute(f"INSERT INTO audit ({', '.join(FIELDS)}, hash) VALUES ({', '.join('?' * (len(FIELDS) + 1))})",
                    [_sql(getattr(row, k)) for k in FIELDS] + [row.hash])
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return row


def _sql(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def rows(con: sqlite3.Connection) -> list[AuditRow]:
    out = []
    for r in con.execute("SELECT * FROM audit ORDER BY id"):
        d = dict(r)
        for k in ("datasets", "limits", "prediction", "reasons"):
            d[k] = json.loads(d[k])
        out.append(AuditRow(**d))
    return out


def get(con: sqlite3.Connection, audit_id: int) -> AuditRow | None:
    return next((r for r in rows(con) if r.id == audit_id), None)


def verify(chain: list[AuditRow], referenced: dict[int, str] | None = None) -> list[str]:
    """What is wrong with the chain, oldest first (empty: intact): a row whose fields do not hash
    to its hash (edited), whose prev_hash is not the row before's (removed or inserted), ids not
    1, 2, 3...; and `referenced` ({audit id: hash} kept by remote jobs) naming rows not there."""
    problems = []
    prev, expected_id = GENESIS, 1
    for r in chain:
        fields = asdict(r)
        if r.id != expected_id:
            problems.append(f"row {r.id}: expected row {expected_id} here (rows removed or inserted)")
        if r.prev_hash != prev:
            problems.append(f"row {r.id}: prev_hash does not match row {r.id - 1}'s hash (the chain is broken)")
        if row_hash(fields) != r.hash:
            problems.append(f"row {r.id}: its fields do not hash to its hash (edited)")
        prev, expected_id = r.hash, r.id + 1
    have = {r.id: r.hash for r in chain}
    for audit_id, h in sorted((referenced or {}).items()):
        if have.get(audit_id) != h:
            problems.append(f"row {audit_id}: a remote job was let go by it, and it is "
                            f"{'missing' if audit_id not in have else 'not the row the job recorded'}")
    return problems


def check_log(con: sqlite3.Connection) -> tuple[list[AuditRow], list[str]]:
    """Every audit row, and what is wrong with the log (empty: intact)."""
    chain = rows(con)
    referenced = {r[0]: r[1] for r in con.execute("SELECT audit_id, audit_hash FROM remote_jobs")}
    return chain, verify(chain, referenced)
