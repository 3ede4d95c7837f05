"""`ember run` as one library call: what the command, and later the service, call to train.

    run(request, events) -> RunOutcome
      recipe           load and validate (a bad recipe fails here and is never restarted)
      completed?       a run that already reached max_steps answers so and touches nothing
      memory           the plan's estimated peak against this machine's free memory, before
                       anything is built; a recipe that does not fit is refused with the remedy
      preflight        optional: the checks of `ember preflight`, stopping on a failure
      supervise        with restarts: the training runs in a child process, restarted after crashes
      train            prepare the job (ember.train.job) and run the loop (ember.train.loop)
      account          the attempt's outcome and the run's summary into the ledger
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ember import faults
from ember.ckpt.store import CheckpointStore
from ember.data.sources import data_file_hashes
from ember.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EmberError
from ember.events import Events
from ember.launchspec import ENV as LAUNCH_ENV
from ember.launchspec import LaunchSpec, PlannedMemory
from ember.ledger.database import Ledger
from ember.lock import acquire
from ember.metrics.compare import Comparison
from ember.metrics.report import RunReport, build_report, summarize
from ember.parallel.pp import rank_names
from ember.plan.memory import GiB
from ember.ranks import PEER_LOST, Topology, launch
from ember.recipe import Recipe, load_recipe, to_toml
from ember.runfolder import LOCK_FILE, RunDir, inherited_launch_spec, make_folder, write_launch_spec
from ember.supervise import supervise
from ember.world import launched, lost_peer, tell_launcher

if TYPE_CHECKING:
    from ember.doctor.preflight import Check
    from ember.plan.planner import MemoryPlan
    from ember.train.signals import StopRequest

@dataclass
class RunRequest:
    recipe_file: Path
    out: Path
    overrides: list[str] = field(default_factory=list)
    allow_recipe_change: bool = False
    restarts: int | None = None            # None: the recipe's [train] restarts
    preflight: bool = False
    ledger: Path | None | bool = None      # None: the default ledger; False: no accounting
    restart_from_scratch: bool = False
    supervised_child: bool = False         # this process is the child of a supervisor
    topology: Topology = field(default_factory=Topology)  # ranks and nodes (--nproc, --nnodes)
    recipe: Recipe | None = None           # recipe_file as the command already loaded it
    stop: StopRequest | None = None        # installed by the command as it began: a signal during start-up
    serving: Callable[[Any], Any] | None = None  # [serve] coserve's server, given by the command (ember.web.coserve.start)

    def child_argv(self) -> list[str]:
        """The command line of the supervised child: this request, without supervision."""
        return [sys.executable] + self.rank_argv()[:-1] + self.topology.argv() + ["--no-supervise"]

    def rank_argv(self) -> list[str]:
        """What each rank runs after `python`: this request, one process, no supervision."""
        argv = ["-m", "ember", "run", str(self.recipe_file), "--out", str(self.out)]
        for item in self.overrides:
            argv += ["--set", item]
        if self.allow_recipe_change:
            argv.append("--allow-recipe-change")
        if self.restart_from_scratch:
            argv.append("--restart-from-scratch")
        if self.ledger is False:
            argv.append("--no-ledger")
        elif self.ledger is not None:
            argv += ["--ledger", str(self.ledger)]
        return argv + ["--no-supervise"]


@dataclass
class RunOutcome:
    code: int                          # the process exit code (ember.errors)
    report: RunReport | None = None    # the run's figures when this process trained it
    completed_step: int | None = None  # set when the run had already completed: nothing was done
    checks: list[Check] = field(default_factory=list)  # preflight's, when asked for
    kept: object = None                # a rank's job, freed only as the process exits (train_here)


def run(req: RunRequest, events: Events) -> RunOutcome:
    """Train the recipe into the run folder, resuming it; see the module docstring. Torch is
    imported only where this process trains (or starts ranks): a supervisor never imports it.
    A stop signal before the training starts (req.stop, installed by the command as it began)
    ends it with exit 75 before a child, a rank or a step: nothing was trained, nothing is lost."""
    faults.point("run.start")
    spec = inherited_launch_spec(req.out)  # launched by a supervisor, the service or a rank launcher
    recipe = spec.build_recipe() if spec else req.recipe or load_recipe(req.recipe_file, req.overrides, events.warn)
    restarts = recipe.train.restarts if req.restarts is None else req.restarts
    if restarts < 0:
        raise EmberError(f"--restarts {restarts}: must be >= 0")
    req.topology.check()  # bad flags are refused whatever the run folder holds
    if recipe.serve.coserve and (req.topology.world > 1 or launched()):
        raise EmberError(f"{req.recipe_file}: [serve] coserve answers requests from one training process, "
                         f"and this run has {req.topology.world} ranks; run it with one process (no --nproc "
                         f"/ --nnodes), or set [serve] coserve = false and serve with `ember serve`")
    launcher = req.topology.world > 1 and not launched()  # this process starts the ranks
    if launcher:
        from ember.train.sharding import check_distributed
        check_distributed(recipe, req.topology.world, str(req.recipe_file))
    done = completed_step(req.out, recipe)
    if done is not None:  # nothing is loaded, no attempt is logged, the figures stay as they are
        return RunOutcome(EXIT_OK, completed_step=done)
    plan = None
    if spec is None and not launched():  # planned once per run: by whoever launches it
        plan = check_memory(recipe, req.topology)
    outcome = RunOutcome(EXIT_OK)
    if req.preflight and not req.supervised_child:
        from ember.doctor.preflight import preflight
        outcome.checks = preflight(recipe, req.recipe_file, 3, events)
        failed = [c.name for c in outcome.checks if not (c.ok or c.warn_only)]
        if failed:
            raise PreflightFailed(outcome.checks, failed)
    if req.stop is not None and req.stop.requested and (launcher or restarts and not req.supervised_child):
        return stopped_before_training(req, events, outcome)
    if restarts and not req.supervised_child:
        make_folder(req.out)
        lock = acquire(req.out / LOCK_FILE, f"--out {req.out}")  # held across every restart
        if spec is None:
            hand_down(req.out, LaunchSpec.create(req.out, recipe, req.recipe_file, req.overrides, plan,
                                                 restarts=restarts))
        outcome.code = supervise(req.child_argv(), restarts, recipe.train.restart_backoff_seconds, events,
                                 lambda: CheckpointStore.newest_step(req.out / "checkpoints"), lock, req.stop)
        return outcome
    if launcher:
        return launch_ranks(req, events, outcome, recipe, spec, plan)
    return train_here(req, recipe, events, outcome, spec)


def stopped_before_training(req: RunRequest, events: Events, outcome: RunOutcome) -> RunOutcome:
    """A stop signal came before a child or a rank was started: exit 75, nothing trained."""
    events.info(f"{req.stop.signal_name if req.stop else 'a stop signal'} before training began: nothing was "
                f"trained; run the same command to start it")
    outcome.code = EXIT_INTERRUPTED
    return outcome


def hand_down(out: Path, spec: LaunchSpec) -> None:
    """Write this launch's spec into the run folder (whose lock this process holds) and name it
    for every process started from here on (children inherit the environment)."""
    os.environ[LAUNCH_ENV] = str(write_launch_spec(out, spec))


def launch_ranks(req: RunRequest, events: Events, outcome: RunOutcome, recipe: Recipe,
                 spec: LaunchSpec | None, plan: PlannedMemory | None) -> RunOutcome:
    """Start this node's ranks (ember.ranks) holding the run folder's lock for them."""
    lock = None
    if req.topology.node_rank == 0:  # the node of rank 0, which writes the run folder
        make_folder(req.out)
        lock = acquire(req.out / LOCK_FILE, f"--out {req.out}")
        if spec is None:  # another node's ranks read their own node's recipe file
            hand_down(req.out, LaunchSpec.create(req.out, recipe, req.recipe_file, req.overrides, plan))
    try:
        outcome.code = launch(req.topology, req.rank_argv(), req.out.name, events,
                              lambda: CheckpointStore.newest_step(req.out / "checkpoints"),
                              rank_names(recipe, req.topology.world))  # a pipeline's by their stage
    finally:
        if lock is not None:
            lock.release()
    return outcome


def train_here(req: RunRequest, recipe: Recipe, events: Events, outcome: RunOutcome,
               spec: LaunchSpec | None) -> RunOutcome:
    """Prepare the job and run the loop in this process; record how the attempt ended. A rank
    whose collective failed because another rank died leaves quietly with exit 1: the launcher
    names the rank that died (ember.ranks)."""
    from ember.train.job import prepare
    from ember.train.loop import train
    from ember.train.signals import StopRequest
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    # Before the model loads: a signal then stops it at the first step. A rank says nothing on a
    # signal: the ranks agree at the step boundary, and what they did is said then (it may be
    # the agent tearing the group down after another rank died: no checkpoint then).
    stop = req.stop or StopRequest(events, quiet=launched()).install()
    try:
        job = prepare(recipe, req.out, req.allow_recipe_change, events, req.recipe_file, req.ledger,
                      req.restart_from_scratch, spec)
    except BaseException as e:
        stop.restore()
        if launched() and lost_peer(e):
            return _peer_lost(outcome)
        raise
    if job.world.distributed:  # a crash test's point: the job freed before the process exits
        weakref.finalize(job, faults.point, "rank.job_freed").atexit = False
    serving = None
    try:
        serving = start_serving(req, job)
        outcome.code = train(job, stop, serving=serving)
        faults.point("train.ended")  # a signal here, as the process goes, stops nothing (ember.train.signals)
        if not job.world.main:  # rank 0 reports and records the run
            job.world.close()
            # Everything this rank wrote is durable (the commit is collective): leave without the
            # interpreter's teardown, as rank 0 does (fast_exit). Torn down, a gloo rank's threads
            # were once destroyed still joinable: "terminate called without an active exception",
            # SIGABRT after a completed run (test_ranks_killed_at_random_moments…[fsdp]).
            fast_exit(outcome.code)
    except EmberError as e:  # bad input, out of memory, a disk that stays full: the user can act
        job.ledger.finish("failed", str(e))
        _record_summary(job)
        raise
    except BaseException as e:  # unexpected: recorded, then re-raised for the command to report
        if job.world.distributed and lost_peer(e):
            job.ledger.finish("crashed", PEER_LOST)
            outcome.kept = job  # as below: freed with the process
            return _peer_lost(outcome)
        job.ledger.finish("crashed", f"{type(e).__name__}: {e}")
        raise
    finally:
        if serving is not None:  # the loop closed it, unless it failed before its first step
            serving.close(drain=False)
    outcome.report = _record_summary(job)
    job.ledger.close()
    job.world.close()
    if job.world.distributed:  # freed with the process (the command's fast_exit), never before
        # Freeing a DDP model frees its process group, whose destructor joins the group's worker
        # thread holding the GIL; a worker still freeing the last collective's tensors waits for
        # the GIL: rank 0 hung there until the agent's SIGKILL, 30 s later, after its peer had
        # already exited 75 (5 of 24 signalled runs beside other processes' load)
        outcome.kept = job
    return outcome


def start_serving(req: RunRequest, job: Any) -> Any:
    """Co-serving's server for the job ([serve] coserve), or None."""
    if not job.recipe.serve.coserve:
        return None
    if req.serving is None:
        raise EmberError("[serve] coserve: this way of starting a run cannot serve; start it with `ember run`")
    return req.serving(job)


