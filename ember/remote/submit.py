"""`ember policy check` and `ember submit --target` as library calls: the plan's prediction for
the target, the gate's decision, the audit row, and only for an allowed submission the staging,
the batch script and `sbatch`.

    decide     load the recipe, the registry and the targets; hash the datasets the recipe reads;
               predict device-hours, cost and wall time (ember plan, for the target's device and
               price); the month's committed spend from the ledger; check(); append the audit row
    submit     decide; refused: stop here (nothing is staged, sbatch is never called)
               allowed: a remote job row (staging), the datasets copied and verified on arrival,
               recipe, job.json and job.sh written, `sbatch --parsable`, the job pending
"""

from __future__ import annotations

import datetime as dt
import getpass
import math
import secrets
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ember.errors import Conflict, EmberError, Refused
from ember.events import Events
from ember.ledger import audit
from ember.ledger import remote as rows
from ember.ledger import store as ledger_store
from ember.paths import check_name, default_run_folder, name_from
from ember.policy.gate import Decision, LedgerView, Limits, Prediction, Request, check, month_of, wall_budget_seconds
from ember.policy.registry import Registry, covering, fingerprint_files, load_registry
from ember.policy.targets import Target, load_targets
from ember.recipe import LORA_ONLY, Recipe, load_recipe, to_toml
from ember.remote import jobs, slurm, stage
from ember.remote.script import DATA_SUMS, SCRIPT_FILE, SPEC_FILE, JobSpec, batch_script, time_minutes
from ember.remote.shell import Shell


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


@dataclass
class Decided:
    decision: Decision
    audit: audit.AuditRow
    recipe: Recipe
    target: Target | None
    registry: Registry


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
    registry, targets = load_registry(req.registry), load_targets(req.targets)
    target = targets.get(req.target)
    files = tuple(recipe.data.files + recipe.eval.files)
    used, _ = covering(list(files), registry)
    observed = {}
    for name in used:
        try:
            observed[name] = fingerprint_files(registry[name].paths)
        except EmberError as e:  # a registered file gone: the gate says the dataset was not hashed
            events.warn(f"dataset '{name}': {e}")
    prediction = predict(req, target, events) if target is not None else Prediction(None, None, None, "no target")
    now = time.time()
    con = ledger_store.connect(req.ledger)
    try:
        month, since = month_of(now)
        view = LedgerView(month, rows.month_spend(con, req.target, since, jobs.FINAL))
        decision = check(Request(recipe.digest(), files, observed, req.target, req.limits, req.nodes,
                                 prediction, now), registry, targets, view)
        row = audit.append(con, {
            "time": now, "who": f"{getpass.getuser()}@{socket.gethostname()}", "action": action,
            "recipe": str(req.recipe_file.resolve()), "recipe_digest": recipe.digest(), "target": req.target,
            "datasets": [asdict(u) for u in decision.datasets], "limits": asdict(req.limits) | {"nodes": req.nodes},
            "prediction": asdict(prediction), "decision": "allowed" if decision.allowed else "refused",
            "reasons": [asdict(v) for v in decision.reasons]})
    finally:
        con.close()
    return Decided(decision, row, recipe, target, registry)


def predict(req: RemoteRequest, target: Target, events: Events) -> Prediction:
    """`ember plan` for the target: its device's peak and price. Device-hours are one device's
    predicted wall-clock (ideal scaling: n devices take 1/n of the time each); the wall time is
    those device-hours over the job's devices."""
    from ember.doctor.planning import PlanRequest, plan_recipe
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
    devices = req.nodes * target.devices_per_node
    return Prediction(device_hours, device_hours * target.price, device_hours / devices,
                      f"ember plan: {plan.time.how}; {plan.time.steps} steps")


@dataclass
class Submitted:
    job: rows.RemoteJobRow
    decided: Decided


