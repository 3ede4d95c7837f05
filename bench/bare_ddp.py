"""A bare torchrun + DDP loop for bench/distributed.py: the recipe's model, data order (ember's
packed micro-batches, rank r taking every other one), AdamW and clipping, with nothing else: no
checkpoints, metrics, agreement or watchdog. Prints the median step seconds after the warm-up.

usage: torchrun --standalone --nproc-per-node 2 bench/bare_ddp.py RECIPE STEPS
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from ember.ckpt.state import DataCursor  # noqa: E402
from ember.recipe import load_recipe  # noqa: E402
from ember.data.loader import PackedBatches, data_fingerprint, tokenize  # noqa: E402
from ember.train.model import load_model  # noqa: E402

WARMUP = 5


def main() -> None:
    r = load_recipe(Path(sys.argv[1]))
    steps = int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(r.train.threads or 1)
    torch.manual_seed(r.train.seed)
    bundle = load_model(r.model, r.method, False)
    tokens = tokenize(r.data, bundle.tokenizer, data_fingerprint(r.data.files, bundle.tokenizer))
    data = PackedBatches(tokens, r.data.seq_len, r.train.micro_batch, r.train.seed, DataCursor())
    model = DDP(bundle.model)
    o = r.optimizer
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, betas=(o.beta1, o.beta2),
                            eps=o.eps, weight_decay=o.weight_decay)
    accum = r.train.grad_accum // world
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for i in range(accum):
            ids = data.batch(step * r.train.grad_accum + i * world + rank).ids
            with nullcontext() if i == accum - 1 else model.no_sync():
                loss = model(input_ids=ids, labels=ids).loss
                (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(statistics.median(times[WARMUP:]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
