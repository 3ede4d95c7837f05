"""How a world of ranks divides (torchtitan's ParallelDims): `replicate` copies of the model
(DDP), each sharded over `shard` ranks (FSDP), each rank's layers split over `tp` ranks (tensor
parallelism), the layers in `pp` stages, one rank each (pipeline parallelism). replicate x shard x
tp x pp = world. The data-parallel ranks (replicas and shards) read different rows; the ranks of
one tensor-parallel group, and the stages of one pipeline, read the same ones. The innermost
degree varies fastest: with replicate 2 x pp 2, ranks 0 and 1 are the stages of replica 0, ranks
2 and 3 those of replica 1 (torch's init_device_mesh lays out (dp, pp) the same way)."""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import EmberError


@dataclass(frozen=True)
class Mesh:
    world: int
    replicate: int = 1
    shard: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        degrees = {"replicate": self.replicate, "shard": self.shard, "tp": self.tp, "pp": self.pp}
        if any(d < 1 for d in degrees.values()) or self.replicate * self.shard * self.tp * self.pp != self.world:
            raise EmberError(f"{self.world} ranks do not divide into replicate x shard x tp x pp = "
                             f"{self.replicate} x {self.shard} x {self.tp} x {self.pp}: each degree is at "
                             f"least 1 and their product is the number of ranks")

    @property
    def dp(self) -> int:
        """The ranks that read different rows."""
        return self.replicate * self.shard

    def dp_rank(self, rank: int) -> int:
        """Rank `rank`'s place among the data-parallel ranks (its tensor-parallel group's, its pipeline's)."""
        return rank // (self.tp * self.pp)
