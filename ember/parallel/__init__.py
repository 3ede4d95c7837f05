"""How ranks split a run: one module per parallelism strategy, each the whole of what ember knows
about it, found by name in a plain dict (`registry.STRATEGIES`, the recipe's [distributed]
strategy values in the order `ember plan` lists them).

    mesh.py         Mesh: how the world's ranks divide into replicas, shards, tensor-parallel
                    groups and pipeline stages (torchtitan's ParallelDims), validated once where it is made
    collectives.py  the ring model of a collective's seconds and bytes (the advisor's arithmetic)
    strategy.py     Strategy: the protocol every strategy module satisfies, and the figures its
                    arithmetic reads (Footprint, Step, Ranks) and returns (Cost)
    ddp.py, fsdp.py, tp.py, fsdp_tp.py, pp.py, pp_ddp.py   the strategies (stages.py: the
                    pipeline's torch side; placement.py: a stage's layers, and how messages name a
                    rank by its stage)
    registry.py     STRATEGIES

A strategy says what it requires (LoRA, whole replicas, its mesh's degrees), how it changes one
device's memory and step time for `ember plan` (pure arithmetic), and applies itself to a model
(DDP, fully_shard, a tensor-parallel plan). Everything here imports without torch: planning and
the recipe read it without loading torch; `apply` imports torch when a run calls it, so the
torch code of a strategy sits beside its arithmetic. Checkpoints need nothing from a strategy:
every distributed run writes one DCP checkpoint by parameter name (ember/ckpt/sharded.py), which
loads at another world size and under another strategy.

Adding a strategy: a module here with a class satisfying `Strategy`, one line in registry.py, a
test in tests/parallel/, and `ember recipe --markdown > docs/recipe.md` (the recipe's help lists
every strategy's summary).
"""
