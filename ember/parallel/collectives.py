"""What a collective costs on a measured interconnect (the bus-bandwidth model of nccl-tests): a
ring collective over n ranks takes `hops` latency-bound steps and moves `share` x the tensor's
bytes over each rank's link:

    all-reduce       hops 2(n-1)   share 2(n-1)/n
    all-gather       hops (n-1)    share (n-1)/n    (bytes: the whole gathered tensor)
    reduce-scatter   hops (n-1)    share (n-1)/n    (bytes: the whole tensor before scattering)

so seconds = hops x latency + share x bytes / bandwidth, with latency and bandwidth fitted to
the sizes `ember doctor --comm` measured (ember.plan.advisor.fit)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One collective's fitted cost on the measured interconnect."""
    latency: float     # seconds per ring hop
    bandwidth: float   # bytes/s over each rank's link (bus bandwidth)


@dataclass(frozen=True)
class Interconnect:
    ranks: int
    nodes: int
    backend: str
    all_reduce: Link
    all_gather: Link
    reduce_scatter: Link
    measured: str = ""   # when and where (for the reasons)


def hops_share(kind: str, n: int) -> tuple[int, float]:
    """(latency-bound hops, share of the bytes over each rank's link) of a ring collective."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    return n - 1, (n - 1) / n


def collective_seconds(link: Link, kind: str, nbytes: float, n: int) -> float:
    """Seconds for one ring collective of `nbytes` over n ranks (0 for one rank)."""
    if n <= 1:
        return 0.0
    hops, share = hops_share(kind, n)
    return hops * link.latency + share * nbytes / link.bandwidth
