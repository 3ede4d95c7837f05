"""Two nodes on one machine: network namespaces joined by a veth pair (tests/netns.py), each running
`ember run --nnodes 2 --node-rank K --rdzv HOST:PORT`; and the interconnect between them measured
by `ember doctor --comm` on a link shaped to 100 Mbit/s."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import netns
from tests.helpers import ROOT, assert_same_result, run_ember, write_recipe

WHY = netns.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two-node tests need network namespaces: {WHY}")
PORT = "29561"


def on_both(a: netns.Node, b: netns.Node, *args: str, timeout: float = 300) -> tuple[str, str]:
    """`python -m ember ARGS --nnodes 2 --node-rank K --rdzv A:PORT` in each namespace; their stderr."""
    procs = [subprocess.Popen([*n.prefix(), sys.executable, "-m", "ember", *args, "--nnodes", "2",
                               "--node-rank", str(k), "--rdzv", f"{a.addr}:{PORT}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for k, n in enumerate((a, b))]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:  # ours, by handle
            if p.poll() is None:
                p.kill()
                p.wait()
    for code, _, err in outs:
        assert code == 0, err[-3000:]
    return outs[0][1], outs[0][2]


def test_two_nodes_train_what_two_local_ranks_train(tmp_path):
    r = write_recipe(tmp_path, train={"max_steps": 8, "grad_accum": 2}, checkpoint={"every_steps": 5})
    # The reference: two ranks on this node, forked warm (only the nodes must start in their namespaces)
    local = run_ember("run", r, "--out", tmp_path / "local", "--no-ledger", "--nproc", "2")
    assert local.returncode == 0, local.stderr[-3000:]
    with netns.two_nodes() as (a, b):
        on_both(a, b, "run", str(r), "--out", str(tmp_path / "nodes"), "--no-ledger", "--nproc", "1")
    assert_same_result(tmp_path / "nodes", tmp_path / "local")
    assert sorted(p.name for p in (tmp_path / "nodes" / "checkpoints" / "step-000000008").iterdir()) == [
        ".metadata", "MANIFEST.json", "__0_0.distcp", "__1_0.distcp"]


def test_the_measured_interconnect_is_the_shaped_link(tmp_path):
    """100 Mbit/s is 12.5 MB/s each way: a two-rank all-reduce moves 1x the tensor over each
    link and an all-gather 1/2 of it, so their fitted bus bandwidths must come out near that
    (and the ledger must hold them). gloo's reduce-scatter reduces the whole tensor before it
    scatters, so on this link it costs what an all-reduce does: half the bus bandwidth."""
    ledger = tmp_path / "ledger.db"
    with netns.two_nodes("100mbit") as (a, b):
        out, _ = on_both(a, b, "doctor", "--comm", "--nproc", "1", "--ledger", str(ledger), "--json", timeout=400)
    row = json.loads(out)
    assert (row["ranks"], row["nodes"], row["backend"]) == (2, 2, "gloo")
    # At least 40% of the link (the other test worker shares these 2 cores with gloo's threads:
    # 7.8 MB/s was seen) and no more than the link (unshaped, the veth pair is far faster).
    for kind, low in (("all_reduce", 5e6), ("all_gather", 5e6), ("reduce_scatter", 2.5e6)):
        assert low < row["links"][kind]["bandwidth"] < 14e6, (kind, row["links"][kind], row["samples"][kind])
    from ember.ledger import comm_rows as comm, database as store
    assert comm.newest(store.connect(ledger)).links == row["links"]
