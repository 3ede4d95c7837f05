"""The service's jobs as the ledger keeps them: what is queued, under which name and run folder,
with which request (its plan's memory per device), and every state change through
ember.ledger.job_states.move (the one module that changes a job's state). No processes here
(ember.sched.job_processes) and no decisions of who runs next (ember.sched.scheduler).

A job's name is unique among the rows the queue keeps; a run folder belongs to at most one
unfinished job. Finished jobs leave the queue only by a hand's purge; their transitions stay.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember.errors import BadInput, Conflict, NotFound
from ember.ledger import job_rows as rows
from ember.ledger.database import connect, latest_run_at
from ember.ledger.job_rows import JobRow
from ember.durable import write_durable
from ember.paths import home, name_from
from ember.recipe import load_recipe
from ember.ledger import job_states as jobs
from ember.ledger.job_states import LIVE, LOCAL_FINAL as FINAL
from ember.sched.plan_child import plan_json

PLANS_KEPT = 256  # submitted recipes whose plans are remembered (a submit of one seen before is not re-planned)


class JobQueue:
    """The jobs table of one ledger, read and changed for the service."""

    def __init__(self, ledger: Path):
        self.path = ledger
        self.con = connect(ledger, shared=True)
        self.plans: dict[str, dict] = {}   # by recipe content and overrides: see `request`

    # ---- reading ---------------------------------------------------------------------------

    def find(self, ref: str) -> JobRow:
        """The job named or numbered `ref`."""
        job = rows.find(self.con, str(ref))
        if job is None:
            raise NotFound(f"no job {ref!r}; `ember queue` lists them")
        return job

    def get(self, job_id: int) -> JobRow | None:
        """The job with this id as it is now; None once purged."""
        return rows.get(self.con, job_id)

    def jobs(self, states: tuple[str, ...] | None = None) -> list[JobRow]:
        """Every job (in those states), oldest first."""
        return rows.all_jobs(self.con, states)

    def live(self) -> list[JobRow]:
        """The jobs that have a process (or should): starting, running, soft-paused, preempting."""
        return rows.all_jobs(self.con, LIVE)

    def queued(self) -> list[JobRow]:
        """The queued jobs admission may start: those without a hold."""
        return [j for j in rows.all_jobs(self.con, ("queued",)) if j.hold is None]

    def waited(self, job: JobRow, now: float) -> float:
        """Seconds the job could have started since it was submitted (or requeued by hand)."""
        return rows.waited_seconds(self.con, job, now)

    def waited_all(self, jobs: list[JobRow], now: float) -> dict[int, float]:
        """`waited` of each of these queued jobs, by id, in one query."""
        return rows.waited_seconds_of(self.con, jobs, now)

    def run_of(self, job: JobRow) -> str | None:
        """The ledger's id of the run in the job's folder; None before it trained."""
        return latest_run_at(self.con, Path(job.out))

    # ---- changing ---------------------------------------------------------------------------

    def move(self, job: JobRow, dst: str, why: str, **fields: Any) -> JobRow | None:
        """ember.ledger.job_states.move on this ledger."""
        return jobs.move(self.con, job, dst, why, **fields)

    def request(self, recipe: Path, overrides: list[str]) -> dict:
        """The job's request: the recipe as admitted (read once, resolved, with its overrides: what
        the job trains, whatever happens to the file later; ember.launchspec), and from `ember plan
        --json` on that snapshot (in a child: no torch here) memory per device with margin, device
        count, verdict, reasons, max_steps, the predicted step time. Remembered by the resolved
        recipe's digest: a recipe submitted again is not re-planned."""
        resolved = load_recipe(recipe, overrides)
        key = resolved.digest()
        if key not in self.plans:
            snapshot = home().recipe_snapshot(key)
            if not snapshot.is_file():
                snapshot.parent.mkdir(parents=True, exist_ok=True)
                write_durable(snapshot, resolved.to_toml() + "\n")
            plan = plan_json(snapshot, [], self.path)
            step = plan["time"]["step_seconds"]
            self.plans[key] = {
                "memory": int(plan["memory"]["with_margin"]), "count": 1, "verdict": plan["verdict"],
                "reasons": plan["reasons"], "max_steps": plan["recipe"]["max_steps"],
                "step_seconds": step if isinstance(step, (int, float)) and math.isfinite(step) else None}
            while len(self.plans) > PLANS_KEPT:  # each `--set` tried is a recipe of its own
                self.plans.pop(next(iter(self.plans)))
        return {**self.plans[key], "recipe": resolved.to_dict(), "recipe_digest": key}

    def name_for(self, name: str | None, recipe: Path) -> str:
        """`name`, or one made from the recipe's file name and the next id; refused when taken."""
        name = name or name_from(recipe.stem, str(rows.next_id(self.con)))
        if rows.name_taken(self.con, name):
            raise Conflict(f"job name {name!r} is taken; choose another --name")
        return name

    def add(self, name: str, recipe: Path, folder: Path, overrides: list[str], priority: int,
            request: dict) -> JobRow:
        """Queue a job; refused when an unfinished job trains in `folder` already."""
        busy = self._owner_of(str(folder))
        if busy:
            raise Conflict(f"run folder {folder} belongs to job {busy.name} ({busy.state}); "
                           f"cancel it or choose another --out")
        return rows.insert(self.con, name, str(recipe), str(folder), overrides, priority, request, "queued")

    def requeue(self, job: JobRow, allowed: Callable[[str], Path]) -> JobRow:
        """Queue a failed or cancelled job again, to resume its run folder's last checkpoint (from
        the start if it never trained) with the recipe it was admitted with (the file itself is
        not needed); refused when that cannot resume it. `allowed(path)`: the
        recipe's path resolved, or the refusal of a path outside the owner's allowed folders."""
        if job.state not in ("failed", "cancelled"):
            raise Conflict(f"job {job.name} is {job.state}: only a failed or cancelled job is requeued"
                           + ("" if job.state == "completed" else f"; `ember resume {job.name}` lifts "
                              f"a pause or hold"))
        folder, recipe = Path(job.out), allowed(job.recipe)
        run = latest_run_at(self.con, folder)
        if run is not None and not folder.is_dir():
            raise NotFound(f"job {job.name}: its run folder {folder} is gone (the ledger's run {run} "
                           f"trained there), so there is nothing to resume; submit the recipe again "
                           f"for a new run: `ember submit {recipe} --name NEW_NAME`")
        if "recipe" not in job.request and not recipe.is_file():  # queued before jobs kept their recipe
            raise NotFound(f"job {job.name}: its recipe {recipe} is gone; put it back (the run resumes "
                           f"only with the recipe it trained with) and requeue again")
        busy = self._owner_of(job.out)
        if busy:
            raise Conflict(f"job {job.name}: its run folder {folder} belongs to job {busy.name} "
                           f"({busy.state}) now; cancel that job first")
        # It joins the queue now: ageing (ember.sched.admission) counts from here, not the days it sat ended.
        return self.move(job, "queued", "requeued by hand", hold=None, pause=None, cause=None,
                         submitted=time.time()) or job

    def finished(self, refs: list[str], states: list[str] | None, older_than: float | None) -> list[JobRow]:
        """The finished jobs a purge removes: `refs` (each must be finished), else every finished
        one; `states` and `older_than` (seconds since it ended) narrow the choice."""
        wanted = tuple(states or FINAL)
        for state in wanted:
            if state not in FINAL:
                raise BadInput(f"state {state!r}: only finished jobs (completed, failed, cancelled) are "
                               f"purged; a queued, running or paused job is cancelled first (`ember cancel JOB`)")
        if older_than is not None and older_than < 0:
            raise BadInput(f"older than {older_than:g} s: must be 0 or more")
        chosen = list({j.id: j for j in map(self.find, refs)}.values()) if refs else self.jobs(FINAL)
        for job in chosen:
            if job.state not in FINAL:
                raise Conflict(f"job {job.name} is {job.state}: only finished jobs (completed, failed, "
                               f"cancelled) are purged; nothing was removed. `ember cancel {job.name}` "
                               f"ends it first")
        cutoff = math.inf if older_than is None else time.time() - older_than
        return [j for j in chosen if j.state in wanted and j.updated <= cutoff]

    def remove(self, job: JobRow) -> bool:
        """Purge a finished job's row (ember.ledger.job_states.remove); False when a requeue got there first."""
        return jobs.remove(self.con, job, "purged by hand")

    def _owner_of(self, out: str) -> JobRow | None:
        """The unfinished job that trains in run folder `out`, if any."""
        busy = [j for j in rows.all_jobs(self.con) if j.out == out and j.state not in FINAL]
        return busy[0] if busy else None