def submit(req: RemoteRequest, events: Events) -> Submitted:
    """Plan, gate, audit; then stage, write the batch script and sbatch it. Raises GateRefused."""
    name = check_name(req.name, "--name") if req.name else \
        name_from(req.recipe_file.stem, f"{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}")
    out = req.out.resolve() if req.out else default_run_folder(name)
    if out.exists() and any(out.iterdir()):
        raise EmberError(f"--out {out}: exists and is not empty; results of a remote job come back to a new folder")
    decided = decide(req, "submit", events)
    if not decided.decision.allowed:
        raise GateRefused(decided)
    target = decided.target
    job_dir = f"{target.stage_dir.rstrip('/')}/{name}"
    limits = asdict(req.limits) | {"nodes": req.nodes}
    con = ledger_store.connect(req.ledger)
    try:
        if rows.find(con, name):
            raise Conflict(f"a remote job named '{name}' is in the ledger already; choose another --name")
        job = rows.insert(con, {"name": name, "target": target.name, "audit_id": decided.audit.id,
                                "audit_hash": decided.audit.hash, "host": target.host,
                                "ssh_options": target.ssh_options, "python": target.interpreter(),
                                "recipe": str(req.recipe_file.resolve()), "out": str(out), "remote_dir": job_dir,
                                "limits": limits, "prediction": decided.audit.prediction}, "staging")
        try:
            slurm_id = _stage_and_sbatch(req, decided, name, job_dir, events)
        except EmberError as e:
            jobs.move(con, job, "failed", f"staging or sbatch failed: {e}", detail=str(e))
            raise
        job = jobs.move(con, job, "pending", f"sbatch: Slurm job {slurm_id}", slurm_id=slurm_id,
                        detail="submitted")
    finally:
        con.close()
    out.mkdir(parents=True, exist_ok=True)
    events.info(f"submitted {name} to '{target.name}' as Slurm job {slurm_id}; results come back to {out}")
    return Submitted(job, decided)


def _stage_and_sbatch(req: RemoteRequest, decided: Decided, name: str, job_dir: str, events: Events) -> str:
    target, recipe = decided.target, decided.recipe
    shell = Shell(target.host, target.ssh_options)
    datasets = [decided.registry[u.name] for u in decided.decision.datasets]
    devices = req.nodes * target.devices_per_node
    budget = wall_budget_seconds(req.limits, devices, target.price)
    minutes = time_minutes(budget, target.signal_seconds, target.allocation_minutes)
    spec = JobSpec(name, job_dir, target.interpreter(), req.nodes, target.devices_per_node, budget, minutes,
                   target.signal_seconds, target.partition, target.account, target.gres, list(target.sbatch_args))
    if shell.run(["test", "-e", job_dir], check=False).returncode == 0:
        raise Conflict(f"{shell.where()}:{job_dir} exists: another job's folder; choose another --name")
    with tempfile.TemporaryDirectory(prefix="ember-stage-") as tmp:
        bundle = Path(tmp) / "data-bundle"
        bundle.mkdir()
        stage.link_datasets(bundle, datasets)
        events.stage(f"staging {len(datasets)} dataset(s) to {shell.where()}:{job_dir}")
        shell.put(bundle, job_dir)
        sums = stage.verify_arrival(shell, job_dir, datasets)
        events.info(f"verified on arrival: {', '.join(d.name for d in datasets)} (fingerprints match)")
        control = Path(tmp) / "control"
        control.mkdir()
        (control / "recipe.toml").write_text(staged_recipe(recipe, datasets, job_dir, target, devices))
        (control / SPEC_FILE).write_text(spec.to_json())
        (control / SCRIPT_FILE).write_text(batch_script(spec))
        (control / DATA_SUMS).write_text(sums)
        shell.put(control, job_dir)
    return slurm.sbatch(shell, f"{job_dir}/{SCRIPT_FILE}")


def staged_recipe(recipe: Recipe, datasets: list, job_dir: str, target: Target, devices: int) -> str:
    """The recipe the job runs: its data files at their staged copies, the target's price."""
    d = recipe.to_dict()
    d["data"]["files"] = [f"{job_dir}/{stage.staged_path(f, datasets)}" for f in recipe.data.files]
    d["eval"]["files"] = [f"{job_dir}/{stage.staged_path(f, datasets)}" for f in recipe.eval.files]
    d["cost"].update({"device_hour_price": target.price, "devices": devices, "currency": target.currency})
    if recipe.method.kind == "full":  # LoRA's keys, written out, would make the run warn that they do nothing
        d["method"] = {k: v for k, v in d["method"].items() if k not in LORA_ONLY}
    return to_toml(d)