def _peer_lost(outcome: RunOutcome) -> RunOutcome:
    tell_launcher(PEER_LOST)
    outcome.code = EXIT_ERROR
    return outcome


def _record_summary(job) -> RunReport:
    """The run's figures as of this attempt's end, stored for `ember runs`; a share of a measured
    peak above 100% has the peak measured again first (ember.train.job.remeasure_peak)."""
    from ember.train.job import remeasure_peak
    report = build_report(job.run.path, getattr(job.ledger, "con", None))
    if report.mfu is not None and report.mfu.beyond_peak and remeasure_peak(job, report.mfu.beyond_peak):
        report = build_report(job.run.path, getattr(job.ledger, "con", None))
    if isinstance(job.ledger, Ledger):
        job.ledger.summary(asdict(summarize(report)))
    return report


def completed_step(out: Path, recipe: Recipe) -> int | None:
    """The step a run folder completed at, if it completed this very recipe (its max_steps, or
    stopped early by its [eval] patience)."""
    try:
        run = RunDir.read(out)  # no run folder, or an unreadable record: not completed
    except EmberError:
        return None
    done = run.completed_at(recipe.train.max_steps)  # None without final/
    if done is None:
        return None
    same = run.record.get("recipe_digest") == recipe.digest() or not run.material_changes(recipe)
    # Changed data is not "completed": the run goes on to refuse it, saying what changed. Data
    # moved or deleted since is no change: the run completed on it (a pipeline that cleans up
    # its data and runs the same command again is told so, not failed for a missing file).
    recorded, now = run.record.get("data_files") or {}, data_file_hashes(recipe.data.files)
    same_data = set(now) <= set(recorded) and all(recorded[f] == h for f, h in now.items())
    return done if same and same_data else None


