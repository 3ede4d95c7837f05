"""`ember policy check` and `ember submit --target` as library calls: the plan's prediction for
the target, the gate's decision, the audit row, and only for an allowed submission the target's
backend (ember.remote.backends: Slurm's stages the data, writes the batch script and sbatch's it).

    decide     load the recipe, the registry and the targets; resolve the data paths (realpath) and
               hash them, the datasets they are staged from (every byte: each is staged whole, so
               each of its paths is checked too) and every registered dataset's files (the hash
               cache: content identity); predict device-hours, cost and
               wall time (ember plan, for the target's device and price); the month's committed
               spend from the ledger; check(); append the audit row
    submit     decide; refused: stop here (nothing is staged, the backend is never asked)
               allowed: a remote job row (staging), the backend's submit (the datasets copied
               and verified on arrival, the recipe written, the job queued), the job pending; a
               failure on the way removes the job's folder on the cluster, and the job is failed
    continue   (ember remote continue) a stopped, cancelled or failed job: decide again for the
               recipe it was submitted with and new limits; allowed: the backend's resubmit in
               its folder (the staged data and recipe stay); its run resumes from its newest
               checkpoint
"""

from __future__ import annotations

import datetime as dt
import getpass
import math
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ember.durable import sha256_file
from ember.errors import Conflict, EmberError, Refused
from ember.events import Events
from ember.ledger import audit
from ember.ledger import database as ledger_store
from ember.ledger import remote_rows as rows
from ember.ledger.job_states import CONTINUABLE, REMOTE_FINAL, JobState
from ember.paths import cached_sha256, check_name, default_run_folder, name_from
from ember.policy.gate import Decision, LedgerView, Limits, Prediction, Request, check, month_of, wall_budget_seconds
from ember.policy.registry import Registry, contents_of, dataset_contents, fingerprint_files, holdings, load_registry
from ember.policy.targets import Target, load_targets
from ember.recipe import LORA_ONLY, Recipe, load_recipe, to_toml
from ember.remote import stage
from ember.remote.backend import Launch
from ember.remote.backends import BACKENDS, backend_for, title
from ember.remote.tracking import find_job, move, status
from ember.runfolder import mark_remote, remote_job


@dataclass
class RemoteRequest:
    recipe_file: Path
    target: str
    limits: Limits
    nodes: int = 1
    overrides: list[str] = field(default_factory=list)
    out: Path | None = None            # the local run folder results come back to
    name: str | None = None
    registry: Path | None = None       # a datasets.toml to read alone
    targets: Path | None = None        # a targets.toml to read alone
    ledger: Path | None = None
    done_steps: int = 0                # a continued job: the steps its run has made (the prediction is the rest)
    continues: str = ""                # a continued job: the recipe digest it was submitted with


@dataclass
class Decided:
    decision: Decision
    audit: audit.AuditRow
    recipe: Recipe
    target: Target | None
    registry: Registry
    digests: dict[str, str] = field(default_factory=dict)  # each file the decision read: its SHA-256


class GateRefused(Refused):
    """The gate refused the job: every reason, one a line."""

    def __init__(self, decided: Decided):
        self.decided = decided
        reasons = "\n".join(f"  - {v.code}: {v.message}" for v in decided.decision.reasons)
        super().__init__(f"refused by the gate (audit row {decided.audit.id}); nothing was staged or "
                         f"submitted:\n{reasons}")


def decide(req: RemoteRequest, action: str, events: Events) -> Decided:
    """The gate's decision for this request, appended to the audit log."""
    recipe = load_recipe(req.recipe_file, req.overrides, events.warn)
    registry, targets = load_registry(req.registry), load_targets(BACKENDS, req.targets)
    target = targets.get(req.target)
    files = resolved(recipe.data.files + recipe.eval.files)
    read: dict[Path, str] = {}  # every byte of a file the job may take is read once in this decision

    def digest(path: Path) -> str:
        if path not in read:
            read[path] = sha256_file(path)
        return read[path]

    staged = {h.source for h in holdings(list(files), registry).values() if h.source is not None}
    contents = {f: contents_of([f], digest) for f in files}
    # A staged dataset is sent whole: what each of its paths holds counts by content too.
    contents |= {p: contents_of([p], digest) for name in sorted(staged) for p in registry[name].paths
                 if p not in contents}
    # What each dataset holds by content: its files as registered, and as they are now.
    registered = {name: dataset_contents(ds, lambda f: read.get(f) or cached_sha256(f))
                  for name, ds in registry.items()}
    observed = {}
    for name in sorted(staged):
        try:
            observed[name] = fingerprint_files(registry[name].paths, digest)
        except EmberError as e:  # a registered file gone: the gate says the dataset was not hashed
            events.warn(f"dataset '{name}': {e}")
    prediction = predict(req, target, events) if target is not None else Prediction(None, None, None, "no target")
    now = time.time()
    con = ledger_store.connect(req.ledger)
    try:
        month, since = month_of(now)
        view = LedgerView(month, rows.month_spend(con, req.target, since, REMOTE_FINAL))
        decision = check(Request(recipe.digest(), files, observed, req.target, req.limits, req.nodes,
                                 prediction, now, contents, registered, req.continues), registry, targets, view)
        row = audit.append(con, {
            "time": now, "who": f"{getpass.getuser()}@{socket.gethostname()}", "action": action,
            "recipe": str(req.recipe_file.resolve()), "recipe_digest": recipe.digest(), "target": req.target,
            "datasets": [asdict(u) for u in decision.datasets], "limits": asdict(req.limits) | {"nodes": req.nodes},
            "prediction": asdict(prediction), "decision": "allowed" if decision.allowed else "refused",
            "reasons": [asdict(v) for v in decision.reasons]})
    finally:
        con.close()
    return Decided(decision, row, recipe, target, registry, {str(f): d for f, d in read.items()})


