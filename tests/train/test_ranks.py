"""The arithmetic of sharing a run between ranks: who reads which micro-batch, how the ranks'
exits add up to the run's, and when the watchdog calls a step hung."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ember.errors import EXIT_ERROR, EXIT_HUNG, EXIT_INTERRUPTED, EmberError
from ember.events import Events, collect
from ember.recipe import DistributedConfig, Recipe
from ember.data.loader import RankShare, SkippingSampler
from ember.train.sharding import check_distributed
from ember.train.signals import StopRequest
from ember.train.watchdog import Watchdog, Where, bound_seconds
from ember.parallel.placement import rank_name
from ember.ranks import PEER_LOST, Topology, ended
from ember.world import World
from tests.helpers import ROOT


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_ranks_read_disjoint_parts_of_the_one_global_order(ranks):
    """Step s of any world size trains the same micro-batches: positions s*A .. s*A+A-1 of the
    global stream (skipped ordinals left out), each rank every ranks-th of them."""
    accum, steps, skip = 4, 6, {3, 10}
    single = list(SkippingSampler(100, accum * steps, skip))
    parts = [list(RankShare(SkippingSampler(100, accum * steps, skip), r, ranks)) for r in range(ranks)]
    for step in range(steps):
        mine = sorted(k for p in parts for k in p[step * accum // ranks:(step + 1) * accum // ranks])
        assert mine == sorted(single[step * accum:(step + 1) * accum])
    assert sorted(k for p in parts for k in p) == sorted(single)  # disjoint, nothing lost
    assert all(len(p) == accum * steps // ranks for p in parts)


@pytest.mark.parametrize("accum,ranks", [(1, 2), (3, 2), (2, 4), (1, 4), (6, 4)])
def test_rows_of_a_step_share_out_at_any_grad_accum(accum, ranks):
    """grad_accum not a multiple of the ranks: each micro-batch is cut into equal slices of rows
    and the step's slices dealt out; the ranks together train exactly the step's rows, once."""
    from ember.data.loader import row_parts
    parts, steps = row_parts(accum, ranks), 3
    share = [list(RankShare(SkippingSampler(50, accum * steps, set()), r, ranks, parts)) for r in range(ranks)]
    assert all(len(p) == accum * parts * steps // ranks for p in share)
    per_rank = accum * parts // ranks
    for step in range(steps):
        pieces = [x if parts > 1 else (x, 0, 1) for p in share for x in p[step * per_rank:(step + 1) * per_rank]]
        assert sorted(pieces) == [(k, i, parts) for k in range(step * accum, (step + 1) * accum) for i in range(parts)]


def test_the_batch_must_split_evenly_over_the_ranks():
    r = Recipe()
    r.train.micro_batch, r.train.grad_accum = 3, 3
    with pytest.raises(EmberError, match="3 x 3 = 9 rows .* must be a multiple of 2; set \\[train\\] grad_accum = 4"):
        check_distributed(r, 2, "recipe.toml")
    r.train.grad_accum = 4
    check_distributed(r, 2, "recipe.toml")
    r.train.micro_batch, r.train.grad_accum = 4, 1  # the shipped recipes: each rank takes half of each micro-batch
    check_distributed(r, 2, "recipe.toml")
    check_distributed(r, 4, "recipe.toml")
    r.method.kind, r.distributed.strategy = "lora", "tp"
    check_distributed(r, 2, "recipe.toml")  # tp splits the adapters with their base (ember.parallel.tp)
    r.distributed.strategy = "fsdp+tp"
    check_distributed(r, 4, "recipe.toml")  # and fsdp+tp, which splits as tp does inside its groups
    r.method.kind, r.distributed.strategy, r.train.grad_accum = "full", "fsdp+tp", 1
    with pytest.raises(EmberError, match="at least 4"):
        check_distributed(r, 2, "recipe.toml")
    r.train.micro_batch = 1
    with pytest.raises(EmberError, match="multiple of 2"):  # 2 groups of 2 read different data
        check_distributed(r, 4, "recipe.toml")
    r.train.grad_accum = 2
    check_distributed(r, 4, "recipe.toml")


@pytest.mark.parametrize("recipe", ["tiny.toml", "smollm2-lora.toml"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_shipped_recipes_pass_the_launchers_checks(recipe, strategy):
    """README's `ember run recipe.toml --out runs/a --nproc 2` with either shipped recipe."""
    from ember.recipe import load_recipe
    path = Path(__file__).resolve().parents[2] / "examples" / recipe
    r = load_recipe(path, [f"distributed.strategy={strategy}"])
    for ranks in (2, 4):
        check_distributed(r, ranks, str(path))


