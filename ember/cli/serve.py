"""`ember serve` and the commands that talk to it: submit, queue (and queue purge), pause, resume,
cancel, requeue, logs, yield. Argument parsing, one call, printing."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ember.errors import EXIT_ERROR, EmberError
from ember.paths import NAME_GRAMMAR, check_job_name

COMMANDS = ("serve", "ui", "submit", "queue", "pause", "resume", "cancel", "requeue", "logs", "yield")
FINISHED = ("completed", "failed", "cancelled")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The service's commands, in the order `ember -h` lists them."""
    for add in (add_serve, add_ui, add_submit, add_queue, add_job_verbs, add_logs, add_yield):
        add(sub)


def add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="the local service: a queue of training jobs that steps aside "
                       "for the owner and for inference",
                       description="Run the service in the foreground (under systemd: --install-unit). Rules "
                       "and settings: $EMBER_HOME/owner.toml.")
    s.add_argument("--host", help="address to listen on (default [service] host, 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default [service] port, 8765; 0: any free port)")
    s.add_argument("--devices", help="declare simulated devices instead of detecting them, e.g. "
                   "sim:2x8GiB (tests, rehearsals); also EMBER_DEVICES")
    s.add_argument("--explain", action="store_true", help="ask the running service which owner rule "
                   "holds each job right now, and exit")
    s.add_argument("--ledger", type=Path, help="the ledger database (default $EMBER_HOME/ledger.db)")
    s.add_argument("--install-unit", action="store_true", help="write the systemd user unit that runs this "
                   "ember's service ($XDG_CONFIG_HOME/systemd/user/ember.service), and exit")


