"""A strategy applied on real ranks: gloo over a file store, each rank applying the strategy to
the builtin tiny Llama and taking one forward and backward on the batch every rank shares, beside
the plain model on the same batch (with `lora`, both wrapped by peft with non-zero adapters). The ranks fork from a server process that imported torch and
transformers and ran nothing (not from the test process, whose threads a fork would copy
mid-flight). What comes back, per rank: both losses, the largest difference between a gradient
(gathered whole) and the plain model's, and how a few parameters are laid out."""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HANG_SECONDS = 600  # far beyond the ~15 s a rank takes on two busy cores
WATCHED = {"q_proj": "model.layers.0.self_attn.q_proj.weight", "o_proj": "model.layers.0.self_attn.o_proj.weight",
           "embed": "model.embed_tokens.weight"}
LORA_WATCHED = {"q_proj.lora_A": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
                "q_proj.lora_B": "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
                "o_proj.lora_A": "base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight",
                "o_proj.lora_B": "base_model.model.model.layers.0.self_attn.o_proj.lora_B.default.weight"}


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Adapters on every projection tp splits, B not zero (so that A has a gradient), no dropout."""
    from peft import LoraConfig, get_peft_model
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def layout(p: torch.Tensor) -> dict:
    """A parameter's kind and, for a DTensor, its mesh's shape and its placements."""
    if not hasattr(p, "placements"):
        return {"kind": "Tensor"}
    return {"kind": "DTensor", "mesh": list(p.device_mesh.shape), "placements": [str(x) for x in p.placements]}


def _worker(rank: int, world: int, name: str, tp_size: int, folder: str, lora: bool) -> None:
    from transformers import LlamaForCausalLM

    from ember.models import tiny_config
    from ember.parallel.registry import STRATEGIES
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # a hung rank fails the test, with its stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        plain = LlamaForCausalLM(tiny_config())
        plain = with_lora(plain) if lora else plain
        model = copy.deepcopy(plain)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        reference = plain(input_ids=ids, labels=ids).loss
        reference.backward()
        strategy = STRATEGIES[name]
        applied = strategy.apply(model, strategy.mesh(world, tp_size, pp_size=2), torch.device("cpu"))
        loss = applied(input_ids=ids, labels=ids).loss
        loss.backward()
        inner = getattr(applied, "module", applied)  # DDP wraps; the others change the model in place
        plains = dict(plain.named_parameters())
        worst = 0.0
        for n, p in inner.named_parameters():
            if p.grad is None:  # frozen under LoRA: neither model has its gradient
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, float((g - plains[n].grad).abs().max()))
        params = dict(inner.named_parameters())
        Path(folder, f"rank{rank}.json").write_text(json.dumps({
            "wrapper": type(applied).__name__, "loss": loss.item(), "reference": reference.item(),
            "grad_difference": worst, "layout": {k: layout(params[v]) for k, v in (LORA_WATCHED if lora else WATCHED).items()}}))
        dist.barrier()  # no rank is still inside a collective
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave as ember's own ranks do (ember.launch.fast_exit), without tearing gloo down: freeing
    # the wrapped model as this function returned destroyed the process group from the main
    # thread, which holds the GIL while it joins gloo's work thread, and that thread was waiting
    # for the GIL to free a finished all-reduce: one rank hung until HANG_SECONDS (seen once,
    # DDP on two ranks; its stack showed exactly that).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def apply_on_ranks(name: str, world: int, folder: Path, tp_size: int = 2, lora: bool = False) -> list[dict]:
    """Each rank's figures for strategy `name` applied on `world` ranks."""
    # What every rank imports, once in the forkserver: the model's module itself (the top-level
    # `transformers` is a lazy module that imports none of it: each rank paid ~4 CPU-s), peft for
    # the LoRA ranks (~1.6 CPU-s each), and this module with torch.
    mp.set_forkserver_preload([__name__, "transformers.models.llama.modeling_llama", "peft", "ember.models",
                               "ember.parallel.registry"])
    mp.start_processes(_worker, args=(world, name, tp_size, str(folder), lora), nprocs=world, start_method="forkserver")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