def check_memory(recipe: Recipe, topology: Topology | None = None) -> PlannedMemory | None:
    """Refuse, before anything is built, a recipe whose estimated peak does not fit this
    machine's free memory, naming the remedy the plan would apply (per rank under the recipe's
    strategy when `topology` starts several); the plan it checked, or None where there is no
    estimate for the architecture (the run measures as it goes)."""
    from ember.plan.planner import UnknownArchitecture, plan_memory
    try:
        plan = plan_memory(recipe)
    except UnknownArchitecture:
        return None
    if topology is not None and topology.world > 1 and plan.model is not None:
        return check_ranks(recipe, plan, topology)
    dev = plan.devices[0]
    planned = PlannedMemory(plan.memory.with_margin, dev.name, dev.free, plan.fits)
    if plan.fits:
        return planned
    usable = [x for x in plan.remedies if x.fits and x.available]
    fix = (f"{usable[0].name} makes it fit ({usable[0].peak / GiB:.2f} GiB; "
           f"{', '.join(f'{k} = {v}' for k, v in usable[0].changes.items())}"
           f"{f'; `ember run ... {usable[0].launch}`' if usable[0].launch else ''}): `ember plan RECIPE "
           f"--apply fitted.toml` writes it") if usable else "no remedy ember can apply makes it fit here"
    raise EmberError(f"the plan estimates a peak of {plan.memory.with_margin / GiB:.2f} GiB per device "
                     f"(with its {plan.memory.margin:.0%} margin) and {dev.name} has {dev.free / GiB:.2f} GiB "
                     f"free: it does not fit; {fix}")


