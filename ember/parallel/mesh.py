"""How a world of ranks divides (torchtitan's ParallelDims): `replicate` copies of the model
(DDP), each sharded over `shard` ranks (FSDP), each rank's layers split over `tp` ranks (tensor
parallelism). replicate x shard x tp = world. The data-parallel ranks (replicas and shards) read
different rows; the ranks of one tensor-parallel group read the same ones."""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import EmberError


@dataclass(frozen=True)
class Mesh:
    world: int
    replicate: int = 1
    shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        degrees = {"replicate": self.replicate, "shard": self.shard, "tp": self.tp}
        if any(d < 1 for d in degrees.values()) or self.replicate * self.shard * self.tp != self.world:
            raise EmberError(f"{self.world} ranks do not divide into replicate x shard x tp = "
                             f"{self.replicate} x {self.shard} x {self.tp}: each degree is at least 1 and "
                             f"their product is the number of ranks")

    @property
    def dp(self) -> int:
        """The ranks that read different rows."""
        return self.replicate * self.shard

    def dp_rank(self, rank: int) -> int:
        """Rank `rank`'s place among the data-parallel ranks (its tensor-parallel group's)."""
        return rank // self.tp