def failure(code: int, t: int, message: str = "") -> SimpleNamespace:
    """A torchrun ProcessFailure: exit code, when it was seen, what the rank left in its error file."""
    return SimpleNamespace(exitcode=code, timestamp=t, message=message)


def test_how_the_ranks_exits_make_the_runs():
    events, seen = collect()
    # Both stopped on request, or one did and the agent stopped the other after it: interrupted.
    assert ended({0: failure(75, 1), 1: failure(75, 1)}, events) == EXIT_INTERRUPTED
    assert ended({0: failure(75, 1), 1: failure(-signal.SIGTERM, 2)}, events) == EXIT_INTERRUPTED
    assert not seen
    # A rank killed: a crash, and the rank that failed first is named.
    assert ended({0: failure(-signal.SIGTERM, 5), 1: failure(-signal.SIGKILL, 4)}, events) == EXIT_ERROR
    assert "rank 1 failed first (killed by SIGKILL)" in seen[-1].message
    # The rank that died, not the one whose collective failed a moment after (seen first: its
    # error file holds an earlier second than the agent's own clock when it noticed the kill).
    assert ended({0: failure(1, 3, PEER_LOST), 1: failure(-signal.SIGKILL, 4)}, events, newest=5) == EXIT_ERROR
    assert seen[-1].message == ("rank 1 failed first (killed by SIGKILL); the group was torn down (rank 0 left "
                                "when its collective failed); saved: checkpoint step 5, the newest committed, "
                                "where a resume continues")
    # A hang: the watchdog's verdict, exit 70, although rank 0 (the one reporting) left first.
    verdict = "hang: rank 1 never arrived at all_reduce (loop.py:292 train_step) in step 7; rank 0 waited there 2.1 s"
    assert ended({0: failure(EXIT_HUNG, 3, verdict), 1: failure(EXIT_HUNG, 4)}, events, newest=0) == EXIT_HUNG
    assert seen[-1].message == verdict + "; the group was stopped, exit 70; saved: no checkpoint yet, a resume " \
                                         "starts from step 0"
    assert ended({0: failure(-signal.SIGTERM, 3), 1: failure(EXIT_HUNG, 3)}, events) == EXIT_HUNG  # another node's view
    assert "rank 0's report names the rank" in seen[-1].message and "failed first" not in seen[-1].message


def test_the_watchdog_names_the_rank_that_never_arrived():
    """Rank 0's verdict from every rank's last step and where its training thread is."""
    dog = Watchdog(World(0, 3), DistributedConfig(), Path("."), Events())
    dog.step = 6
    waits = Where(True, "all_reduce (loop.py:292 train_step)", "")
    # Same step: the one not in a collective; rank 0 itself may be the one.
    assert dog.verdict({0: 6, 1: 6, 2: 6}, {0: waits, 1: Where(False, "", ""), 2: waits}, 2.04) == (
        "hang: rank 1 never arrived at all_reduce (loop.py:292 train_step) in step 7; ranks 0, 2 waited there 2.0 s")
    assert dog.verdict({0: 6, 1: 6, 2: 6}, {0: Where(False, "", ""), 1: waits, 2: waits}, 3.0).startswith(
        "hang: rank 0 never arrived")
    # A rank a step behind; a rank stuck where it cannot even answer.
    assert dog.verdict({0: 6, 1: 6, 2: 5}, {0: waits, 1: waits, 2: waits}, 3.0).startswith("hang: rank 2 never")
    assert dog.verdict({0: 6, 1: 6, 2: 6}, {0: waits, 1: waits, 2: None}, 3.0).startswith("hang: rank 2 never")
    # No rank in a collective (before: "...; rank  waited there 3.0 s")
    idle = Where(False, "", "")
    assert dog.verdict({0: 6, 1: 6, 2: 6}, {0: idle, 1: idle, 2: idle}, 3.0) == (
        "hang: ranks 0, 1, 2 never arrived at a collective in step 7; no rank answered from inside a collective "
        "after 3.0 s")


