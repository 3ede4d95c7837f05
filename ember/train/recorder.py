"""What a training attempt records, called from the loop at explicit lines: one metrics.jsonl
line and the [log] sinks' scalars per step, the progress event, the ledger's events and phase
totals, how the attempt ended, and this attempt's own figures (tokens, seconds, step times: the
progress event's rate and ETA, `ember report`'s ranks).

Rank 0 writes the run folder and the sinks; on the other ranks a no-op metrics log and an empty
set of sinks stand in (their ledger is a NullLedger, their events warnings only: ember.train.job),
so the loop never asks which rank it is on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from ember.ckpt.store import CheckpointStore
from ember.control import Pause
from ember.ledger.goodput import EventKind
from ember.metrics import rank_times as ranks
from ember.parallel.pp import bubble, micro_batches, pipeline_of
from ember.runfolder import MetricsLog
from ember.train.compiled import break_warning, described
from ember.train.job import Job
from ember.train.scalars import Scalars, open_sinks


class Step(Protocol):
    """What the recorder reads of a step (ember.train.loop.StepResult)."""
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    verdict: str
    applied: bool
    phases: dict[str, float]


class NoMetrics:
    """Stands in for the metrics log on the ranks that do not write the run folder."""

    def append(self, record: dict[str, Any]) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_scalars(job: Job, step: int) -> Scalars:
    """The [log] sinks of rank 0 (rank 0 writes the run's figures); none elsewhere."""
    if not job.world.main:
        return Scalars([])
    return open_sinks(job.recipe.log, job.run.path, job.run.record["id"], job.run.attempt, step)


class RunRecorder:
    """The attempt's records (module docstring); opened at the loop's start, closed at its end."""

    def __init__(self, job: Job):
        self.job = job
        self.metrics: MetricsLog | NoMetrics = NoMetrics()
        self.scalars = Scalars([])
        self.reopen()
        self.tokens, self.seconds = 0, 0.0  # this attempt's
        self.learning_seconds = 0.0  # of the steps that learned tokens: a step without any is no tokens/s figure
        self.step_seconds: list[float] = []  # this attempt's steps on this rank (the ETA, ember.metrics.rank_times)
        self.bubbles: list[float] = []  # a pipeline stage's bubble share in each of them
        self.compile_seconds = 0.0  # of the step being recorded: no training, kept out of tokens/s

    def reopen(self) -> None:
        """Open metrics.jsonl and the [log] sinks at the state's step (at the start, after a rollback:
        TensorBoard then drops the steps rolled back)."""
        self.scalars.close()
        self.metrics = MetricsLog(self.job.run.metrics_path) if self.job.world.main else NoMetrics()
        self.scalars = open_scalars(self.job, self.job.state.step)

    def startup(self) -> None:
        """The ledger's start-up event: process start to the first step."""
        self.job.ledger.event(EventKind.STARTUP, self.job.started, time.time(), step=self.job.state.step)

    def step(self, result: Step, seconds: float, held_out: dict[str, Any]) -> None:
        """Count a step that took `seconds`, write its metrics line and scalars
        with this step's held-out figures, and add its phases to the attempt's totals."""
        job, state = self.job, self.job.state
        self.tokens, self.seconds = self.tokens + result.tokens, self.seconds + seconds
        self.learning_seconds += seconds - self.compile_seconds if result.tokens else 0.0
        self.step_seconds.append(seconds)
        if (share := ranks.bubble_share(result.phases)) is not None:
            self.bubbles.append(share)
        record = {"step": state.step, "loss": result.loss, "lr": result.lr,
                  "grad_norm": result.grad_norm, "tokens": result.tokens,
                  "tokens_seen": state.tokens_seen, "step_seconds": round(seconds, 6),
                  "data_wait_seconds": round(result.phases["data"], 6),
                  "phases": {k: round(v, 6) for k, v in result.phases.items()},
                  "attempt": job.run.attempt, "time": time.time(), **held_out,
                  **({"compile_seconds": round(self.compile_seconds, 6)} if self.compile_seconds else {}),
                  **({} if result.applied else {"skipped": result.verdict})}
        self.compile_seconds = 0.0
        self.metrics.append(record)
        self.scalars.log(record)
        job.phase_totals = {k: job.phase_totals.get(k, 0.0) + v for k, v in result.phases.items()}

    def progress(self, result: Step, seconds: float) -> None:
        """The progress event of the step just recorded: loss, tokens/s and the ETA so far."""
        job, step, total = self.job, self.job.state.step, self.job.recipe.train.max_steps
        job.events.emit("progress", f"step {step}/{total}", step=step, total=total, loss=result.loss,
                        seconds=seconds, tokens=result.tokens,
                        tokens_per_second=self.tokens / self.learning_seconds if self.learning_seconds else None,
                        eta_seconds=(total - step) * self.seconds / len(self.step_seconds))

    def compiled(self) -> None:
        """After a step: its compiles as ledger events (the goodput bucket `compile`); when it
        compiled anything, what that did (run.json's `compile` per attempt) and its graph breaks."""
        job, step = self.job, self.job.state.step
        spans = job.compiler.drain()
        if not spans:
            return
        for start, end in spans:
            job.ledger.event(EventKind.COMPILE, start, end, step=step)
        self.compile_seconds = sum(end - start for start, end in spans)
        summary = job.compiler.summary()
        job.events.info(f"step {step}: " + described(summary), step=step, **{"compile": summary})
        if (warning := break_warning(summary)) is not None:
            job.events.warn(warning, step=step, graph_breaks=summary["graph_breaks"])
        if job.world.main:
            job.run.record.setdefault("compile", {})[str(job.run.attempt)] = summary
            job.run.save_record()

    def pause(self, held: Pause | None, micro_batch: int = 0) -> None:
        """The ledger event of a soft pause the loop just waited through, if there was one: after
        `step` steps and `micro_batch` micro-batches of the next, asked at `asked` (its latency is
        start - asked, as `/api/stats` reports it)."""
        if held is not None:
            self.job.ledger.event(held.kind, held.start, held.end, step=self.job.state.step,
                                  detail={"reason": held.reason, "asked": held.asked, "micro_batch": micro_batch})

    def undone(self, done: int, signal: str | None) -> None:
        """A stop (`signal`) between micro-batches undid the step in progress after `done` of them."""
        job, step = self.job, self.job.state.step
        job.events.info(f"{signal or 'stop'}: step {step + 1} undone after {done} of its "
                        f"{job.recipe.train.grad_accum} micro-batches; stopping at step {step}",
                        step=step, micro_batch=done)

    def checkpointed(self) -> None:
        """After a checkpoint: the sinks hold at least what it holds; the phase totals so far."""
        self.scalars.flush()
        self.job.ledger.phases(self.job.phase_totals, self.job.state.step)

    def close(self, completed: bool) -> None:
        """Close metrics.jsonl and the sinks (`completed`: the run reached its end)."""
        self.metrics.close()
        self.scalars.close(completed)

    def attempt_end(self) -> None:
        """The attempt's phase totals; with several ranks, every rank's figures to rank 0, for
        `ember report` (a collective: every rank calls it)."""
        job, world = self.job, self.job.world
        job.ledger.phases(job.phase_totals, job.state.step)
        if world.distributed:
            mine = ranks.figures(world.rank, self.step_seconds, self.tokens // world.size, job.phase_totals,
                                 self.bubbles)
            everyone = world.gather(mine)
            pipe = pipeline_of(job.model)  # each pipeline runs its replica's share of the micro-batches
            predicted = bubble(pipe.stages, micro_batches(job.recipe.train.grad_accum, world.dp_size)) if pipe else None
            if world.main:
                ranks.save(job.run.path, ranks.summarize(job.run.attempt, everyone, predicted))

    def interrupted(self, cause: str) -> None:
        """The attempt stopped on a request: the ledger's outcome and what resumes it."""
        job, step = self.job, self.job.state.step
        job.ledger.finish("interrupted", cause)
        newest = CheckpointStore.newest_step(job.store.root)
        held = f"newest committed checkpoint is step {newest}" if newest else "no checkpoint committed yet"
        job.events.info(f"{cause}: {held} (stopped at step {step}); run the same command to "
                        f"{'resume' if newest else 'start again'}", step=step, newest_checkpoint=newest)

    def final_saved(self, started: float) -> None:
        """The ledger event of the final weights' save, begun at `started`."""
        self.job.ledger.event(EventKind.FINAL_SAVE, started, time.time(), step=self.job.state.step)

    def completed(self, final: Path, why: str | None) -> None:
        """The run completed: the ledger's outcome and where the weights are (`why`: it stopped early)."""
        job, state = self.job, self.job.state
        job.ledger.finish("completed", why or "")
        if why:
            job.events.info(f"{why}; `ember export {job.run.path} --checkpoint best` exports step "
                            f"{state.best_step}", step=state.step, best_step=state.best_step)
        job.events.info(f"final weights written to {final}", final=str(final), tokens=self.tokens,
                        seconds=self.seconds)
