"""Two Linux network namespaces joined by a veth pair: two "nodes" on one machine, for tests and
benchmarks of multi-node runs. Addresses live only on that private link; `rate` shapes it with a
token bucket (tc tbf: this kernel has no netem, so no added delay). Created and removed by the
test that uses them; where they cannot be created (not root, no iproute2), `available()` says why."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Node:
    ns: str
    dev: str
    addr: str

    def prefix(self) -> list[str]:
        """Run a command inside this node's namespace, gloo bound to its end of the link."""
        return ["ip", "netns", "exec", self.ns, "env", f"GLOO_SOCKET_IFNAME={self.dev}"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"emb-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"ip netns add failed: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def shape(node: Node, rate: str | None) -> None:
    """Limit what `node` sends to `rate` (e.g. '100mbit'); None removes the limit."""
    subprocess.run(["ip", "netns", "exec", node.ns, "tc", "qdisc", "del", "dev", node.dev, "root"],
                   capture_output=True)
    if rate:
        subprocess.run(["ip", "netns", "exec", node.ns, "tc", "qdisc", "add", "dev", node.dev, "root", "tbf",
                        "rate", rate, "burst", "256kb", "latency", "100ms"], check=True, capture_output=True)


@contextmanager
def two_nodes(rate: str | None = None):
    """(node 0, node 1) on 10.77.x.1 and .2, torn down afterwards whatever happens."""
    tag = f"{os.getpid() % 100000}"
    a, b = Node(f"emb-a{tag}", f"emb-a{tag}", ""), Node(f"emb-b{tag}", f"emb-b{tag}", "")
    net = f"10.77.{os.getpid() % 250}"
    a.addr, b.addr = f"{net}.1", f"{net}.2"
    made = []
    try:
        for n in (a, b):
            _ip("netns", "add", n.ns)
            made.append(n.ns)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for n in (a, b):
            _ip("link", "set", n.dev, "netns", n.ns)
            _ip("-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", n.dev)
            _ip("-n", n.ns, "link", "set", n.dev, "up")
            _ip("-n", n.ns, "link", "set", "lo", "up")
            shape(n, rate)
        yield a, b
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