def check_ranks(recipe: Recipe, plan: MemoryPlan, topology: Topology) -> PlannedMemory:
    """Refuse this node's ranks when a rank's share of the step's peak (its strategy's arithmetic,
    ember.plan.layout) does not fit the device it would use, or CPU ranks' shares the host RAM."""
    from ember.plan.layout import rank_memory
    from ember.plan.remedies import fits, train_shape
    s, n, margin, dev = recipe.distributed.strategy, topology.nproc, recipe.plan.memory_margin, plan.devices[0]
    d = recipe.distributed
    rm = rank_memory(plan.model, train_shape(recipe), s, topology.world, n, plan.devices,
                     (recipe.train.grad_accum, str(d.schedule), d.pp_size))
    if rm.missing:
        raise EmberError(f"--nproc {n}: each rank takes one {dev.kind} device and this machine has "
                         f"{len(plan.devices)}; use --nproc {len(plan.devices)} or fewer")
    if fits(rm.need, rm.free, margin):
        return PlannedMemory(int(rm.need * (1 + margin)), dev.name, rm.free, True)
    where = (f"{n} ranks sharing {dev.name}: {n} x {rm.per_rank / GiB:.2f} = {rm.need / GiB:.2f} GiB" if rm.shared
             else f"{rm.per_rank / GiB:.2f} GiB on each of {n} devices")
    raise EmberError(f"the plan estimates {rm.per_rank / GiB:.2f} GiB per rank under [distributed] strategy = "
                     f"'{s}' over {topology.world} ranks ({where}, before its {margin:.0%} margin) and "
                     f"{rm.free / GiB:.2f} GiB free: it does not fit; `ember plan RECIPE` lists the remedies")


class PreflightFailed(EmberError):
    """A preflight check failed: the run was not started."""

    def __init__(self, checks: list[Check], failed: list[str]):
        self.checks = checks
        super().__init__(f"preflight failed ({', '.join(failed)}): not starting the run; fix the cause "
                         f"or run without --preflight")


def fast_exit(code: int) -> None:
    """Leave without interpreter teardown once everything is durable (checkpoint committed,
    metrics fsynced, ledger committed): with torch and transformers loaded it took 1.4 s, so a
    SIGTERM'd run hands the machine back one step and one save later."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a console gone (its reader ended), or closed
            pass
    os._exit(code)


def repro(source: Path, out: Path, tolerance: float, ledger: Path | None) -> Comparison:
    """Re-run a run from its record (recipe and numerics environment) into a new folder, in a
    child process, then compare the two."""
    import subprocess

    from ember.metrics.compare import check_tolerance, compare_folders
    from ember.runfolder import read_record
    check_tolerance(tolerance)  # before the re-run, not after it
    record = read_record(source)
    if out.exists():
        raise EmberError(f"--out {out}: exists; repro needs a new folder")
    out.mkdir(parents=True)
    recipe_file = out.parent / f".{out.name}.recipe.toml"
    recipe_file.write_text(to_toml(record["recipe"]))
    cmd = RunRequest(recipe_file, out, ledger=ledger).child_argv()[:-1]  # supervised as the recipe says
    env = {**os.environ, **record.get("manifest", {}).get("env", {})}
    try:
        code = subprocess.run(cmd, env=env).returncode
    finally:
        recipe_file.unlink()
    if code != 0:
        raise EmberError(f"the re-run exited {code}; {out} holds what it did")
    return compare_folders(source, out, tolerance)
