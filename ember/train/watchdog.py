"""The hang watchdog of a distributed run: a thread per rank that notices a step taking far
longer than the run's own steps, says where every rank is, and ends the group so the supervisor
restarts it from the last durable checkpoint.

    bound      max(hang_min_seconds, hang_factor x p99 of this attempt's steps so far); until
               the first step, and while a checkpoint is written, the collectives' own timeout
    beat       after every step (and checkpoint) each rank records its step in the rendezvous
               store (a TCPStore client of its own: the training thread's collectives are not
               touched, and a rank stuck in one still answers through it)
    on a hang  the rank dumps every thread's Python stack (faulthandler) into OUT/hang-rankR.txt,
               writes where its training thread is into the store, and rank 0 names the ranks
               behind (a lower step, or not in the collective the others wait in) and that
               collective; it hands the launcher that verdict (ember.world.tell_launcher), which
               ends the run with it and EXIT_HUNG. Every rank exits EXIT_HUNG (the others once
               rank 0's account is out, at most REPORT_SECONDS), the agent tears the group down,
               the supervisor restarts it

The detection bound is the bound above plus one poll (POLL_SECONDS); a step's work is lost at
most once per hang, as after a crash. A hung collective cannot take a checkpoint (the checkpoint
is itself collective): the run resumes from the newest committed one.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from ember.errors import EXIT_HUNG
from ember.events import Events
from ember.parallel.placement import rank_name
from ember.recipe import DistributedConfig
from ember.world import World, tell_launcher

POLL_SECONDS = 0.25
WINDOW = 200       # recent steps the p99 is taken over
PEERS_SECONDS = 2.0  # how long rank 0 waits for the other ranks' hang reports
REPORT_SECONDS = PEERS_SECONDS + 10.0  # how long the other ranks wait for rank 0's account to be out


def p99(values: list[float]) -> float:
    """Nearest rank, not ember.metrics.stats.percentile's interpolation: a bound taken from a
    step that really happened, never from between the two slowest."""
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))] if s else 0.0


def bound_seconds(cfg: DistributedConfig, steps: list[float]) -> float:
    """How long a step may take before it is called hung (see the module docstring)."""
    if not steps:
        return cfg.timeout_seconds
    return max(cfg.hang_min_seconds, cfg.hang_factor * p99(steps))


# Frames a rank waits in for the others: torch.distributed's calls, ember.world's, the autograd
# engine (DDP's and FSDP's gradient reductions run inside backward), and a pipeline schedule's
# sends and receives of activations and their gradients (torch.distributed.pipelining).
COLLECTIVE = {"all_reduce", "barrier", "broadcast_object_list", "gather_object", "all_gather", "reduce_scatter",
              "_engine_run_backward", "wait", "_wait_batch_p2p"}
SAID = {"_engine_run_backward": "the gradient all-reduce in backward",
        "_wait_batch_p2p": "the pipeline's send/receive between stages"}
EMBER = Path(__file__).resolve().parents[1]


@dataclass
class Where:
    """Where a rank's training thread is when its watchdog fires."""
    waiting: bool     # in a collective, waiting for the others
    collective: str   # which one, and the ember line that called it ("" when not waiting)
    line: str         # the innermost frames, as one line


