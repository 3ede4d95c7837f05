"""Memory plan vs measured peak over a table of configurations (Llama-style models, 0.1M-60M
parameters; seq_len; micro batch; full vs LoRA; activation checkpointing; fp32 vs bf16; the
chunked loss). The "states" column is what model-state estimators count (weights + gradients +
optimizer state, no activations or loss buffers), for contrast. Each configuration is measured in a fresh process: two steps of the same step
ember runs (forward with labels, backward, clip, AdamW, zero_grad), peak taken on the second
(ember/plan/measure.py). Prints estimate, measured and error per row; the goal is within +-10%
everywhere and never under by more than 5%.

usage: python bench/plan_accuracy.py [--only N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = {  # name: hidden, intermediate, layers, heads, kv heads, vocab, tied
    "tiny-0.1M": (64, 176, 2, 4, 2, 257, False),
    "llama-7M": (256, 688, 4, 8, 4, 8000, False),
    "llama-25M": (512, 1376, 6, 8, 4, 16000, False),
    "smol-42M": (576, 1536, 4, 9, 3, 49152, True),
}
# model, micro batch, seq_len, method, activation checkpointing, precision, loss chunk
CONFIGS = [
    ("tiny-0.1M", 4, 128, "full", False, "fp32", 0),
    ("tiny-0.1M", 8, 512, "full", False, "fp32", 0),
    ("llama-7M", 4, 256, "full", False, "fp32", 0),
    ("llama-7M", 4, 256, "lora", False, "fp32", 0),
    ("llama-7M", 4, 256, "full", True, "fp32", 0),
    ("llama-7M", 4, 256, "full", False, "bf16", 0),
    ("llama-7M", 1, 64, "full", False, "fp32", 0),
    ("llama-25M", 2, 256, "full", False, "fp32", 0),
    ("llama-25M", 8, 256, "lora", False, "fp32", 0),
    ("llama-25M", 4, 512, "lora", True, "bf16", 0),
    ("llama-25M", 4, 256, "lora", False, "bf16", 0),
    ("smol-42M", 2, 256, "lora", False, "fp32", 0),
    ("smol-42M", 4, 128, "full", False, "fp32", 0),
    ("smol-42M", 4, 256, "lora", True, "fp32", 0),
    ("smol-42M", 4, 256, "lora", False, "fp32", 256),
    ("llama-25M", 8, 256, "full", False, "fp32", 512),
]


def config(name: str):
    from transformers import LlamaConfig
    h, f, layers, heads, kv, vocab, tied = MODELS[name]
    return LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                       tie_word_embeddings=tied, use_cache=False)


def measure(row: list) -> int:
    """Run in a fresh process: build, two steps, peak of the second."""
    import torch
    from transformers import LlamaForCausalLM

    from ember.plan.measure import step_peak, training_step
    from ember.recipe import MethodConfig
    from ember.train.model import apply_lora, trainable_parameters

    name, b, s, method, ac, precision, chunk = row
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(config(name))
    if ac:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if method == "lora":
        model = apply_lora(model, MethodConfig(kind="lora"))
    model.train()
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (b, s))
    device = torch.device("cpu")
    step = training_step(model, opt, ids, device, precision, chunk)
    step()
    return step_peak(step, device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", type=int)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(measure(json.loads(args.measure)))
        return
    from ember.plan.memory import LINEARS, MiB, ModelShape, TrainShape, estimate

    print(f"{'model':10} {'b':>2} {'seq':>4} {'method':6} {'ckpt':4} {'prec':4} {'chunk':>5} "
          f"{'estimate':>9} {'measured':>9} {'error':>7} {'states':>7}  peak phase")
    errors, states_errors = [], []
    t0 = time.time()
    for i, row in enumerate(CONFIGS):
        if args.only is not None and i != args.only:
            continue
        name, b, s, method, ac, precision, chunk = row
        shape = TrainShape(b, s, lora=method == "lora", lora_targets=frozenset(LINEARS),
                           activation_checkpointing=ac, autocast=precision != "fp32", loss_chunk=chunk)
        est = estimate(ModelShape.from_config(config(name)), shape)
        out = subprocess.run([sys.executable, __file__, "--measure", json.dumps(row)], capture_output=True,
                             text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        measured = int(out.stdout.split()[-1])
        err = est.peak / measured - 1
        errors.append(err)
        # What model-state estimators count: weights + gradients + optimizer state, no activations.
        states = (est.weights + est.trainable * 4 + est.optimizer) / measured - 1
        states_errors.append(states)
        print(f"{name:10} {b:>2} {s:>4} {method:6} {'on' if ac else 'off':4} {precision:4} {chunk:>5} "
              f"{est.peak / MiB:8.1f}M {measured / MiB:8.1f}M {err:+7.1%} {states:+7.1%}  {est.phase}", flush=True)
    print(f"\n{len(errors)} configurations in {time.time() - t0:.0f} s: mean |error| "
          f"{sum(map(abs, errors)) / len(errors):.1%}, worst over {max(errors):+.1%}, worst under "
          f"{min(errors):+.1%} (goal: within +-10%, never under by more than 5%); model states only "
          f"(weights + gradients + optimizer): mean |error| {sum(map(abs, states_errors)) / len(states_errors):.1%}, "
          f"worst {min(states_errors):+.1%}")


if __name__ == "__main__":
    main()
