"""A run's accounting, assembled from its folder (metrics) and the ledger (attempts, events)."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ember.ckpt.store import committed_in
from ember.errors import EmberError
from ember.jsonl import read_jsonl
from ember.ledger import store as ledger_store
from ember.ledger.goodput import Event, Span, Step, account
from ember.metrics.cost import Prices, cost
from ember.metrics.stats import spread, stalls


def load_run_record(run_path: Path) -> dict[str, Any]:
    record_path = run_path / "run.json"
    if not run_path.is_dir():
        raise EmberError(f"{run_path}: no such run folder (give a run folder or a run id from `ember runs`)")
    if not record_path.is_file():
        raise EmberError(f"{run_path}: not an ember run folder (no run.json)")
    try:
        return json.loads(record_path.read_text())
    except json.JSONDecodeError as e:
        raise EmberError(f"{record_path}: unreadable ({e})") from None


def resolve_run(ref: str, con: sqlite3.Connection | None) -> Path:
    """A run folder from a path or a ledger run id."""
    if Path(ref).exists():
        return Path(ref)
    if con is not None:
        row = ledger_store.find_run(con, ref)
        if row is not None:
            return Path(row["path"])
    raise EmberError(f"{ref}: neither a run folder nor a run id in the ledger; `ember runs` lists them")


def pid_alive(pid: int | None, host: str | None) -> bool:
    if not pid or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def committed_steps(run_path: Path) -> list[int]:
    return [step for step, _ in committed_in(run_path / "checkpoints")]


def build_report(run_path: Path, con: sqlite3.Connection | None) -> dict[str, Any]:
    """Everything `ember report` shows, as plain data."""
    record = load_run_record(run_path)
    notes: list[str] = []
    kept = read_jsonl(run_path / "metrics.jsonl", notes)
    lost = read_jsonl(run_path / "metrics.lost.jsonl", notes)
    recipe = record["recipe"]
    perf = record.get("performance", {})
    rows = ledger_store.attempts(con, record["id"]) if con is not None and "id" in record else []
    events = ledger_store.events(con, record["id"]) if rows else []

    status, spans = "unknown", []
    for a in rows:
        alive = a.outcome is None and pid_alive(_pid(con, record["id"], a.attempt), a.host)
        end = a.end or (time.time() if alive else max(a.last_seen or a.start, _last_time(kept + lost, a.attempt)))
        spans.append(Span(a.attempt, a.start, end))
        status = a.outcome or ("running" if alive else "killed")
    # Steps after the newest checkpoint of an attempt that died are lost too, once resumed.
    newest = max(committed_steps(run_path), default=0)
    pending = status in ("killed", "crashed")
    steps = [Step(r["attempt"], r["step"], r["step_seconds"], r["data_wait_seconds"],
                  lost=pending and r["step"] > newest) for r in kept]
    steps += [Step(r["attempt"], r["step"], r["step_seconds"], r["data_wait_seconds"], True) for r in lost]
    good = [r for r in kept if not (pending and r["step"] > newest)]

    report: dict[str, Any] = {
        "run": {"id": record.get("id"), "path": str(run_path), "status": status,
                "steps": good[-1]["step"] if good else 0, "max_steps": recipe["train"]["max_steps"],
                "attempts": len(rows) or None, "created": record.get("created")},
        "loss": {"first": good[0]["loss"], "last": good[-1]["loss"]} if good else None,
        "notes": notes,
    }
    devices = perf.get("devices", 1)
    if good:
        seconds = sum(r["step_seconds"] for r in good)
        tokens = sum(r["tokens"] for r in good)
        per_device = tokens / seconds / devices
        seq_len = recipe["data"]["seq_len"]
        report["throughput"] = {"tokens_per_second": tokens / seconds,
                                "tokens_per_second_per_device": per_device,
                                "samples_per_second": tokens / seq_len / seconds, "devices": devices,
                                "tokens": tokens}
        report["mfu"] = _mfu(perf, per_device)
        sp = spread([r["step_seconds"] for r in good])
        first_steps = {a.resumed_from + 1 if a.resumed_from is not None else 1 for a in rows} or {1}
        ck_steps = {e["step"] for e in events if e["kind"] == "checkpoint" and e["step"] is not None}
        report["step_time"] = asdict(sp)
        report["stalls"] = [asdict(s) for s in stalls(good, sp.p50, ck_steps, first_steps)]
    if spans:
        g = account(spans, [Event(e["attempt"], e["kind"], e["start"], e["end"]) for e in events], steps)
        report["goodput"] = {"wall_seconds": g.wall_seconds, "goodput": g.goodput,
                             "buckets": g.buckets,
                             "lost_steps": sum(1 for s in steps if s.lost)}
        report["where_time_goes"] = _ranked(g, steps, events)
        prices = prices_from(recipe.get("cost", {}), devices)
        c = cost(prices, g.wall_seconds, report.get("throughput", {}).get("tokens", 0))
        report["cost"] = asdict(c) | {"completed": status == "completed"}
        report["attempts"] = [asdict(a) | {"lost_steps": sum(1 for s in steps if s.lost and s.attempt == a.attempt)}
                              for a in rows]
    else:
        report["goodput"] = None
        notes.append("no attempts of this run in the ledger (run with --no-ledger, or another "
                     "--ledger): goodput and cost need them")
    if con is not None and "id" in record:
        report["checkpoints"] = [dict(r) for r in ledger_store.checkpoints(con, record["id"])]
    return report


def _pid(con: sqlite3.Connection, run_id: str, attempt: int) -> int | None:
    row = con.execute("SELECT pid FROM attempts WHERE run_id = ? AND attempt = ?", (run_id, attempt)).fetchone()
    return row[0] if row else None


def _last_time(records: list[dict[str, Any]], attempt: int) -> float:
    return max((r["time"] for r in records if r.get("attempt") == attempt), default=0.0)


def _mfu(perf: dict[str, Any], per_device: float) -> dict[str, Any]:
    fpt, peak = perf.get("flops_per_token"), perf.get("peak_flops")
    base = {"formula": perf.get("flops_formula"), "flops_per_token": fpt,
            "peak_flops": peak, "peak_source": perf.get("peak_source"), "device": perf.get("device_name")}
    if not fpt or not peak:
        return base | {"value": None, "reason": perf.get("peak_source", "no performance record")}
    return base | {"value": per_device * fpt / peak}


def prices_from(cfg: dict[str, Any], devices: int) -> Prices:
    """Recipe [cost] over $EMBER_HOME/machine.toml [cost]; a 0 or '' in the recipe means unset."""
    import tomllib

    from ember.paths import ember_home
    machine: dict[str, Any] = {}
    path = ember_home() / "machine.toml"
    if path.is_file():
        try:
            machine = tomllib.loads(path.read_text()).get("cost", {})
        except tomllib.TOMLDecodeError as e:
            raise EmberError(f"{path}: not valid TOML: {e}") from None

    def pick(key: str, default: Any) -> Any:
        return cfg.get(key) or machine.get(key) or default
    return Prices(device_hour=float(pick("device_hour_price", 0.0)),
                  devices=int(pick("devices", devices)), watts=float(pick("watts", 0.0)),
                  energy_kwh=float(pick("energy_price_kwh", 0.0)), currency=pick("currency", "USD"))


def _ranked(g: Any, steps: list[Step], events: list[sqlite3.Row]) -> list[dict[str, Any]]:
    """Badput buckets, largest first, each with the evidence behind it."""
    out = []
    for name, seconds in g.badput():
        if seconds <= 0:
            continue
        evidence = ""
        if name == "wasted_progress":
            n = sum(1 for s in steps if s.lost)
            evidence = f"{n} steps computed after an attempt's last checkpoint, then again"
        elif name == "checkpoint_save":
            saves = [e["end"] - e["start"] for e in events if e["kind"] in ("checkpoint", "final_save")
                     and '"flush"' not in (e["detail"] or "")]  # the exit-time wait is not a save
            evidence = f"{len(saves)} saves, median {statistics.median(saves):.3f}s blocking" if saves else ""
        elif name == "data_loading":
            waits = [s.data_wait for s in steps if not s.lost]
            evidence = f"median data wait {statistics.median(waits) * 1000:.2f} ms a step" if waits else ""
        elif name == "program_startup":
            starts = [e["end"] - e["start"] for e in events if e["kind"] == "startup"]
            evidence = f"{len(starts)} start-ups, {', '.join(f'{s:.1f}s' for s in starts)}"
        elif name == "checkpoint_restore":
            evidence = f"{sum(1 for e in events if e['kind'] == 'restore')} restores"
        elif name == "other":
            evidence = "shutdown, logging and time between steps not otherwise recorded"
        out.append({"bucket": name, "seconds": seconds, "share": seconds / g.wall_seconds,
                    "evidence": evidence})
    return out


def compact(report: dict[str, Any]) -> dict[str, Any]:
    """The few figures `ember runs` shows, stored in the ledger's summaries."""
    g, c, m = report.get("goodput") or {}, report.get("cost") or {}, report.get("mfu") or {}
    return {"status": report["run"]["status"], "steps": report["run"]["steps"],
            "max_steps": report["run"]["max_steps"],
            "tokens_per_second_per_device": report.get("throughput", {}).get("tokens_per_second_per_device"),
            "mfu": m.get("value"), "goodput": g.get("goodput"), "wall_seconds": g.get("wall_seconds"),
            "cost": c.get("total"), "currency": c.get("currency"),
            "p50": report.get("step_time", {}).get("p50"), "p99": report.get("step_time", {}).get("p99")}


def summary_line(report: dict[str, Any]) -> str:
    """The four figures a budget owner asks for, and the cost, on one line."""
    parts = []
    if t := report.get("throughput"):
        parts.append(f"{t['tokens_per_second_per_device']:,.0f} tokens/s per device")
    if m := report.get("mfu"):
        parts.append(f"MFU {m['value']:.1%} ({m['peak_source']})" if m["value"] is not None
                     else f"MFU n/a ({m.get('reason')})")
    if s := report.get("step_time"):
        parts.append(f"step p50 {s['p50'] * 1000:.1f} ms, p99 {s['p99'] * 1000:.1f} ms")
    if g := report.get("goodput"):
        parts.append(f"goodput {g['goodput']:.1%} of {g['wall_seconds']:.1f} s")
    if (c := report.get("cost")) and c["total"] is not None:
        parts.append(f"cost {c['total']:.4f} {c['currency']}")
    return "; ".join(parts)