def predict(req: RemoteRequest, target: Target, events: Events) -> Prediction:
    """`ember plan` for the target: its device's peak and price. Device-hours are one device's
    predicted wall-clock (ideal scaling: n devices take 1/n of the time each); the wall time is
    those device-hours over the job's devices."""
    from ember.doctor.calibrated_plan import PlanRequest, plan_recipe
    sets = [f"cost.device_hour_price={target.price}", "cost.devices=1", "cost.watts=0"]
    sets += [f"cost.peak_tflops={target.peak_tflops}"] * (target.peak_tflops > 0)
    sets += ["train.device=cpu"] * (target.device == "cpu")
    try:
        plan = plan_recipe(PlanRequest(req.recipe_file, req.overrides + sets, ledger=req.ledger), events).plan
    except EmberError as e:
        return Prediction(None, None, None, f"the plan failed: {e}")
    seconds = plan.time.wall_seconds
    if not math.isfinite(seconds):
        return Prediction(None, None, None, plan.time.how)
    device_hours = seconds / 3600
    how = f"ember plan: {plan.time.how}; {plan.time.steps} steps"
    if req.done_steps:  # a continued job: what is left of it
        left = max(plan.time.steps - req.done_steps, 0)
        device_hours *= left / plan.time.steps
        how += f", of which {left} are left"
    devices = req.nodes * target.devices_per_node
    if devices < 1:  # --nodes 0 or below: the gate refuses it (invalid-limit); no wall time to predict
        return Prediction(device_hours, device_hours * target.price, None, f"{how}; --nodes {req.nodes}: no devices")
    return Prediction(device_hours, device_hours * target.price, device_hours / devices, how)


def resolved(paths: list[str]) -> tuple[str, ...]:
    """Data paths as the gate compares them: after realpath (a link is the file it points to)."""
    return tuple(os.path.realpath(p) for p in paths)


@dataclass
class Submitted:
    job: rows.RemoteJobRow
    decided: Decided


def submit(req: RemoteRequest, events: Events) -> Submitted:
    """Plan, gate, audit; then the target's backend stages and queues the job. Raises GateRefused."""
    name = check_name(req.name, "--name") if req.name else \
        name_from(req.recipe_file.stem, f"{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}")
    out = req.out.resolve() if req.out else default_run_folder(name)
    if out.exists() and any(out.iterdir()):
        raise EmberError(f"--out {out}: exists and is not empty; results of a remote job come back to a new "
                         f"folder" + _continue_hint(out))
    con = ledger_store.connect(req.ledger)
    try:
        known = rows.find(con, name)
        if known:
            raise EmberError(f"a remote job named '{name}' is in the ledger already ({known[0].state}); choose "
                             f"another --name" + (f", or `ember remote continue {name}` with new limits to "
                                                  f"resume it" if known[0].state in CONTINUABLE else ""))
    finally:
        con.close()
    decided = decide(req, "submit", events)
    if not decided.decision.allowed:
        raise GateRefused(decided)
    target = decided.target
    job_dir = f"{target.stage_dir.rstrip('/')}/{name}"
    limits = asdict(req.limits) | {"nodes": req.nodes}
    datasets = tuple(decided.registry[u.name] for u in decided.decision.datasets if u.staged)
    devices = req.nodes * target.devices_per_node
    launch = Launch(name, job_dir, target.interpreter(), req.nodes,
                    wall_budget_seconds(req.limits, devices, target.price),
                    staged_recipe(decided.recipe, list(datasets), job_dir, target, devices), datasets,
                    decided.digests)
    backend = backend_for(target.kind, target.host, target.ssh_options)
    con = ledger_store.connect(req.ledger)
    try:
        if rows.find(con, name):
            raise Conflict(f"a remote job named '{name}' is in the ledger already; choose another --name")
        job = rows.insert(con, {"name": name, "target": target.name, "audit_id": decided.audit.id,
                                "audit_hash": decided.audit.hash, "host": target.host,
                                "ssh_options": target.ssh_options, "python": target.interpreter(),
                                "recipe": str(req.recipe_file.resolve()), "out": str(out), "remote_dir": job_dir,
                                "limits": limits, "prediction": decided.audit.prediction,
                                "backend": target.kind}, JobState.STAGING)
        try:
            backend_id = backend.submit(launch, target, events)
        except EmberError as e:
            move(con, job, JobState.FAILED, f"staging or submitting to {backend.title} failed: {e}", detail=str(e))
            raise
        job = move(con, job, JobState.PENDING, f"submitted: {backend.title} job {backend_id}", backend_id=backend_id,
                   detail="submitted")
    finally:
        con.close()
    out.mkdir(parents=True, exist_ok=True)
    mark_remote(out, name, target.name)
    events.info(f"submitted {name} to '{target.name}' as {backend.title} job {backend_id}; results come back to {out}")
    return Submitted(job, decided)


