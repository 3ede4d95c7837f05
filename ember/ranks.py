"""Starting the ranks of a distributed run with torchrun's launcher (torch.distributed.run's
`elastic_launch`), and reading how they ended.

    ember run R --nproc N                        one node: N ranks, rendezvous on loopback
    ember run R --nproc N --nnodes M --node-rank K --rdzv HOST:PORT
                                                 node K of M; node 0 hosts the rendezvous at
                                                 HOST:PORT and global rank 0 (static rendezvous:
                                                 rank 0 must be on the node whose launcher holds
                                                 the run folder's lock)

This process is the launcher: it holds the run folder's lock for the ranks (ember.lock) and
waits. torchrun's own restarts are off (max_restarts 0): when one rank dies, the agent tears the
group down, and ember's supervisor (--restarts) restarts the whole group from the last durable
checkpoint with its backoff and its crash-loop rules, the same as a one-process run. The
launcher says in one line which rank ended the run (a pipeline's with its stage and layers,
ember.parallel.placement), how, and what was saved (`ended`): the
other ranks' collectives failed after it (they leave quietly, ember.world.lost_peer) or the agent
stopped them, and a hang is named by the watchdog's verdict (exit 70). A signal to
the launcher reaches every rank (the agent forwards it); they agree at the step boundary to
stop, write one checkpoint and exit 75; the agent waits `SHUTDOWN_SECONDS` for that before it
kills them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ember.errors import EXIT_ERROR, EXIT_HUNG, EXIT_INTERRUPTED, EXIT_OK, EmberError
from ember.events import Events
from ember.lock import LAUNCHER
from ember.parallel.placement import rank_name
from ember.paths import ascii_digits
from ember.scratch import scratch

SHUTDOWN_SECONDS = 120  # after a signal: a checkpoint's time for the ranks, then SIGKILL
PEER_LOST = "a collective failed: another rank is gone"  # what a rank leaves the launcher then


@dataclass
class Topology:
    nproc: int = 1                 # ranks on this node
    nnodes: int = 1
    node_rank: int = 0
    rdzv: str = ""                 # HOST:PORT of node 0 (several nodes)

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    def check(self) -> None:
        if self.nproc < 1 or self.nnodes < 1:
            raise EmberError(f"--nproc {self.nproc} --nnodes {self.nnodes}: both must be >= 1")
        if self.nnodes > 1:
            host, _, port = self.rdzv.rpartition(":")
            if not host or not (ascii_digits(port) and 0 < int(port) < 65536):
                raise EmberError(f"--rdzv {self.rdzv!r}: give node 0's address as HOST:PORT (every node the same)")
            if not 0 <= self.node_rank < self.nnodes:
                raise EmberError(f"--node-rank {self.node_rank}: must be 0..{self.nnodes - 1}")
        elif self.node_rank or self.rdzv:
            raise EmberError("--node-rank and --rdzv are for several nodes: add --nnodes M (M >= 2), the same on "
                             "every node")

    def argv(self) -> list[str]:
        """These flags again, for a supervised child (none for one process)."""
        if self.world == 1:
            return []
        out = ["--nproc", str(self.nproc)]
        if self.nnodes > 1:
            out += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--rdzv", self.rdzv]
        return out


def launch(topology: Topology, rank_argv: list[str], run_name: str, events: Events,
           newest: Callable[[], int | None] = lambda: None, named: Callable[[int], str] = rank_name) -> int:
    """Run `python rank_argv...` as every rank of this node; the exit code the run ends with.
    `newest()`: the run's newest committed checkpoint step (None: not known on this node);
    `named(rank)`: how the message names the rank that ended the run (its pipeline stage)."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs each rank's end at ERROR, exit 75 included; ended() says what happened.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    t = topology
    if t.nnodes > 1:  # static: node K's ranks are K*nproc .. K*nproc+nproc-1, rank 0 on node 0
        rdzv = {"rdzv_backend": "static", "rdzv_endpoint": t.rdzv, "rdzv_configs": {"rank": t.node_rank}}
    else:
        rdzv = {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "rdzv_configs": {}}
    # The agent keeps the ranks' error files in a folder it never removes (a /tmp/torchelastic_*
    # each launch, by default): this one goes once their ends are read (ProcessFailure reads them).
    with scratch("ranks-") as logs:
        config = LaunchConfig(min_nodes=t.nnodes, max_nodes=t.nnodes, nproc_per_node=t.nproc,
                              run_id=f"ember-{run_name}", max_restarts=0, monitor_interval=0.1,
                              shutdown_timeout=SHUTDOWN_SECONDS, logs_specs=DefaultLogsSpecs(log_dir=str(logs)), **rdzv)
        os.environ[LAUNCHER] = str(os.getpid())
        events.stage(f"starting {t.nproc} ranks" + (f" on node {t.node_rank} of {t.nnodes}" if t.nnodes > 1 else ""))
        try:
            elastic_launch(config, sys.executable)(*rank_argv)
            return EXIT_OK
        except SignalException as e:  # the agent forwarded it and waited for the ranks
            events.info(f"{e.sigval.name}: the ranks were asked to checkpoint and stop")
            return EXIT_INTERRUPTED
        except ChildFailedError as e:
            return ended(e.failures, events, newest(), named)
        finally:
            os.environ.pop(LAUNCHER, None)


def ended(failures: dict, events: Events, newest: int | None = None, name: Callable[[int], str] = rank_name) -> int:
    """The run's exit code from the ranks that did not exit 0 (global rank -> ProcessFailure),
    said in one line with what was saved (`newest`: the newest committed checkpoint's step).
    Interrupted when a rank exited 75 and the others did too or were stopped by the agent
    after it (SIGTERM); hung when the watchdog stopped the group (its verdict names the rank that
    never arrived); otherwise a crash, naming the rank that failed first, not one that only
    followed it (stopped by the agent, or its collective failed when the first one died)."""
    codes = {rank: f.exitcode for rank, f in failures.items()}
    if EXIT_INTERRUPTED in codes.values() and all(c in (EXIT_INTERRUPTED, -signal.SIGTERM) for c in codes.values()):
        return EXIT_INTERRUPTED
    said = {rank: f.message for rank, f in failures.items() if isinstance(getattr(f, "message", None), str)}
    if EXIT_HUNG in codes.values():
        verdict = next((m for m in said.values() if m.startswith("hang:")),
                       "hang: the watchdog stopped the group (rank 0's report names the rank that never arrived)")
        events.warn(f"{verdict}; the group was stopped, exit {EXIT_HUNG}{_saved(newest)}")
        return EXIT_HUNG
    followed = {r for r, c in codes.items() if c == -signal.SIGTERM or said.get(r) == PEER_LOST}
    rank = min(set(failures) - followed or set(failures), key=lambda r: (failures[r].timestamp, r))
    others = ", ".join(f"rank {r} {_follower(codes[r], said.get(r))}" for r in sorted(set(codes) - {rank}))
    events.warn(f"{name(rank)} failed first ({_how(codes[rank])}); the group was torn down"
                + (f" ({others})" if others else "") + _saved(newest))
    return EXIT_ERROR


def _how(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def _follower(code: int, said: str | None) -> str:
    if said == PEER_LOST:
        return "left when its collective failed"
    return "stopped" if code == -signal.SIGTERM else _how(code)


def _saved(newest: int | None) -> str:
    if newest is None:
        return ""
    if newest == 0:
        return "; saved: no checkpoint yet, a resume starts from step 0"
    return f"; saved: checkpoint step {newest}, the newest committed, where a resume continues"
