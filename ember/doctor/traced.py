"""A training step's peak memory and FLOPs, counted on the model's own module graph without
weights, data or the memory to hold them: the plan of a model family ember has no formula for.

The recipe's model is built from its config on the meta device (no weights read, no memory),
made what the recipe trains (activation checkpointing, LoRA: ember.train.model.prepare_model),
and its parameters and buffers become fake tensors (torch's FakeTensorMode: shapes, dtypes and
a CPU device, no storage). Then the loop's own step runs on them: the loss
(ember.train.loss.causal_lm_loss, autocast per [precision], the chunked loss), backward, clipping,
the optimizer's update, gradients to None. `LiveBytes` counts every tensor storage the step's ops
create and frees it when the storage dies; the peak of the second step (the optimizer state
exists) is the plan. FLOPs of one micro-batch's forward and backward come from torch's
FlopCounterMode in the same pass.

QLoRA's 4-bit base ([method] quantize = 'nf4') is traced too: each linear becomes bitsandbytes'
Linear4bit with its packed codes and quantization state as fake tensors of the sizes bitsandbytes
gives them (ember.doctor.fake_step._meta_4bit); its forward runs bitsandbytes' fake kernel, to
which the trace adds the block scales and weight the CPU kernel dequantizes inside it, and its
backward's dequantization runs as ops of its own. The 4-bit calls and the bytes they move are
counted for the plan's time (ember.plan.planner.priced_dequant). A GGUF file's own blocks
([method] quantize = 'gguf') are traced with their real sizes, read from the file's header
(ember.train.gguf_blocks); their dequantization is torch's own ops, traced as they run.

What it leaves out, said where it matters: bitsandbytes' 8-bit optimizer has no fake kernels, so
the step runs torch's AdamW and its two fp32 moments are replaced by the 8-bit state's bytes
(ember.plan.memory.moment_bytes) afterwards; the update's own temporaries are torch's. The rows
are traced as calibration measures them and "mixed" packing trains them, one sequence each:
transformers, which cannot read a fake tensor's position ids, is told so, and takes the real
step's attention path (SDPA with is_causal, no mask). Packing "documents" or "padded" passes
restarting positions, and its real step builds the mask: the trace leaves that mask out.

A trace depends only on the model's config, the recipe's settings that shape the step, and the
library versions: it is kept in $EMBER_HOME/cache/traced/ by their digest, so a plan of a
model seen before imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from ember.durable import write_durable
from ember.models import config_fields
from ember.paths import home
from ember.plan.planner import Traced
from ember.recipe import Recipe

SHAPING = ("method", "precision")  # recipe sections that shape the step's memory, whole


def traced_step(r: Recipe) -> Traced:
    """The recipe's step traced on fake tensors (cached by what shapes it)."""
    path = home().traced_cache(_key(r))
    try:
        return Traced(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    from ember.doctor.fake_step import trace
    traced = trace(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_durable(path, json.dumps(dataclasses.asdict(traced)))
    return traced


def _key(r: Recipe) -> str:
    from importlib import metadata
    fields = {k: v for k, v in vars(config_fields(r.model.path)).items() if not k.startswith("_")}
    shaping = {name: dataclasses.asdict(getattr(r, name)) for name in SHAPING}
    shaping["step"] = [r.train.micro_batch, r.data.seq_len, min(r.train.grad_accum, 2), r.train.loss_chunk,
                       r.train.activation_checkpointing, r.optimizer.state_dtype]
    versions = [metadata.version(d) for d in ("torch", "transformers", "peft")]
    source = b"".join(Path(__file__).with_name(f).read_bytes() for f in ("traced.py", "fake_step.py"))
    if r.method.quantize == "gguf":  # the file's own blocks: its types are in its bytes, not its config
        from ember.models import resolve_path
        from ember.paths import cached_sha256
        from ember.train import gguf_blocks
        gguf = resolve_path(r.model.path)
        if gguf.suffix == ".gguf":  # another model is refused by the trace, saying why
            fields["gguf_sha256"] = cached_sha256(gguf)
        source += Path(gguf_blocks.__file__).read_bytes()
    blob = json.dumps([fields, shaping, versions], sort_keys=True, default=str).encode() + source
    return hashlib.sha256(blob).hexdigest()[:32]