def test_a_pipeline_names_its_ranks_by_their_stage():
    """The launcher's line and the watchdog's verdict name a pipeline's rank with its stage and the
    layers it holds (4 layers over 2 stages); the ranks that only waited keep their number."""
    events, seen = collect()
    stage = lambda r: rank_name(r, 2, 4)  # noqa: E731
    assert ended({0: failure(1, 3, PEER_LOST), 1: failure(-signal.SIGKILL, 4)}, events, 5, stage) == EXIT_ERROR
    assert seen[-1].message.startswith("rank 1 (pipeline stage 1 of 2, layers 2-3) failed first (killed by SIGKILL); "
                                       "the group was torn down (rank 0 left when its collective failed)")
    dog = Watchdog(World(0, 2), DistributedConfig(), Path("."), Events(), stage)
    dog.step = 6
    waits = Where(True, "the pipeline's send/receive between stages (stages.py:160 step)", "")
    assert dog.verdict({0: 6, 1: 6}, {0: waits, 1: Where(False, "", "")}, 2.04) == (
        "hang: rank 1 (pipeline stage 1 of 2, layers 2-3) never arrived at the pipeline's send/receive between "
        "stages (stages.py:160 step) in step 7; rank 0 waited there 2.0 s")
    assert dog.verdict({0: 6, 1: 6}, {0: None, 1: None}, 2.0).startswith(
        "hang: rank 0 (pipeline stage 0 of 2, layers 0-1), rank 1 (pipeline stage 1 of 2, layers 2-3) never")
    assert "  rank 1 (pipeline stage 1 of 2, layers 2-3): last step 6; no report" in dog.account(
        {0: 6, 1: 6}, {0: waits, 1: None}, {}, 2.0, 2.0)


def test_a_rank_is_quiet_on_a_signal(tmp_path):
    """A rank does not promise a checkpoint on SIGTERM: the agent sends one when another rank died."""
    for quiet, said in [(False, 1), (True, 0)]:
        events, seen = collect()
        stop = StopRequest(events, quiet=quiet).install()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and len(seen) == said
        finally:
            stop.restore()


def test_the_watchdog_bound():
    cfg = DistributedConfig(timeout_seconds=300, hang_factor=10, hang_min_seconds=30)
    assert bound_seconds(cfg, []) == 300  # before the first step: the collectives' own timeout
    assert bound_seconds(cfg, [0.5] * 99) == 30  # 10 x 0.5 s is under the floor
    assert bound_seconds(cfg, [1.0] * 98 + [4.0, 9.0]) == 90  # 10 x the p99 (the 99th of 100: 9 s)


def test_topology_flags_are_checked():
    with pytest.raises(EmberError, match="HOST:PORT"):
        Topology(2, 2, 1, "nohost").check()
    with pytest.raises(EmberError, match="--node-rank 2"):
        Topology(1, 2, 2, "10.0.0.1:29500").check()
    assert Topology(2, 2, 1, "10.0.0.1:29500").argv() == ["--nproc", "2", "--nnodes", "2", "--node-rank", "1",
                                                         "--rdzv", "10.0.0.1:29500"]
    assert Topology().argv() == []
    with pytest.raises(EmberError, match="both must be >= 1"):
        Topology(0).check()
    with pytest.raises(EmberError, match="add --nnodes"):
        Topology(2, 1, 1, "").check()


def test_the_rank_the_others_wait_for():
    """Rank 1 reads slowly: rank 0 waits for it at the all-reduce, so rank 1 is named, for input."""
    from ember.metrics.rank_times import figures, summarize
    fast = figures(0, [1.0] * 10, 1000, {"data": 0.5, "forward": 3, "backward": 3, "optimizer": 1, "sync": 2.5})
    slow = figures(1, [1.0] * 10, 1000, {"data": 5.5, "forward": 2, "backward": 2, "optimizer": 0.4, "sync": 0.1})
    s = summarize(2, [fast, slow])
    assert (s.slowest, s.slowest_cause) == (1, "input")
    assert s.tokens_per_second == pytest.approx(200.0) and s.sync_share == pytest.approx((0.25 + 0.01) / 2)


def test_the_launcher_leaves_no_folder_behind(tmp_path):
    """torchrun's agent keeps the ranks' error files in a folder it never removes: each launch
    left a /tmp/torchelastic_* behind (122 after two runs of the suite). The launcher's folder is
    now under $EMBER_HOME/scratch, removed once the ranks' ends are read, whether they succeeded
    or failed. A fresh interpreter: the agent sets signal handlers of its own in the process."""
    tmp, home = tmp_path / "tmp", tmp_path / "home"
    tmp.mkdir()
    code = ("import sys; from ember.events import Events; from ember.ranks import Topology, launch; "
            "sys.exit(launch(Topology(2), sys.argv[1:], 'leftovers', Events()))")
    for rank, code_out in [("pass", 0), ("import sys; sys.exit(3)", EXIT_ERROR)]:
        done = subprocess.run([sys.executable, "-c", code, "-c", rank], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "TMPDIR": str(tmp), "EMBER_HOME": str(home)}, timeout=300)
        assert done.returncode == code_out, done.stderr
        assert list(tmp.iterdir()) == [], f"left in $TMPDIR by ranks of {rank!r}"
        assert list(home.glob("scratch/*")) == [], f"left in $EMBER_HOME/scratch by ranks of {rank!r}"
