"""`ember plan` as one library call: the plan's arithmetic, with a measured step when asked for
(--calibrate), its step traced when the estimator does not know the family, and the best remedy written
out as a recipe (--apply). The measuring is why this lives with the doctor, not in ember/plan."""

from __future__ import annotations

import math
import os
import socket
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from ember.errors import EmberError
from ember.events import Events
from ember.doctor.comm import to_interconnect
from ember.ledger import comm_rows as comm
from ember.ledger import database as ledger_store
from ember.models import check_against_model, config_fields
from ember.plan.memory import estimate
from ember.plan.advisor import Advice, advise
from ember.plan.planner import Plan, has_formulas, make_plan, planned_devices
from ember.plan.remedies import Remedy, train_shape
from ember.recipe import Recipe, load_recipe


@dataclass
class PlanRequest:
    recipe_file: Path
    overrides: list[str] = field(default_factory=list)
    target_micro_batch: int | None = None
    calibrate: bool = False
    device_memory_gib: float | None = None
    ledger: Path | None = None
    apply: Path | None = None          # write the recipe with the best remedy that fits here


@dataclass
class PlanResult:
    plan: Plan
    target_micro_batch: int | None
    applied: Remedy | None = None      # the remedy written to request.apply
    apply_note: str = ""               # why nothing was written, when nothing was


def plan_recipe(req: PlanRequest, events: Events) -> PlanResult:
    """The plan for a recipe file on this machine (or a device of --device-memory GiB)."""
    r = load_recipe(req.recipe_file, req.overrides, events.warn)
    if req.target_micro_batch is not None:
        if req.target_micro_batch < 1:
            raise EmberError(f"--target-micro-batch {req.target_micro_batch}: must be >= 1")
        r = r.with_changes({"train.micro_batch": req.target_micro_batch}, "--target-micro-batch")
    devices = planned_devices(r, req.device_memory_gib)
    con = ledger_store.connect_or_warn(req.ledger, events.warn)  # this machine's history
    measured = calibrate(r) if req.calibrate else None  # a plan without it imports no torch
    traced = None
    if not has_formulas(r):  # a family without formulas: its step traced (and measured, if asked)
        # what the config alone refuses (a LoRA target the model lacks) is refused torch-free, first
        check_against_model(r.data.seq_len, r.method, config_fields(r.model.path))
        from ember.doctor.traced import traced_step
        traced = traced_step(r)
    plan = make_plan(r, con, measured, devices, traced)
    if con is not None and plan.model is not None and plan.model.shape is not None:
        plan.parallel = parallel_advice(r, plan, con)
    result = PlanResult(plan, req.target_micro_batch)
    if req.apply is not None:
        usable = [x for x in plan.remedies if x.fits and x.available and (x.changes or x.launch)]
        if plan.fits:
            result.apply_note = f"fits as written: nothing to apply; {req.apply} not written"
        elif not usable:
            raise EmberError("no remedy ember can apply makes this recipe fit; see the verdict")
        else:
            result.applied = usable[0]
            req.apply.write_text(r.with_changes(usable[0].changes, f"remedy {usable[0].name}").to_toml())
    return result


def calibrate(r: Recipe):
    """A step measured on this machine (ember.doctor.measure; imports torch, so only when needed)."""
    from ember.doctor.measure import calibrate as measure
    return measure(r)


def parallel_advice(r: Recipe, plan: Plan, con: sqlite3.Connection) -> Advice | None:
    """The advisor's table for this recipe over the newest interconnect measured from this host
    (`ember doctor --comm`); None when none was measured or the step time is unknown."""
    row = comm.newest(con, socket.gethostname())
    if row is None or not math.isfinite(plan.time.step_seconds):
        return None
    m, t = plan.model.shape, train_shape(r)
    dev = plan.devices[0]
    slots, threads, cores = None, 0, 0
    if dev.kind == "cpu":  # ranks on this machine share its cores: as many compute at once as fit
        cores = os.cpu_count() or 1
        threads = r.train.threads or cores
        slots = max(1, cores // threads) * max(1, len(row.hosts))
    return advise(m, t, estimate(m, t), r.train.grad_accum, plan.time.step_seconds, to_interconnect(row),
                  dev.free, slots=slots, threads=threads, cores=cores,
                  pipeline=(str(r.distributed.schedule), r.distributed.pp_size))
