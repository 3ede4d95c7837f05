"""The processes a run trains on: one (no process group, every call a no-op) or the ranks torchrun
started (torch.distributed, gloo on CPU, NCCL on CUDA). Torch is imported where a rank uses it:
`launched()` answers a launcher or a supervisor that never trains (ember.launch).

A rank learns its place from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT). The loop talks to `World` alone, so a one-process run and a distributed one
read the same lines: `world.sum(...)`, `world.any(...)`, `world.barrier()`.

Every collective carries a timeout (`timeout_seconds`): a rank that never arrives fails the
others' collective instead of hanging them forever; the watchdog (ember.train.watchdog) notices
a slow step long before that. A rank dying fails the others' next collective (`lost_peer`): they
leave quietly and the launcher names the rank that died (ember.ranks). A rank tells the launcher
why it ended through torchrun's error file (`tell_launcher`).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str = ""
    dp_rank: int = 0   # this rank's place among the ranks that read different data
    dp_size: int = 1   # ranks that read different data (all of them, but under tensor parallelism)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        """The rank that writes the run folder, the ledger and the console."""
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64: a loss sum keeps its low bits)."""
        import torch
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(t)  # sync point: every rank waits for the slowest
        return t.tolist()

    def mean_over_replicas(self, values: list[float]) -> list[float]:
        """Sum over the data-parallel ranks of figures that tensor-parallel ranks share: the sum
        over all ranks divided by how many ranks hold each copy."""
        total = self.sum(values)
        copies = self.size // self.dp_size
        return [v / copies for v in total] if copies > 1 else total

    def any(self, *flags: bool) -> list[bool]:
        """Each flag true on some rank: how ranks agree to stop or checkpoint at one step."""
        import torch
        if not self.distributed:
            return list(flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()]

    def barrier(self) -> None:
        import torch
        if self.distributed:
            torch.distributed.barrier()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on the main rank (None elsewhere)."""
        import torch
        if not self.distributed:
            return [obj]
        out = [None] * self.size if self.main else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The main rank's `obj` on every rank."""
        import torch
        if not self.distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        import torch
        if self.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def launched() -> bool:
    """Whether torchrun started this process as a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def join(device: torch.device, timeout_seconds: float) -> World:
    """This process's place: the torchrun group it belongs to (initialised here), or one alone."""
    import torch
    if not launched():
        return World()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = torch.distributed.get_default_backend_for_device(device) if device.type != "cpu" else "gloo"
    if size > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds),
                                             **({"device_id": device} if device.type == "cuda" else {}))
    return World(rank, size, local, backend, rank, size)


def lost_peer(e: BaseException) -> bool:
    """Whether `e` is a collective failing under this rank because another rank went away (it
    died, or its connection did): gloo's connection reset or closed, NCCL's and the store's
    errors (torch.distributed.DistError), or DCP's report of one of those."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    for _ in range(8):  # the exception and what it was raised from
        if isinstance(e, torch.distributed.DistError):
            return True
        if isinstance(e, (RuntimeError, CheckpointException)) and any(
                s in str(e) for s in ("/gloo/", "Connection reset by peer", "Connection closed by peer")):
            return True
        if e.__cause__ is None and e.__context__ is None:
            return False
        e = e.__cause__ or e.__context__
    return False


def tell_launcher(message: str) -> None:
    """Leave `message` for the launcher (torchrun's error file for this rank; ember.ranks reads
    it as the rank's failure message); nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": str(int(time.time()))}, f)
