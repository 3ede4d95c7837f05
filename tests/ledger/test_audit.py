"""The gate's audit log: a row for every decision, allowed or refused, with what it decided on;
rows that cannot be updated or deleted through SQLite, and a hash chain that shows any row edited,
removed or inserted behind its back."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ember.events import collect
from ember.ledger import audit
from ember.ledger import remote_rows as remote_rows
from ember.ledger import database as store
from ember.policy.gate import Limits
from ember.policy.registry import register
from ember.remote.submit import RemoteRequest, decide
from tests.helpers import GENESIS, run_ember, write_recipe
from tests.policy.test_registry import TARGET


def setup(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    data = tmp_path / "genesis.jsonl"
    data.write_bytes(GENESIS.read_bytes())
    recipe = write_recipe(tmp_path, data={"files": [str(data)]})
    reg = tmp_path / "datasets.toml"
    register(reg, "genesis", [data], "alice", "CC0-1.0", "public", ["hpc"], "")
    targets = tmp_path / "targets.toml"
    targets.write_text(TARGET)
    return recipe, reg, targets, tmp_path / "ledger.db"


def entry(n: int) -> dict:
    return {"time": 1000.0 + n, "who": "alice@box", "action": "check", "recipe": f"/r{n}.toml", "recipe_digest": "d",
            "target": "hpc", "datasets": [{"name": "x", "fingerprint": "sha256:0"}], "limits": {"max_cost": 1},
            "prediction": {"cost": 0.5}, "decision": "allowed", "reasons": []}


def test_both_outcomes_are_audited_with_what_was_decided_on(tmp_path):
    recipe, reg, targets, ledger = setup(tmp_path)
    events, _ = collect()
    ok = Limits(max_wall_hours=1, max_device_hours=1, max_cost=1, max_nodes=1)
    allowed = decide(RemoteRequest(recipe, "hpc", ok, registry=reg, targets=targets, ledger=ledger), "check", events)
    refused = decide(RemoteRequest(recipe, "hpc", Limits(max_wall_hours=1), registry=reg, targets=targets,
                                   ledger=ledger), "submit", events)
    assert allowed.decision.allowed and not refused.decision.allowed
    chain, problems = audit.check_log(store.connect(ledger))
    assert problems == []
    assert [(r.id, r.action, r.decision) for r in chain] == [(1, "check", "allowed"), (2, "submit", "refused")]
    first, second = chain
    assert first.recipe_digest == allowed.recipe.digest() and first.recipe == str(recipe.resolve())
    assert first.target == "hpc" and "@" in first.who
    assert first.datasets == [{"name": "genesis", "fingerprint": register_fp(reg), "observed": register_fp(reg),
                               "classification": "public", "staged": True}]
    assert first.limits == {"max_wall_hours": 1, "max_device_hours": 1, "max_cost": 1, "max_nodes": 1, "nodes": 1}
    assert first.prediction["device_hours"] > 0 and first.reasons == []
    assert [r["code"] for r in second.reasons] == ["missing-limit"]
    assert second.prev_hash == first.hash


def register_fp(reg: Path) -> str:
    from ember.policy.registry import load_registry
    return load_registry(reg)["genesis"].fingerprint


def test_sqlite_refuses_to_update_or_delete_an_audit_row(tmp_path):
    con = store.connect(tmp_path / "ledger.db")
    audit.append(con, entry(1))
    for sql in ("UPDATE audit SET decision = 'refused'", "DELETE FROM audit"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            con.execute(sql)
    assert audit.check_log(con)[1] == []


def tampered(tmp_path: Path, *statements: str) -> list[str]:
    """Three rows, then SQL behind ember's back (the triggers dropped first), then verify."""
    path = tmp_path / "ledger.db"
    con = store.connect(path)
    for n in range(1, 4):
        audit.append(con, entry(n))
    con.close()
    raw = sqlite3.connect(path)
    raw.executescript("DROP TRIGGER audit_append_only_update; DROP TRIGGER audit_append_only_delete; "
                      + "; ".join(statements))
    raw.close()
    return audit.check_log(store.connect(path))[1]


def test_an_edited_row_is_detected(tmp_path):
    problems = tampered(tmp_path, "UPDATE audit SET decision = 'refused' WHERE id = 2")
    assert problems == ["row 2: its fields do not hash to its hash (edited)"]


def test_a_removed_row_is_detected(tmp_path):
    problems = tampered(tmp_path, "DELETE FROM audit WHERE id = 2")
    assert "row 3: expected row 2 here (rows removed or inserted)" in problems
    assert "row 3: prev_hash does not match row 2's hash (the chain is broken)" in problems


def test_a_row_rewritten_with_a_fresh_hash_still_breaks_the_link_to_the_next(tmp_path):
    path = tmp_path / "ledger.db"
    con = store.connect(path)
    for n in range(1, 4):
        audit.append(con, entry(n))
    forged = {**entry(2), "id": 2, "decision": "refused", "prev_hash": audit.rows(con)[0].hash}
    con.execute("DROP TRIGGER audit_append_only_update")
    con.execute("UPDATE audit SET decision = 'refused', hash = ? WHERE id = 2", (audit.row_hash(forged),))
    assert audit.check_log(con)[1] == ["row 3: prev_hash does not match row 2's hash (the chain is broken)"]


def test_the_row_that_let_a_job_go_cannot_be_cut_from_the_end(tmp_path):
    path = tmp_path / "ledger.db"
    con = store.connect(path)
    audit.append(con, entry(1))
    row = audit.append(con, entry(2))
    remote_rows.insert(con, {"name": "j", "target": "hpc", "audit_id": row.id, "audit_hash": row.hash, "host": "",
                             "ssh_options": [], "python": "python", "recipe": "/r.toml", "out": "/o", "remote_dir": "/s/j",
                             "limits": {}, "prediction": {}}, "staging")
    con.execute("DROP TRIGGER audit_append_only_delete")
    con.execute("DELETE FROM audit WHERE id = 2")  # the chain of what is left is intact
    assert audit.check_log(con)[1] == ["row 2: a remote job was let go by it, and it is missing"]


def test_policy_audit_verify_exits_1_and_names_the_row(tmp_path):
    tampered(tmp_path, "UPDATE audit SET who = 'mallory@box' WHERE id = 1")
    done = run_ember("policy", "audit", "--verify", "--ledger", tmp_path / "ledger.db")
    assert done.returncode == 1, done.stderr
    assert "TAMPERED: row 1: its fields do not hash to its hash (edited)" in done.stdout