def where(thread_id: int) -> Where:
    """Whether a thread waits in a collective, which one, and its innermost frames as one line."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return Where(False, "", "(thread gone)")
    stack = traceback.extract_stack(frame)
    waits = [f for f in stack if f.name in COLLECTIVE or Path(f.filename).name == "world.py"]
    names = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[-6:]]
    line = ("in a collective: " if waits else "not in a collective: ") + " <- ".join(reversed(names))
    if not waits:
        return Where(False, "", line)
    inner = waits[-1].name
    inner = SAID.get(inner, inner)
    callers = [f for f in stack if Path(f.filename).resolve().is_relative_to(EMBER)
               and Path(f.filename).name != "world.py"]
    site = f" ({Path(callers[-1].filename).name}:{callers[-1].lineno} {callers[-1].name})" if callers else ""
    return Where(True, inner + site, line)


class Watchdog:
    def __init__(self, world: World, cfg: DistributedConfig, folder: Path, events: Events,
                 name: Callable[[int], str] = rank_name):
        """`name`: how its messages name a rank (a pipeline's by its stage: ember.parallel.pp.names_of)."""
        self.world, self.cfg, self.folder, self.events, self.name = world, cfg, folder, events, name
        self.steps: list[float] = []
        self.step = 0
        self.last = time.monotonic()
        self.relaxed = True  # until the first step: the collectives' timeout is the bound
        self.main_thread = threading.get_ident()
        self.store = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        """Watch this rank (distributed runs only; a one-process run has nobody to wait for)."""
        if not self.world.distributed:
            return self
        import torch.distributed as dist
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store = dist.PrefixStore("ember/watchdog/", dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=10), use_libuv=True))
        self._thread = threading.Thread(target=self._watch, name="ember-watchdog", daemon=True)
        self._thread.start()
        return self

    def beat(self, step: int, seconds: float | None) -> None:
        """A step (with its seconds) or a checkpoint (None) finished on this rank."""
        if seconds is not None:
            self.steps = (self.steps + [seconds])[-WINDOW:]
        self.step, self.last, self.relaxed = step, time.monotonic(), False
        if self.store is not None:
            self.store.set(f"step/{self.world.rank}", str(step))

    def relax(self) -> None:
        """A checkpoint is being written: the collectives' timeout bounds it, not the step's."""
        self.relaxed, self.last = True, time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            bound = self.cfg.timeout_seconds if self.relaxed else bound_seconds(self.cfg, self.steps)
            waited = time.monotonic() - self.last
            if waited > bound:
                self._hung(waited, bound)

    def _hung(self, waited: float, bound: float) -> None:
        rank, here = self.world.rank, where(self.main_thread)
        try:
            with open(self.folder / f"hang-rank{rank}.txt", "w") as f:
                f.write(f"{self.name(rank)}: step {self.step + 1} running for {waited:.1f} s (bound {bound:.1f} s)\n"
                        f"training thread: {here.line}\n\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as e:  # the report below still names where every rank is
            here.line += f" (its stacks could not be written: {e.strerror})"
        self.store.set(f"hang/{rank}", json.dumps({"step": self.step + 1, **asdict(here)}))
        if self.world.main:
            verdict, account = self.report(waited, bound)
            self.events.warn(account)
            tell_launcher(verdict)  # the launcher ends the run with it: rank 0 exits first, yet is not the cause
            self.store.set("hang/reported", "1")
        else:
            self._await_report()
        os._exit(EXIT_HUNG)

    def _await_report(self) -> None:
        """Leave only once rank 0 has said where every rank is: a rank that exits first has the
        launcher tear the group down, rank 0 with it, before its account is out (on a busy machine
        the hung rank's own watchdog often fires first). Not when rank 0 is not reporting at all
        (it died, or it is not stuck): then its hang key never comes."""
        start = time.monotonic()
        while time.monotonic() - start < REPORT_SECONDS:
            try:
                if self.store.check(["hang/reported"]):
                    return
                if time.monotonic() - start > PEERS_SECONDS + 3.0 and not self.store.check(["hang/0"]):
                    return
            except Exception:  # the store went with rank 0's host: nobody is left to report
                return
            time.sleep(0.05)

    def report(self, waited: float, bound: float) -> tuple[str, str]:
        """Rank 0's account of a hang: the one-line verdict (the ranks that never arrived and the
        collective the others wait in), and the full account, every rank's last step and where
        it is."""
        deadline = time.monotonic() + PEERS_SECONDS
        steps: dict[int, int] = {}
        hangs: dict[int, Where | None] = {}
        notes: dict[int, str] = {}
        for r in range(self.world.size):
            try:
                steps[r] = int(self.store.get(f"step/{r}").decode()) if self.store.check([f"step/{r}"]) else 0
                while not self.store.check([f"hang/{r}"]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.store.check([f"hang/{r}"]):
                    said = json.loads(self.store.get(f"hang/{r}").decode())
                    hangs[r] = Where(said["waiting"], said["collective"], f"step {said['step']}: {said['line']}")
                else:
                    hangs[r] = None
            except Exception as e:  # a store gone with its host: say so, keep what we have
                hangs.setdefault(r, None)
                notes[r] = f"(no answer: {type(e).__name__})"
        return self.verdict(steps, hangs, waited), self.account(steps, hangs, notes, waited, bound)

    def verdict(self, steps: dict[int, int], hangs: dict[int, Where | None], waited: float) -> str:
        """One line: who never arrived, and at which collective the others wait."""
        newest = max(steps.values(), default=0)
        behind = [r for r, s in steps.items() if s < newest]
        if not behind:  # all finished the same step: the ones not in the collective the others wait in
            behind = [r for r, h in hangs.items() if h is not None and not h.waiting]
        if not behind:  # every rank that answered waits: the silent ones are stuck where they cannot answer
            behind = [r for r, h in hangs.items() if h is None]
        waiting = [r for r, h in hangs.items() if h is not None and h.waiting]
        at = hangs[waiting[0]].collective if waiting else "a collective"
        who = self._ranks(behind)
        wait = (f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} waited there {waited:.1f} s"
                if waiting else f"no rank answered from inside a collective after {waited:.1f} s")
        if not who:
            return f"hang: in step {self.step + 1} no rank could be told apart as missing ({wait} at {at})"
        return f"hang: {who} never arrived at {at} in step {self.step + 1}; {wait}"

    def _ranks(self, ranks: list[int]) -> str:
        """'rank 1', 'ranks 0, 1'; each by its name where it has more than its number (a stage)."""
        if len(ranks) == 1 or any(self.name(r) != rank_name(r) for r in ranks):
            return ", ".join(map(self.name, ranks))
        return f"ranks {', '.join(map(str, ranks))}" if ranks else ""

    def account(self, steps: dict[int, int], hangs: dict[int, Where | None], notes: dict[int, str],
                waited: float, bound: float) -> str:
        """Every rank's last step and where its training thread is, for the console."""
        lines = [f"hang: step {self.step + 1} has run {waited:.1f} s, past the watchdog's bound of {bound:.1f} s "
                 f"({self.cfg.hang_factor:g} x the p99 step, at least {self.cfg.hang_min_seconds:g} s)"]
        for r in range(self.world.size):
            h = hangs.get(r)
            said = h.line if h is not None else notes.get(r, "no report")
            lines.append(f"  {self.name(r)}: last step {steps.get(r, '?')}; {said}")
        lines.append(f"stacks: {self.folder}/hang-rank*.txt; the group stops now (exit {EXIT_HUNG}) and resumes from "
                     f"the newest committed checkpoint when supervised (--restarts)")
        return "\n".join(lines)
