"""The training loop: one screen for `train()`, one for `train_step()`."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ember import faults
from ember.ckpt import contents
from ember.ckpt.policy import CheckpointPolicy, LastSave
from ember.ckpt.state import RunState
from ember.device import autocast
from ember.errors import EXIT_INTERRUPTED, EXIT_OK, EmberError
from ember.ledger.goodput import EventKind
from ember.parallel.pp import names_of, pipeline_of
from ember.recipe import Recipe
from ember.world import World
from ember.train import stability
from ember.train.between import Between, Serving
from ember.train.breakdown import StepTimer
from ember.data.loader import SkippingSampler, make_loader, row_parts
from ember.train.dropout import DropoutKeys
from ember.train.evaluate import Evaluator, evaluating
from ember.train.job import Job
from ember.train.model import save_final, trainable_parameters
from ember.train.sharding import clip_gradients
from ember.train.recorder import RunRecorder
from ember.train.saving import record_persisted, save_checkpoint, settle_saves
from ember.train.signals import StopRequest
from ember.train.watchdog import Watchdog


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    batches: list[int]          # micro-batch ordinals in the data stream
    next_k: int                 # loader index after the last micro-batch used
    verdict: str                # "ok", "empty", "nonfinite", "spike" (see ember.train.stability)
    applied: bool               # whether the optimizer update was applied
    phases: dict[str, float]    # seconds per part of the step (ember.train.breakdown)


class Steppable(Protocol):
    """What one training step touches: a run's Job has all of it, and so does a measurement
    (ember.train.parts.StepParts), so both take the very same step."""
    recipe: Recipe
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    state: RunState
    timer: StepTimer
    world: World
    dropout: DropoutKeys
    compiler: Any  # ember.train.compiled: Compiler or Eager, whose `loss` the step calls


class Data:
    """This rank's loader from the state's cursor, skipping the state's skip list; rebuilt on
    rollback. `positions` walks the global stream (every rank's micro-batches, indices only), so
    each rank knows the cursor after a step without asking the others."""

    def __init__(self, job: Job):
        r, self.job = job.recipe, job
        self.first_step = job.state.step
        self.batches = job.batches()
        count = (r.train.max_steps - self.first_step) * r.train.grad_accum  # the global stream's
        skip = set(job.state.skip_batches)
        self.positions = iter(SkippingSampler(self.batches.first_ordinal, count, skip))
        self.iter = iter(make_loader(self.batches, count, r.data.workers, pin=job.device.type != "cpu",
                                     skip=skip, rank=job.world.dp_rank, ranks=job.world.dp_size,
                                     parts=row_parts(r.train.grad_accum, job.world.dp_size)))

    def advance(self, micro_batches: int) -> int:
        """Move the global position past one step's micro-batches; the loader index after them."""
        for _ in range(micro_batches):
            k = next(self.positions)
        return k + 1

    def close(self) -> None:
        del self.iter  # shuts down loader workers


def train(job: Job, stop: StopRequest | None = None, halt: Callable[[], bool] = lambda: False,
          serving: Serving | None = None) -> int:
    """Run optimizer steps until max_steps or a stop request, checkpoint, return the exit code; or
    until `halt()`, asked after each step: exit 0 saving nothing (ember doctor's stretches).
    `serving`: co-serving's requests, answered between micro-batches ([serve] coserve)."""
    r, state, world = job.recipe, job.state, job.world
    record = RunRecorder(job)  # metrics.jsonl and [log] sinks (rank 0), ledger events, progress
    data, evaluator = Data(job), Evaluator(job)
    owned = stop is None  # given: installed before prepare(), which it covers; its owner restores it
    stop = stop or StopRequest(job.events).install()
    between = Between(job, stop, record, serving)  # soft pauses, a stop, co-serving: between micro-batches
    watchdog = Watchdog(world, r.distributed, job.run.path, job.events, names_of(job.model)).start()  # distributed only
    policy = CheckpointPolicy.of(r, job.mtbf_seconds)  # [checkpoint] every_steps / every_seconds
    last, blocked, saved, loss = LastSave(time.monotonic()), 0.0, state.step, math.nan
    job.model.train()
    record.startup()
    stopping = world.any(stop.requested)[0]  # a signal during start-up: no step, exit 75
    early = out_of_patience(state, r.eval.patience)  # resumed from the checkpoint where it ran out
    try:
        while state.step < r.train.max_steps and not stopping and not early:
            between.begin()
            result = train_step(job, data, between)
            # A soft pause between its micro-batches is the ledger's pause event (bucket `paused`):
            # counted in the step too, it was counted twice, and tokens/s and p99 took it for work.
            seconds = job.timer.seconds()
            if result is None:  # a stop between micro-batches undid the step: save the state before it
                stopping = True
                if saved < state.step:
                    checkpoint(job, record, watchdog, loss)
                break
            loss = result.loss
            if result.verdict == "spike" and r.guard.spike_action == "rollback":
                data = rollback(job, record, data, result)  # the step is not counted
                state = job.state
                continue
            advance(state, result, data, seconds)
            record.compiled()  # this step's compile seconds (the bucket `compile`), graph breaks said
            watchdog.beat(state.step, seconds)
            # The checkpoint blocked the training thread before this step: it is this step's part.
            result.phases["checkpoint"], blocked = blocked, 0.0
            held_out, improved, early = evaluation(job, evaluator)  # when due; [eval] patience: early stopping
            record.step(result, seconds, held_out)
            guard(job, result, data)
            record.progress(result, seconds)
            if halt():
                break
            record_persisted(job)  # a background persist that ended: its ledger row and notice now
            record.pause(between.pauses.check())  # the service asked: wait here, keep the process
            # The request is read once: a signal landing after this read is this step's news for
            # neither the policy nor the ranks' vote (a stop without its save), but the next step's.
            requested = stop.requested
            due = policy.due(state.step, time.monotonic(), last, stop=requested, early=early, best=improved)
            faults.point("train.save_decided")  # a signal landing here: crash tests
            stopping, save = world.any(requested, due is not None)  # the ranks agree: stop and save at one step
            if save:  # what it blocked is the next step's part; what it cost, EveryAuto's next interval
                blocked = checkpoint(job, record, watchdog, result.loss)
                last, saved = LastSave(time.monotonic(), blocked), state.step
    finally:
        wind_down(job, state.step == r.train.max_steps or early, between.serving, watchdog, stop, record, data)
        if owned:
            stop.restore()
    if halt():
        return EXIT_OK  # the caller's stretch ended: nothing is saved, the attempt goes on
    record.attempt_end()
    if stopping:
        record.interrupted(stop.signal_name or "a signal to another rank")
        return EXIT_INTERRUPTED
    return complete(job, record)


def evaluation(job: Job, evaluator: Evaluator) -> tuple[dict[str, float], bool, bool]:
    """After a counted step: the held-out figures when an evaluation is due (else none), whether
    they are the best so far, and whether [eval] patience ran out (early stopping)."""
    state, r = job.state, job.recipe
    held_out = evaluate(job, evaluator) if evaluator.due(state.step, state.step == r.train.max_steps) else {}
    # an evaluation over no learned token measured nothing: patience neither counts nor resets
    improved = "eval_loss" in held_out and record_best(state, held_out["eval_loss"])
    return held_out, improved, out_of_patience(state, r.eval.patience)


def wind_down(job: Job, completed: bool, serving: Serving, watchdog: Watchdog, stop: StopRequest,
              record: RunRecorder, data: Data) -> None:
    """What the loop ends on every path, crashes included."""
    stop.ended = True  # a signal from here on stops nothing: the files below are closed whatever comes
    serving.close(drain=completed)  # requests under way finish when the run completed, else a 503
    watchdog.stop()
    record.close(completed=completed)
    data.close()
    settle_saves(job)  # a pending persist completes before the process goes


def advance(state: RunState, result: StepResult, data: Data, seconds: float) -> None:
    """The run's state after a counted step: its step, tokens, data cursor and training time."""
    state.step += 1
    state.tokens_seen += result.tokens
    state.cursor = data.batches.cursor_after(result.next_k)
    state.train_seconds += seconds


def checkpoint(job: Job, record: RunRecorder, watchdog: Watchdog, loss: float) -> float:
    """Save a checkpoint now (all ranks together); the seconds it blocked the training thread."""
    watchdog.relax()  # a checkpoint: bounded by the collectives' timeout
    blocked = save_checkpoint(job, record.metrics, loss)
    watchdog.beat(job.state.step, None)
    record.checkpointed()
    return blocked


def complete(job: Job, record: RunRecorder) -> int:
    """Write the final weights and mark the run completed (rank 0; every rank gathers them
    under FSDP). A run whose steps learned no token is refused instead."""
    r, state, world = job.recipe, job.state, job.world
    if state.tokens_seen == 0:  # every step was empty (the guard warned at each): nothing was trained
        raise EmberError(f"no step of this run learned a token: all {state.step} held none in their rows "
                         f"(see the warnings above); the run is not completed. Raise [data] seq_len or set "
                         f"[data] long_records = \"keep_answer\"")
    t0 = time.time()
    pipe = pipeline_of(job.model)  # each stage holds its own layers: rank 0 gathers them
    weights = (pipe.gathered_weights() if pipe else full_weights(job.model)) if world.distributed else None
    if not world.main:
        return EXIT_OK
    final = job.run.write_final(lambda folder: save_final(job.bundle, folder, r.method, weights,
                                                          adapter=pipe is not None and r.method.kind == "lora"))
    record.final_saved(t0)
    why = early_stop_reason(state, r.eval.patience) if state.step < r.train.max_steps else None
    job.run.mark_completed(state.step, why)
    record.completed(final, why)
    return EXIT_OK


def evaluate(job: Job, evaluator: Evaluator) -> dict[str, Any]:
    """Evaluate on the held-out split now; keep the figures; the fields for this step's metrics
    line. Its time is the goodput bucket `evaluation`, not the step's."""
    t0, step = time.time(), job.state.step
    with evaluating(job.model):
        result = evaluator.run(step)
        generated = evaluator.generate(step) if job.world.main else []
    if job.world.main:
        evaluator.save(result, generated)
    job.ledger.event(EventKind.EVALUATION, t0, time.time(), step=step)
    if result.loss is None:  # a loss over no token is no figure: none is written
        job.events.info(f"step {step}: held-out loss: no tokens (its {result.rows} rows hold no learned token; "
                        f"{result.seconds:.2f} s)", step=step)
        fields: dict[str, Any] = {"eval_tokens": 0}
    else:
        job.events.info(f"step {step}: held-out loss {result.loss:.4f} (perplexity {result.perplexity:.2f}, "
                        f"{result.tokens} tokens, {result.seconds:.2f} s)", step=step, eval_loss=result.loss)
        fields = {"eval_loss": result.loss, "eval_perplexity": result.perplexity, "eval_tokens": result.tokens}
    for g in generated:  # what the model says, as it trains
        job.events.info(f"step {step}: {g['prompt']!r} -> {g['completion']!r}", step=step, prompt=g["prompt"],
                        completion=g["completion"])
    return fields


def record_best(state: RunState, loss: float) -> bool:
    """Keep the lowest held-out loss and its step, and count the evaluations since it; True if
    `loss` (of this step) is the new lowest. A non-finite loss never is."""
    if math.isfinite(loss) and (state.best_eval_loss is None or loss < state.best_eval_loss):
        state.best_eval_loss, state.best_step, state.evals_since_best = loss, state.step, 0
        return True
    state.evals_since_best += 1
    return False


def out_of_patience(state: RunState, patience: int) -> bool:
    """Whether [eval] patience evaluations in a row have not lowered the best held-out loss."""
    return patience > 0 and state.evals_since_best >= patience


def early_stop_reason(state: RunState, patience: int) -> str:
    """Why a run stopped before max_steps, as run.json and the report say it."""
    best = "no finite held-out loss yet" if state.best_eval_loss is None else \
        f"the best, {state.best_eval_loss:.4f}, was at step {state.best_step}"
    return (f"stopped early at step {state.step}: the held-out loss did not improve for {patience} "
            f"evaluations in a row ([eval] patience = {patience}); {best}")


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights whole, on every rank (FSDP gathers its shards), for the final save."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train_step(job: Steppable, data: Data, between: Callable[[int], bool] = lambda done: False) -> StepResult | None:
    """One optimizer step: grad_accum micro-batches of forward and backward, clip, judge, update;
    None when `between(done)`, asked before each micro-batch, undid it (a stop)."""
    r, model, state = job.recipe, job.model, job.state
    loss_sum, ordinals = 0.0, []
    world = job.world
    # This rank's share of the step's micro-batches (or of their slices of rows: data.row_parts).
    accum = r.train.grad_accum * row_parts(r.train.grad_accum, world.dp_size) // world.dp_size
    timer = job.timer
    timer.begin()
    fetched = [next(data.iter) for _ in range(accum)]  # blocks while the input pipeline is behind
    timer.wait("data")
    # The step's loss is its token-weighted mean: each micro-batch's sum over its learned tokens,
    # divided by the step's count per data-parallel rank (DDP / FSDP then average the ranks).
    # One small all-reduce when distributed (a sync point); the count is also what tokens/s
    # and MFU report.
    tokens = world.mean_over_replicas([sum(b.targets() for _, b in fetched)])[0]
    per_rank = max(tokens, 1) / world.dp_size
    timer.wait("sync")
    pipe = pipeline_of(model)  # pipeline parallelism: its schedule runs every micro-batch (ember.parallel.pp)
    if pipe is not None:
        loss_sum, ordinals = pipeline_micro_batches(job, pipe, fetched, per_rank)
    for i, (ordinal, batch) in enumerate(fetched if pipe is None else []):
        if between(i):  # a pause waits here; a stop undoes the step (ember.train.between)
            return None
        batch = batch.to(job.device, non_blocking=True)
        job.dropout.at(state.step + 1, batch.first)  # LoRA's dropout masks: keyed by sample, not by rank
        timer.lap("h2d")
        # A distributed model synchronises gradients once per step: on the last micro-batch.
        last = i == accum - 1
        with nullcontext() if last else no_sync(model):
            with autocast(job.device, r.precision.mode):
                loss = job.compiler.loss(model, batch, r.train.loss_chunk, per_rank) * faults.loss_factor(ordinal)
            timer.lap("forward")
            job.scaler.scale(loss).backward()
        timer.lap("backward")
        faults.point("train.micro_batch")
        loss_sum += loss.item()  # sync point on accelerators; the loss is logged every step
        ordinals.append(ordinal)
    (loss_sum,) = world.mean_over_replicas([loss_sum])  # every rank judges the same global step
    timer.lap("sync")
    loss_value = loss_sum / world.dp_size if tokens else math.nan  # no learned token: its mean is 0/0
    grad_norm, verdict, applied, lr = update(job, loss_value, tokens, pipe)
    timer.lap("optimizer")
    phases = timer.end()
    return StepResult(loss_value, grad_norm, lr, int(tokens), ordinals, data.advance(r.train.grad_accum),
                      verdict.kind, applied, phases)


def pipeline_micro_batches(job: Steppable, pipe: Any, fetched: list, per_rank: float) -> tuple[float, list[int]]:
    """The step's micro-batches through the pipeline's schedule (ember.parallel.pp): this stage's
    share of the step's loss and the micro-batches' ordinals."""
    with autocast(job.device, job.recipe.precision.mode):
        loss_sum = pipe.step([b.to(job.device) for _, b in fetched], per_rank, job.recipe.distributed.schedule,
                             lambda first: job.dropout.at(job.state.step + 1, first))
    job.timer.split(pipe.seconds, "h2d")  # its forwards, backwards and bubble; the rest, the batches' copies
    pipe.average_over_replicas()  # 'pp+ddp': a stage's gradients over its replicas (sync point: the 'sync' phase)
    for _ in fetched:  # the fault point of each micro-batch, once the schedule has run them all
        faults.point("train.micro_batch")
    return loss_sum, [o for o, _ in fetched]


def update(job: Steppable, loss: float, tokens: float, pipe: Any) -> tuple[float, Any, bool, float]:
    """Clip, judge the step (ember.train.stability) and apply it or not: the gradient norm, the
    verdict, whether the update was applied and the learning rate it was taken at."""
    r, opt = job.recipe, job.optimizer
    job.scaler.unscale_(opt)  # no-op unless fp16: clip and measure true gradients
    params = trainable_parameters(job.model)
    grad_norm = clip_gradients(params, r.optimizer.grad_clip, pipe.sum_over_stages if pipe else None)
    verdict = stability.judge(loss, grad_norm, tokens, job.state.loss_window, r.guard,
                              scaler_handles_inf=job.scaler.is_enabled())
    applied = verdict.kind == "ok" or (verdict.kind == "spike" and r.guard.spike_action == "warn")
    lr = job.scheduler.get_last_lr()[0]
    if applied:
        job.scaler.step(opt)  # skips the update if fp16 gradients overflowed
    job.scaler.update()
    if verdict.kind != "spike" or r.guard.spike_action != "rollback":
        with warnings.catch_warnings():  # torch warns of a schedule step before any update: a skip is meant
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()`")
            job.scheduler.step()  # a rolled-back step is not a step: the schedule does not advance
    opt.zero_grad(set_to_none=True)
    return grad_norm, verdict, applied, lr


def no_sync(model: torch.nn.Module) -> Any:
    """Gradient synchronisation off for this micro-batch (DDP's no_sync, FSDP2's
    set_requires_gradient_sync); a no-op elsewhere."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    return nullcontext()


@contextmanager
def _fsdp_no_sync(model: Any) -> Any:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def guard(job: Job, result: StepResult, data: Data) -> None:
    """Record a bad step, keep the loss window, and stop after too many bad steps in a row."""
    state, g = job.state, job.recipe.guard
    if result.verdict == "ok" or (result.verdict == "spike" and g.spike_action == "warn"):
        state.loss_window = stability.push(state.loss_window, result.loss, g.spike_window)
    if result.verdict == "ok":
        state.bad_streak = 0
        return
    state.bad_streak += 1
    bad = {"step": state.step, "why": result.verdict, "loss": result.loss, "batches": result.batches,
           "applied": result.applied}
    if result.verdict == "empty":  # the rows and records that hold nothing to learn: what to look at
        rows = [row for ordinal in result.batches for row in data.batches.rows_at(ordinal)]
        bad.update(rows=rows, records=data.batches.records_in(rows))
    state.bad_steps.append(bad)
    job.events.warn(f"step {state.step}: {described(bad, result.grad_norm)}; "
                    f"{'applied' if result.applied else 'update skipped'}; batches {result.batches}",
                    step=state.step, verdict=result.verdict)
    if state.bad_streak >= g.max_bad_steps:
        bad_run = state.bad_steps[-state.bad_streak:]
        remedy = ("no row of these steps holds a learned token: raise [data] seq_len or set [data] "
                  "long_records = \"keep_answer\" (run.json's data notes count the records that lost theirs)"
                  if all(b["why"] == "empty" for b in bad_run) else
                  "lower [optimizer] lr, check those batches, or resume from an earlier checkpoint")
        raise EmberError(f"{state.bad_streak} bad steps in a row ([guard] max_bad_steps = "
                         f"{g.max_bad_steps}): " + "; ".join(
                             f"step {b['step']} {described(b)} batches {b['batches']}" for b in bad_run)
                         + f"; {remedy}")


def described(bad: dict[str, Any], grad_norm: float | None = None) -> str:
    """A bad step's verdict and its evidence, in words."""
    if bad["why"] == "empty":
        return f"empty (no learned token in rows {bad['rows']}, training records {bad['records']})"
    if grad_norm is None:
        return f"{bad['why']} loss {bad['loss']:.4g}"
    return f"{bad['why']} (loss {bad['loss']:.4g}, grad norm {grad_norm:.4g})"


def rollback(job: Job, record: RunRecorder, data: Data, result: StepResult) -> Data:
    """Back to the newest committed checkpoint; never train on this step's batches; scale the lr."""
    state, g = job.state, job.recipe.guard
    job.writer.wait()
    record_persisted(job)
    keep = {"skip_batches": sorted(set(state.skip_batches) | set(result.batches)),
            "bad_steps": state.bad_steps + [{"step": state.step + 1, "why": "spike",
                                                     "loss": result.loss, "batches": result.batches,
                                                     "applied": False, "rollback": True}],
            "lr_scale": state.lr_scale * g.rollback_lr_factor, "bad_streak": state.bad_streak + 1}
    if keep["bad_streak"] >= g.max_bad_steps:
        raise EmberError(f"{keep['bad_streak']} bad steps in a row ([guard] max_bad_steps); the last: "
                         f"a loss spike {result.loss:.4g} at step {state.step + 1}, batches {result.batches}")
    data.close()
    record.metrics.close()  # metrics.jsonl is rewound below
    ckpt = job.store.load_latest(job.events.warn)
    if ckpt is None:
        raise EmberError(f"loss spike at step {state.step + 1} (batches {result.batches}) and no "
                         f"checkpoint that verifies to roll back to; use [guard] spike_action = 'skip' or "
                         f"checkpoint sooner")
    job.state = contents.read_files(ckpt.path, job.model, job.optimizer, job.scheduler, job.scaler)
    for key, value in keep.items():
        setattr(job.state, key, value)
    job.state.restore_rng(job.device)
    job.apply_lr_scale()
    lost = job.run.rewind_metrics(job.state.step)
    job.events.warn(f"loss spike at step {state.step + 1} ({result.loss:.4g}): rolled back to "
                    f"step {job.state.step}, {lost} steps to recompute, batches {result.batches} skipped, "
                    f"learning rate x{job.state.lr_scale:g}", step=job.state.step)
    record.reopen()
    return Data(job)
