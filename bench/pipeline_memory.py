"""The plan's memory per pipeline stage against each stage's measured peak.

A Llama of the builtin tiny shape with more layers and a larger vocabulary, split into one stage
per rank (ember.parallel.stages.split_into_stage, as `ember run` splits it), each rank a gloo
process on this CPU. Every rank takes the loop's pipeline step, the schedule over grad_accum
micro-batches (ember.parallel.stages.Pipeline.step), the gradient clip across stages and
ember's AdamW update (ember.train.parts.build_optimizer); its peak is measured on the second
step as `ember plan --calibrate` measures one on CPU (ember.doctor.measure.step_peak: live
tensors at the start plus the high point of the profiler's allocations). The plan's figure for
each stage: ember.parallel.pp.stage_memory over ember.plan.layout.footprint. Figures are
printed, never asserted.

    python bench/pipeline_memory.py --stages 4 --layers 4 --accum 4 --schedule 1f1b
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 1 << 20


def config(layers: int, vocab: int) -> object:
    """The builtin tiny Llama with `layers` decoder layers and a `vocab` of that size."""
    from ember.models import tiny_config
    c = tiny_config()
    c.num_hidden_layers, c.vocab_size = layers, vocab
    return c


def _rank(rank: int, world: int, a: argparse.Namespace, folder: str) -> None:
    from transformers import LlamaForCausalLM

    from ember.data.loader import MicroBatch
    from ember.device import autocast
    from ember.doctor.measure import step_peak
    from ember.parallel.pp import PP, pipeline_of
    from ember.recipe import MethodConfig, OptimizerConfig
    from ember.train.model import apply_lora
    from ember.train.parts import build_optimizer
    from ember.train.sharding import clip_gradients
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        cpu = torch.device("cpu")
        model = LlamaForCausalLM(config(a.layers, a.vocab))
        if a.lora:
            model = apply_lora(model, MethodConfig(kind="lora", rank=a.lora, dropout=0.0))
        model = PP().apply(model, PP().mesh(world, 2, world), cpu)
        pipe = pipeline_of(model)
        opt = build_optimizer(model, OptimizerConfig())
        gen = torch.Generator().manual_seed(1)
        batches = [MicroBatch(torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=gen), first=i * a.micro_batch)
                   for i in range(a.accum)]
        tokens = float(sum(b.targets() for b in batches))

        def step() -> None:
            with autocast(cpu, a.precision):  # as the loop runs a pipeline's step
                pipe.step(batches, tokens, a.schedule)
            clip_gradients([p for p in model.parameters() if p.requires_grad], 1.0, pipe.sum_over_stages)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # the first: optimizer state and the schedule's buffers come to exist
        peak = step_peak(step, cpu)
        Path(folder, f"rank{rank}.json").write_text(json.dumps({"stage": pipe.stage, "peak": peak}))
    finally:
        dist.destroy_process_group()


def predicted(a: argparse.Namespace) -> tuple[list[float], float]:
    """The plan's bytes for each stage, and the figure the plan gave every stage before it priced
    them one by one (a share of the state over the stages, the one-process activations and the
    rest of its peak: the baseline)."""
    from ember.parallel.pp import stage_memory
    from ember.plan.layout import footprint
    from ember.plan.memory import ModelShape, TrainShape, estimate
    m = ModelShape.from_config(config(a.layers, a.vocab))
    t = TrainShape(a.micro_batch, a.seq, lora=a.lora > 0, lora_rank=a.lora or 8, autocast=a.precision != "fp32")
    fp = footprint(m, estimate(m, t), t, (a.accum, a.schedule, a.stages))
    before = fp.state / a.stages + fp.activations + max(0.0, fp.peak - fp.state - fp.activations)
    return stage_memory(fp.stages, a.stages, a.accum, a.schedule), before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA adapters of this rank on every linear")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.set_forkserver_preload(["transformers", "ember.parallel.stages"])
        mp.start_processes(_rank, args=(a.stages, a, folder), nprocs=a.stages, start_method="forkserver")
        measured = {r["stage"]: r["peak"] for r in
                    (json.loads(Path(folder, f"rank{i}.json").read_text()) for i in range(a.stages))}
    plan, before = predicted(a)
    print(f"{a.stages} stages, {a.layers} layers, vocab {a.vocab}, micro batch {a.micro_batch} x seq {a.seq}, "
          f"{a.accum} micro-batches, {a.schedule}, {a.precision}" + (f", LoRA rank {a.lora}" if a.lora else ""))
    print("| stage | measured | plan | plan / measured | plan before | before / measured |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for s in range(a.stages):
        print(f"| {s} | {measured[s] / MiB:.2f} MiB | {plan[s] / MiB:.2f} MiB | {plan[s] / measured[s]:.3f} | "
              f"{before / MiB:.2f} MiB | {before / measured[s]:.3f} |")


if __name__ == "__main__":
    main()