def add_ui(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("ui", help="the dashboard alone (runs, machine, plan), when no service runs; with one, "
                       "print where its dashboard is and a link that signs you in",
                       description="Serve the web dashboard and its JSON API, /metrics and /openapi.json over "
                       "the ledger, on [service] host:port (127.0.0.1:8765). Prints a sign-in link (it holds "
                       "the service's token) for changing jobs.")
    s.add_argument("--host", help="address to listen on (default [service] host, 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default [service] port, 8765; 0: any free port)")
    s.add_argument("--ledger", type=Path, help="the ledger database (default $EMBER_HOME/ledger.db)")


def add_submit(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("submit", help="queue a training job with the service, or with --target send it "
                       "through the gate to remote compute")
    s.add_argument("recipe", type=Path)
    s.add_argument("--priority", type=int, default=0, help="higher runs first and may preempt lower (default 0)")
    s.add_argument("--name", type=job_name, help=f"the job's name, {NAME_GRAMMAR} (default RECIPE-ID)")
    s.add_argument("--out", type=Path, help="the run folder (default $EMBER_HOME/runs/NAME)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    from ember.cli.remote import add_remote_args
    add_remote_args(s, required=False)  # --target: through the gate to remote compute instead


def add_queue(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("queue", help="the service's jobs: state, priority, devices, progress, goodput, "
                       "run folder; `ember queue purge` removes finished ones")
    s.add_argument("--json", action="store_true")
    s.add_argument("--explain", action="store_true", help="why each unfinished job does not train now: a hand's "
                   "pause or hold, the owner's rules, yield, inference, memory, priority, devices")
    p = s.add_subparsers(dest="action", metavar="[purge]").add_parser(
        "purge", help="remove finished jobs from the queue (never their run folders or the ledger's runs)",
        description="Remove finished (completed, failed, cancelled) jobs from the queue: their rows, logs and "
        "control files. Their run folders and the ledger's runs, attempts and events are never touched: "
        "`ember runs` and the dashboard still show the runs. A queued, running or paused job is never "
        "removed: cancel it first.")
    p.add_argument("jobs", nargs="*", metavar="JOB", help="these jobs (each must be finished); default: every "
                   "finished job the filters choose")
    p.add_argument("--state", dest="states", action="append", choices=FINISHED,
                   help="only jobs that ended so (repeat for more; default all three)")
    p.add_argument("--older-than", dest="older_than", metavar="DURATION",
                   help="only jobs that ended longer ago than this, e.g. 7d, 12h, 30m")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def add_job_verbs(sub: argparse._SubParsersAction) -> None:
    """pause, resume, cancel and requeue: each names a job."""
    s = sub.add_parser("pause", help="pause a job: soft (at the next step, keeping the process) or --hard")
    s.add_argument("job")
    s.add_argument("--hard", action="store_true", help="checkpoint and exit, freeing the device; stays "
                   "queued until `ember resume`")
    for name, text in (("resume", "lift a pause or hold"), ("cancel", "cancel a job (checkpointing first)"),
                       ("requeue", "queue a failed or cancelled job again: its run resumes from its last "
                        "checkpoint")):
        sub.add_parser(name, help=text).add_argument("job")


def add_logs(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("logs", help="a job's output")
    s.add_argument("job")
    s.add_argument("-f", "--follow", action="store_true", help="keep printing as it grows")


def add_yield(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("yield", help="give the devices back now: returns once every job is off them")
    s.add_argument("--for", dest="duration", help="how long, e.g. 30m, 2h, 90s (default: until "
                   "`ember yield --release`)")
    s.add_argument("--release", action="store_true", help="end a yield now")


def parse_duration(text: str, option: str = "--for") -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|h|d)?\s*", text)
    if not m:
        raise EmberError(f"{option} {text!r}: write a duration like 90s, 30m, 2h or 1d")
    return float(m.group(1)) * {"s": 1, None: 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def job_name(text: str) -> str:
    """argparse type of --name: a bad name is a usage error (exit 2) that shows the grammar."""
    try:
        return check_job_name(text, "--name")
    except EmberError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def job_path(ref: str) -> str:
    """A job's name or id as one segment of the API's path: any character quoted ('²', ' ', '?',
    '#', '/'), so the service answers for that job, whatever it is called."""
    return quote(ref, safe="")


class Answer:
    """The service's answer to one request: status, body and headers."""

    def __init__(self, status_code: int, content: bytes, headers: Any):
        self.status_code, self.content, self.headers = status_code, content, headers

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


def request(method: str, path: str, body: dict | None = None, timeout: float = 30.0) -> Answer:
    """Call the running service; its error answers (ember.web.error_responses) become EmberErrors with its message."""
    # http.client, not httpx: importing httpx took 0.2 s of each command's 0.3-0.5 s (bench/startup.py).
    import http.client
    from urllib.parse import urlsplit

    from ember.web.announce import client_target
    url, token = client_target()
    where = urlsplit(url)
    headers = {"Authorization": f"Bearer {token}"}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.request(method, where.path.rstrip("/") + path, body=data, headers=headers)
        answer = conn.getresponse()
        r = Answer(answer.status, answer.read(), answer.headers)
    except (OSError, http.client.HTTPException) as e:
        raise EmberError(f"the service at {url} does not answer ({e or type(e).__name__}); is `ember serve` "
                         f"running?") from None
    finally:
        conn.close()
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):  # not the service's shape: a proxy's page, say
            message = r.text[:2000]
        raise EmberError(f"{message} (HTTP {r.status_code})")
    return r


def cmd(args: argparse.Namespace) -> int:
    return {"serve": cmd_serve, "ui": cmd_ui, "submit": cmd_submit, "queue": cmd_queue, "pause": cmd_job,
            "resume": cmd_job, "cancel": cmd_job, "requeue": cmd_job, "logs": cmd_logs,
            "yield": cmd_yield}[args.command](args)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.explain:
        return print_explained()
    if args.install_unit:
        from ember.web.unit import install_unit
        path, replaced = install_unit()
        print(f"{'replaced' if replaced else 'wrote'} {path}; start it with: systemctl --user daemon-reload && "
              f"systemctl --user enable --now ember (and loginctl enable-linger $USER to keep it running "
              f"when you log out)")
        return 0
    from ember.cli.render import stderr_events
    from ember.web.server import ServeOptions, serve
    return serve(ServeOptions(args.host, args.port, args.devices, args.ledger), stderr_events(stamped=True))


def cmd_ui(args: argparse.Namespace) -> int:
    from ember.cli.render import stderr_events
    from ember.web.server import UiOptions, ui
    return ui(UiOptions(args.host, args.port, args.ledger), stderr_events(stamped=True))


def cmd_submit(args: argparse.Namespace) -> int:
    from ember.cli import remote
    if args.target:
        return remote.cmd_submit_remote(args)
    remote.require_no_limits_without_target(args)
    body = {"recipe": str(args.recipe.resolve()), "priority": args.priority, "overrides": args.overrides}
    if args.name:
        body["name"] = args.name
    if args.out:
        body["out"] = str(args.out.resolve())
    job = request("POST", "/api/jobs", body, timeout=900).json()
    print(f"job {job['id']} {job['name']}: {job['state']} (priority {job['priority']}; run folder {job['out']})")
    return 0


def print_explained() -> int:
    """`ember queue --explain` (and `ember serve --explain`): each unfinished job and what keeps it
    from training, as the service sees it now."""
    out = Console(soft_wrap=True)
    rows = request("GET", "/api/explain").json()
    for row in rows:
        why = "; ".join(row["waiting"]) or "nothing holds it: it trains"
        extra = "".join(f", {k} {row[k]}" for k in ("hold", "pause") if row[k])
        out.print(f"{row['job']} ({row['state']}{extra}): {why}", markup=False, highlight=False)
    if not rows:
        out.print("no unfinished jobs", markup=False)
    print_owner_notes()
    return 0


def print_owner_notes() -> None:
    """owner.toml's state in the service, when it is not simply in force: the error that left the
    rules as they were, or the changes that wait for a restart (stderr: --json stays parseable)."""
    err = Console(stderr=True, soft_wrap=True)
    for note in request("GET", "/api/owner").json()["notes"]:
        err.print(f"warning: {note}", markup=False, highlight=False)


def cmd_queue(args: argparse.Namespace) -> int:
    if args.action == "purge":
        return cmd_purge(args)
    if args.explain:
        return print_explained()
    jobs = request("GET", "/api/jobs").json()
    if args.json:
        print(json.dumps(jobs, indent=1))
        print_owner_notes()
        return 0
    table = Table("id", "name", "state", "priority", "devices", "progress", "goodput", "note")
    for j in jobs:
        note = j["hold"] and f"held: {j['hold']}" or j["pause"] and f"pause: {j['pause']}" or ""
        if j["held_by"] and j["state"] not in FINISHED:
            note = "; ".join(filter(None, [note, *j["held_by"]]))
        if j["state"] == "failed":
            note = f"{j['cause'] or 'no cause recorded'}; its output: ember logs {j['name']}"
        # Text, never markup: a cause names keys as '[train] max_steps', which rich would take for a style.
        table.add_row(str(j["id"]), escape(j["name"]), j["state"], str(j["priority"]),
                      ",".join(map(str, j["devices"])) or "-", f"{j['step']}/{j['max_steps']}",
                      "-" if j["goodput"] is None else f"{j['goodput']:.0%}", escape(note))
    out = Console(soft_wrap=True)
    out.print(table)
    if jobs:  # below the table, whole: a path in a column is cut to the terminal's width
        out.print("run folders:\n" + "\n".join(run_line(j) for j in jobs), markup=False, highlight=False)
    print_owner_notes()
    return 0


def run_line(j: dict) -> str:
    """A job's run folder, and its run's id (its dashboard page /runs/ID) once it trained."""
    return f"  {j['name']}: {j['out']}" + (f" (run {j['run']})" if j["run"] else "")


def cmd_purge(args: argparse.Namespace) -> int:
    body = {"jobs": args.jobs, "states": args.states, "dry_run": args.dry_run,
            "older_than_seconds": None if args.older_than is None else parse_duration(args.older_than, "--older-than")}
    removed = request("POST", "/api/jobs/purge", body).json()["removed"]
    if not removed:
        chosen = args.jobs or args.states or args.older_than
        print(f"no finished job{' matches' if chosen else ''}: nothing removed")
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(removed)} finished job(s) from the queue; their run folders and the ledger's runs stay:")
    for j in removed:
        print(f"  {j['id']} {j['name']} ({j['state']}): {j['out']}" + (f" (run {j['run']})" if j["run"] else ""))
    return 0


def cmd_job(args: argparse.Namespace) -> int:
    body = {"hard": True} if getattr(args, "hard", False) else {}
    j = request("POST", f"/api/jobs/{job_path(args.job)}/{args.command}", body, timeout=120).json()
    extra = f", pause: {j['pause']}" if j["pause"] else f", held: {j['hold']}" if j["hold"] else ""
    if args.command == "requeue":
        extra += f"; its run resumes from its last checkpoint in {j['out']}"
    waiting = f" ({'; '.join(j['waiting'])})" if j["waiting"] else ""
    print(f"job {j['id']} {j['name']}: {j['state']}{extra}{waiting}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    offset = 0
    while True:
        r = request("GET", f"/api/jobs/{job_path(args.job)}/logs?offset={offset}")
        sys.stdout.buffer.write(r.content)
        sys.stdout.flush()
        offset = int(r.headers.get("X-Ember-Offset", offset))
        if not args.follow:
            return 0
        state = request("GET", f"/api/jobs/{job_path(args.job)}").json()["state"]
        if state in FINISHED and not r.content:
            return 0
        time.sleep(0.5)


def cmd_yield(args: argparse.Namespace) -> int:
    if args.release:
        request("POST", "/api/yield", {"release": True})
        print("yield released: jobs may start again")
        return 0
    seconds = None if args.duration is None else parse_duration(args.duration)
    from ember.sched.yield_hold import MAX_SECONDS
    if seconds is not None and not 0 < seconds <= MAX_SECONDS:  # before, the API's refusal named its field
        raise EmberError(f"--for {args.duration!r}: " + ("must be longer than 0" if seconds <= 0 else
                         f"at most {MAX_SECONDS // 86400}d at once; for longer, run `ember yield` without "
                         f"--for and end it with `ember yield --release`"))
    r = request("POST", "/api/yield", {"seconds": seconds}, timeout=900).json()
    until = "until `ember yield --release`" if seconds is None else f"for {args.duration}"
    print(f"devices free after {r['freed_after_seconds']:.2f} s; training held {until}")
    return 0 if r else EXIT_ERROR