def _continue_hint(out: Path) -> str:
    origin = remote_job(out)
    if origin is None:
        return ""
    return (f"; it holds remote job {origin['job']}'s results: `ember remote continue {origin['job']}` with new "
            f"limits resumes it")


def staged_recipe(recipe: Recipe, datasets: list, job_dir: str, target: Target, devices: int) -> str:
    """The recipe the job runs: its data files at their staged copies, the target's price."""
    d = recipe.to_dict()
    d["data"]["files"] = [f"{job_dir}/{stage.staged_path(f, datasets)}" for f in resolved(recipe.data.files)]
    d["eval"]["files"] = [f"{job_dir}/{stage.staged_path(f, datasets)}" for f in resolved(recipe.eval.files)]
    d["cost"].update({"device_hour_price": target.price, "devices": devices, "currency": target.currency})
    if recipe.method.kind == "full":  # LoRA's keys, written out, would make the run warn that they do nothing
        d["method"] = {k: v for k, v in d["method"].items() if k not in LORA_ONLY}
    return to_toml(d)


def continue_job(ref: str, req: RemoteRequest, events: Events) -> Submitted:
    """`ember remote continue`: a stopped, cancelled or failed job through the gate again, for the
    recipe it was submitted with and `req`'s new limits; allowed, submitted again in its folder,
    where its run resumes from its newest checkpoint. Raises Refused."""
    con = ledger_store.connect(req.ledger)
    try:
        job = find_job(con, ref, None)
        steps = status(con, job, None).steps
        let_go = audit.get(con, job.audit_id)
    finally:
        con.close()
    if job.state not in CONTINUABLE:
        raise EmberError(f"remote job {job.name} is {job.state}: " + (
            "it has completed; there is nothing to continue" if job.state == JobState.COMPLETED else
            f"it has not ended; `ember remote status {job.name} --wait` follows it"))
    if job.backend_id is None:
        raise EmberError(f"remote job {job.name} never reached {title(job.backend)} ({job.detail}): nothing ran; "
                         f"submit it again")
    if let_go is None or let_go.hash != job.audit_hash:
        raise EmberError(f"remote job {job.name}: the audit row that let it go ({job.audit_id}) is missing or "
                         f"changed; `ember policy audit --verify` says more")
    nodes = int(job.limits["nodes"])
    req = replace(req, recipe_file=Path(job.recipe), target=job.target, nodes=nodes, done_steps=steps,
                  continues=let_go.recipe_digest)
    decided = decide(req, "continue", events)
    if not decided.decision.allowed:
        raise GateRefused(decided)
    target = decided.target
    if (target.kind, target.host) != (job.backend, job.host):
        raise EmberError(f"target '{target.name}' now reaches {target.kind} on {target.host or 'this machine'}, and "
                         f"job {job.name}'s folder is {job.backend}'s on {job.host or 'this machine'}: it continues "
                         f"only there")
    budget = wall_budget_seconds(req.limits, nodes * target.devices_per_node, target.price)
    launch = Launch(job.name, job.remote_dir, job.python, nodes, budget)
    backend = backend_for(job.backend, target.host, target.ssh_options)
    limits = asdict(req.limits) | {"nodes": nodes, "spent_before": job.cost or 0.0}
    earlier = job.backend_id
    con = ledger_store.connect(req.ledger)
    try:
        # Claimed first (compare-and-set): a second `continue` of the same job stops here. No backend
        # id while staging: a status poll meanwhile does not read the earlier job's end as this one's.
        job = move(con, job, JobState.STAGING, f"ember remote continue: audit row {decided.audit.id}",
                   backend_id=None, audit_id=decided.audit.id, audit_hash=decided.audit.hash, limits=limits,
                   prediction=decided.audit.prediction, ssh_options=target.ssh_options, detail="continuing")
        try:
            backend_id = backend.resubmit(launch, target, events)
        except EmberError as e:  # it ran before: failed again, it may be continued again
            move(con, job, JobState.FAILED, f"continue: submitting to {backend.title} failed: {e}",
                 backend_id=earlier, detail=str(e))
            raise
        job = move(con, job, JobState.PENDING, f"submitted: {backend.title} job {backend_id} (continued from step "
                   f"{steps})", backend_id=backend_id, detail=f"continued from step {steps}")
    finally:
        con.close()
    events.info(f"continued {job.name} on '{target.name}' as {backend.title} job {backend_id}: it resumes from its "
                f"newest checkpoint; results come back to {job.out}")
    return Submitted(job, decided)
