"""Remote compute: `ember data`, `ember policy`, `ember remote` and `ember submit --target`.
Argument parsing, one library call, printing."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ember.errors import EXIT_ERROR, EXIT_OK, EmberError

COMMANDS = ("data", "policy", "remote")


def add_parsers(sub: Any) -> None:
    """`ember data`, `ember policy` and `ember remote`, with their sub-commands."""
    for add in (add_data, add_policy, add_remote):
        add(sub)


def add_data(sub: Any) -> None:
    data = sub.add_parser("data", help="the dataset registry: what may leave this machine, and where to")
    dsub = data.add_subparsers(dest="data_command", required=True)
    reg = dsub.add_parser("register", help="add (or renew) a dataset: its files' fingerprint, owner, licence, "
                          "classification and the targets it may go to")
    reg.add_argument("name")
    reg.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or folders of the dataset")
    reg.add_argument("--owner", required=True)
    reg.add_argument("--licence", required=True)
    reg.add_argument("--classification", required=True, metavar="{public,internal,restricted,personal}")
    reg.add_argument("--allow", dest="allowed_targets", action="append", default=[], metavar="TARGET",
                     help="a target it may be staged to; repeatable (default: none, local only)")
    reg.add_argument("--expires", default="", metavar="YYYY-MM-DD", help="the permission's last day")
    reg.add_argument("--registry", type=Path, default=Path("datasets.toml"),
                     help="the registry file to write (default ./datasets.toml)")
    reg.add_argument("--override", action="store_true",
                     help="register it although it shares files with a dataset of another classification "
                     "(written to the audit log; the gate still treats a shared file as its most restrictive "
                     "dataset's)")
    reg.add_argument("--ledger", type=Path, help="with --override: the ledger whose audit log records it "
                     "(default $EMBER_HOME/ledger.db)")
    for name, text in (("list", "the registered datasets"), ("verify", "hash each dataset's files against "
                                                               "its registered fingerprint")):
        p = dsub.add_parser(name, help=text)
        if name == "verify":
            p.add_argument("names", nargs="*", metavar="NAME", help="datasets to verify (default all)")
        p.add_argument("--registry", type=Path, help="read this datasets.toml alone")
        p.add_argument("--json", action="store_true")


def add_policy(sub: Any) -> None:
    policy = sub.add_parser("policy", help="the gate before remote compute, and its audit log")
    psub = policy.add_subparsers(dest="policy_command", required=True)
    check = psub.add_parser("check", help="dry run: would `ember submit RECIPE --target T` be allowed, and why not")
    add_remote_args(check, required=True)
    check.add_argument("recipe", type=Path)
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    check.add_argument("--json", action="store_true")
    aud = psub.add_parser("audit", help="the gate's decisions, and whether the hash chain is intact")
    aud.add_argument("--verify", action="store_true", help="check every row's hash and link; exit 1 if broken")
    aud.add_argument("--json", action="store_true")
    aud.add_argument("--ledger", type=Path, help="the ledger (default $EMBER_HOME/ledger.db)")


def add_remote(sub: Any) -> None:
    remote = sub.add_parser("remote", help="remote jobs: status, logs, cancel, continue")
    rsub = remote.add_subparsers(dest="remote_command", required=True, metavar="{status,logs,cancel,continue}")
    st = rsub.add_parser("status", help="a remote job's state (results brought back), or every job's")
    st.add_argument("job", nargs="?", help="its job id (its backend's: Slurm's) or name (default: list every job)")
    st.add_argument("--wait", action="store_true", help="wait until it has ended")
    st.add_argument("--timeout", type=float, default=3600, help="with --wait: give up after this many seconds")
    lg = rsub.add_parser("logs", help="a remote job's output, every allocation's")
    lg.add_argument("job")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    cn = rsub.add_parser("cancel", help="cancel a remote job (it checkpoints first) and bring its results back")
    cn.add_argument("job")
    cn.add_argument("--timeout", type=float, default=300, help="wait at most this long for its backend to end it")
    for p in (st, lg, cn):
        p.add_argument("--target", help="the target, when a job id is known on several")
        p.add_argument("--ledger", type=Path, help="the ledger (default $EMBER_HOME/ledger.db)")
        p.add_argument("--json", action="store_true") if p is not lg else None
    co = rsub.add_parser("continue", help="resume a stopped, cancelled or failed job from its last checkpoint, "
                         "through the gate again with new limits")
    co.add_argument("job", help="its job id or name")
    add_limits(co)
    co.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="the --set the job was submitted with (the recipe must resolve as it did then)")
    co.add_argument("--ledger", type=Path, help="the ledger (default $EMBER_HOME/ledger.db)")
    rsub.add_parser("_allocation").add_argument("folder", type=Path)  # what the batch script execs: no help, unlisted


def add_remote_args(p: argparse.ArgumentParser, required: bool) -> None:
    """--target and the limits: for `ember policy check`, and for `ember submit` (optional there:
    without --target it queues with the local service)."""
    p.add_argument("--target", required=required, help="a target of targets.toml: run there, through the gate")
    add_limits(p)
    p.add_argument("--nodes", type=int, default=1, help="nodes to run on (default 1)")
    if required:
        p.add_argument("--ledger", type=Path, help="the ledger (default $EMBER_HOME/ledger.db)")
    else:
        p.add_argument("--ledger", type=Path, help="with --target: the ledger (default $EMBER_HOME/ledger.db)")


def add_limits(p: argparse.ArgumentParser) -> None:
    """The four limits a remote job states, and the registry and targets the gate reads."""
    p.add_argument("--max-wall-hours", type=float, help="limit: wall-clock hours the job may hold (required)")
    p.add_argument("--max-device-hours", type=float, help="limit: device-hours it may use (required)")
    p.add_argument("--max-cost", type=float, help="limit: what it may cost, in the target's currency (required)")
    p.add_argument("--max-nodes", type=int, help="limit: nodes it may take (required)")
    p.add_argument("--registry", type=Path, help="read this datasets.toml alone")
    p.add_argument("--targets", type=Path, help="read this targets.toml alone")


def remote_request(args: argparse.Namespace, out: Path | None = None, name: str | None = None) -> Any:
    from ember.policy.gate import Limits
    from ember.remote.submit import RemoteRequest
    limits = Limits(args.max_wall_hours, args.max_device_hours, args.max_cost, args.max_nodes)
    return RemoteRequest(getattr(args, "recipe", Path()), getattr(args, "target", ""), limits,
                         getattr(args, "nodes", 1), args.overrides, out, name, args.registry, args.targets,
                         args.ledger)


def cmd(args: argparse.Namespace) -> int:
    if args.command == "data":
        return {"register": cmd_register, "list": cmd_list, "verify": cmd_verify}[args.data_command](args)
    if args.command == "policy":
        return cmd_check(args) if args.policy_command == "check" else cmd_audit(args)
    return {"status": cmd_status, "logs": cmd_logs, "cancel": cmd_cancel, "continue": cmd_continue,
            "_allocation": cmd_allocation}[args.remote_command](args)


def _print(text: str) -> None:
    Console(soft_wrap=True).print(text, markup=False, highlight=False)


def cmd_register(args: argparse.Namespace) -> int:
    from ember.policy.registry import register
    ds = register(args.registry, args.name, args.paths, args.owner, args.licence, args.classification,
                  args.allowed_targets, args.expires, override=args.override, ledger=args.ledger)
    where = ", ".join(ds.allowed_targets) or "none (local only)"
    _print(f"registered '{args.name}' in {args.registry}: {len(ds.paths)} path(s), {ds.fingerprint}, "
           f"{ds.classification}; may go to: {where}")
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    from ember.policy.registry import load_registry
    reg = load_registry(args.registry)
    if args.json:
        print(json.dumps({n: asdict(d) for n, d in reg.items()}, indent=1))
        return EXIT_OK
    table = Table("name", "classification", "owner", "licence", "may go to", "expires", "paths", "source")
    for n, d in sorted(reg.items()):
        table.add_row(n, d.classification, d.owner, d.licence, ", ".join(d.allowed_targets) or "-",
                      d.expires or "-", "\n".join(d.paths), d.source)
    Console(soft_wrap=True).print(table)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ember.policy.registry import load_registry, verify_all
    results = verify_all(load_registry(args.registry), args.names)
    if args.json:
        print(json.dumps({n: problem or "ok" for n, problem in results.items()}, indent=1))
    for n, problem in results.items():
        if not args.json:
            _print(f"{n}: {'ok' if problem is None else 'FAILED: ' + problem}")
    return EXIT_OK if all(p is None for p in results.values()) else EXIT_ERROR


def cmd_check(args: argparse.Namespace) -> int:
    from ember.cli.render import stderr_events
    from ember.remote.submit import decide
    decided = decide(remote_request(args), "check", stderr_events())
    d, p = decided.decision, decided.audit.prediction
    if args.json:
        print(json.dumps({"allowed": d.allowed, "reasons": [asdict(v) for v in d.reasons],
                          "datasets": [asdict(u) for u in d.datasets], "prediction": p,
                          "audit_id": decided.audit.id}, indent=1))
        return EXIT_OK if d.allowed else EXIT_ERROR
    print_decision(decided)
    return EXIT_OK if d.allowed else EXIT_ERROR


def print_decision(decided: Any) -> None:
    d, p = decided.decision, decided.audit.prediction
    if p["device_hours"] is not None:
        _print(f"prediction: {p['device_hours']:.4g} device-hours, cost {p['cost']:.4g}, wall {p['wall_hours']:.4g} h "
               f"({p['how']})")
    for u in d.datasets:
        if not u.staged:
            _print(f"dataset {u.name} ({u.classification}): holds files the job reads (not staged)")
            continue
        _print(f"dataset {u.name} ({u.classification}): {u.fingerprint[:23]}..."
               + ("" if u.observed == u.fingerprint else " CHANGED"))
    verdict = "allowed" if d.allowed else "refused"
    _print(f"{verdict} for '{decided.audit.target}' (audit row {decided.audit.id})")
    for v in d.reasons:
        _print(f"  - {v.code}: {v.message}")


def cmd_audit(args: argparse.Namespace) -> int:
    from ember.ledger import audit
    from ember.ledger import database as ledger_store
    chain, problems = audit.check_log(ledger_store.connect(args.ledger))
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in chain], "problems": problems}, indent=1))
    else:
        table = Table("id", "time", "who", "action", "target", "decision", "reasons", "recipe")
        for r in chain:
            table.add_row(str(r.id), dt.datetime.fromtimestamp(r.time).strftime("%Y-%m-%d %H:%M:%S"), r.who,
                          r.action, r.target, r.decision, ", ".join(x["code"] for x in r.reasons) or "-",
                          r.recipe + (f" ({r.recipe_digest[:12]})" if r.recipe_digest else ""))
        Console(soft_wrap=True).print(table)
    if args.verify and args.json:
        return EXIT_ERROR if problems else EXIT_OK
    if args.verify:
        for p in problems:
            _print(f"TAMPERED: {p}")
        if not problems:
            _print(f"the audit log is intact: {len(chain)} rows, each hash and link verified")
        return EXIT_ERROR if problems else EXIT_OK
    return EXIT_OK


def cmd_submit_remote(args: argparse.Namespace) -> int:
    from ember.cli.render import stderr_events
    from ember.remote.backends import title
    from ember.remote.submit import submit
    done = submit(remote_request(args, args.out, args.name), stderr_events())
    j = done.job
    print(f"remote job {j.name}: {title(j.backend)} job {j.backend_id} on '{j.target}' ({j.state}); results come "
          f"back to {j.out}; `ember remote status {j.backend_id}`")
    return EXIT_OK


def cmd_continue(args: argparse.Namespace) -> int:
    from ember.cli.render import stderr_events
    from ember.remote.backends import title
    from ember.remote.submit import continue_job
    done = continue_job(args.job, remote_request(args), stderr_events())
    j = done.job
    print(f"remote job {j.name}: continued as {title(j.backend)} job {j.backend_id} on '{j.target}' ({j.state}), "
          f"from its last checkpoint; results come back to {j.out}; `ember remote status {j.name}`")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from ember.cli.render import stderr_events
    from ember.ledger.job_states import REMOTE_FINAL
    from ember.remote.tracking import job_status
    found = job_status(args.ledger, args.job, args.target, args.wait, args.timeout, stderr_events())
    if args.json:
        print(json.dumps([asdict(s) for s in found], indent=1, default=str))
        return EXIT_OK
    table = Table("job id", "name", "target", "state", "progress", "cost", "note")
    for s in found:
        j = s.job
        progress = f"{s.steps}/{s.max_steps}" if s.max_steps else "-"
        table.add_row(j.backend_id or "-", j.name, j.target, j.state, progress,
                      "-" if j.cost is None else f"{j.cost:.4g}", j.detail or "")
    Console(soft_wrap=True).print(table)
    if len(found) == 1 and found[0].job.state in REMOTE_FINAL:
        _print(f"results: {found[0].job.out} (`ember report {found[0].job.out}`)")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    from ember.remote.tracking import job_logs
    offset = 0
    deadline = time.monotonic() + 24 * 3600
    while True:
        chunk, ended = job_logs(args.ledger, args.job, args.target, offset)
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        offset += len(chunk)
        if not args.follow or (ended and not chunk) or time.monotonic() > deadline:
            return EXIT_OK
        time.sleep(2)


def cmd_cancel(args: argparse.Namespace) -> int:
    from ember.cli.render import stderr_events
    from ember.remote.backends import title
    from ember.remote.tracking import cancel_job
    s = cancel_job(args.ledger, args.job, args.target, args.timeout, stderr_events())
    print(f"remote job {s.job.name} ({title(s.job.backend)} job {s.job.backend_id}): {s.job.state}; {s.steps} steps "
          f"brought back to {s.job.out}")
    return EXIT_OK if s.job.state == "cancelled" else EXIT_ERROR


def cmd_allocation(args: argparse.Namespace) -> int:
    from ember.cli.render import stderr_events
    from ember.remote.allocation import run_allocation
    return run_allocation(args.folder, stderr_events())


def require_no_limits_without_target(args: argparse.Namespace) -> None:
    given = [f for f in ("max_wall_hours", "max_device_hours", "max_cost", "max_nodes", "registry", "targets")
             if getattr(args, f, None) is not None] + (["nodes"] if args.nodes != 1 else [])
    if given:
        raise EmberError(f"--{given[0].replace('_', '-')} is for a remote job: add --target T")
