"""Memory plan vs measured peak over a table of configurations (Llama-style models, 4K-60M
parameters; one KV head and GQA 8:1; hidden sizes down to 16, where fixed costs weigh most;
seq_len; micro batch; full vs LoRA; activation checkpointing on every model shape; fp32 vs
bf16; the chunked loss). The "states" column is what model-state estimators count (weights +
gradients + optimizer state, no activations or loss buffers), for contrast. Each configuration
is measured in a fresh process: two steps of the training loop's own step (forward with labels,
backward, clip, AdamW, zero_grad), peak taken on the second (ember/doctor/measure.py). Prints
estimate, measured and error per row; the goal is within +-10% everywhere and never under by
more than 5%.

usage: python bench/plan_accuracy.py [--only N [N ...]] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = {  # name: hidden, intermediate, layers, heads, kv heads, vocab, tied
    "tiny-0.1M": (64, 176, 2, 4, 2, 257, False),
    "llama-7M": (256, 688, 4, 8, 4, 8000, False),
    "llama-25M": (512, 1376, 6, 8, 4, 16000, False),
    "smol-42M": (576, 1536, 4, 9, 3, 49152, True),
    "mqa-3M": (256, 688, 2, 8, 1, 4000, False),  # one KV head for 8 query heads
    "gqa8-10M": (512, 1408, 2, 16, 2, 4000, False),  # GQA 8:1
    "micro-29K": (32, 96, 2, 2, 1, 64, False),  # hidden 32: fixed costs weigh most
    "nano-4K": (16, 48, 1, 2, 1, 32, True),  # hidden 16, one layer, tied
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
    ("llama-25M", 2, 512, "lora", True, "bf16", 0),  # bf16 is slow on CPUs without AVX-512: b=2
    ("llama-25M", 2, 256, "lora", False, "bf16", 0),
    ("smol-42M", 2, 256, "lora", False, "fp32", 0),
    ("smol-42M", 4, 128, "full", False, "fp32", 0),
    ("smol-42M", 4, 256, "lora", True, "fp32", 0),
    ("smol-42M", 4, 256, "lora", False, "fp32", 256),
    ("llama-25M", 8, 256, "full", False, "fp32", 512),
    # Activation checkpointing on every model shape, few KV heads, tiny hidden sizes.
    ("tiny-0.1M", 8, 64, "full", True, "fp32", 0),  # examples/tiny.toml with checkpointing
    ("tiny-0.1M", 4, 128, "lora", True, "fp32", 0),
    ("llama-25M", 2, 256, "full", True, "fp32", 0),
    ("smol-42M", 4, 128, "full", True, "fp32", 0),
    ("mqa-3M", 4, 256, "full", False, "fp32", 0),
    ("mqa-3M", 4, 256, "full", True, "fp32", 0),
    ("mqa-3M", 4, 256, "lora", True, "bf16", 0),
    ("gqa8-10M", 2, 256, "full", False, "fp32", 0),
    ("gqa8-10M", 2, 256, "full", True, "bf16", 0),
    ("gqa8-10M", 4, 256, "lora", True, "fp32", 0),
    ("micro-29K", 8, 128, "full", False, "fp32", 0),
    ("micro-29K", 8, 128, "full", True, "fp32", 0),
    ("micro-29K", 8, 128, "full", True, "bf16", 0),
    ("micro-29K", 1, 16, "full", True, "fp32", 0),
    ("nano-4K", 4, 64, "full", False, "fp32", 0),
    ("nano-4K", 4, 64, "full", True, "fp32", 0),
    ("nano-4K", 2, 32, "lora", True, "fp32", 0),
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

    from ember.doctor.measure import measured_step, step_peak
    from ember.recipe import MethodConfig
    from ember.train.model import apply_lora

    name, b, s, method, ac, precision, chunk = row
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(config(name))
    if ac:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if method == "lora":
        model = apply_lora(model, MethodConfig(kind="lora"))
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (b, s))
    device = torch.device("cpu")
    step = measured_step(model, ids, device, precision, chunk)
    step()
    return step_peak(step, device)


def measure_apart(row: tuple) -> tuple[int, float]:
    """`measure(row)` in a fresh process (one thread): the peak and the seconds it took."""
    t0 = time.time()
    out = subprocess.run([sys.executable, __file__, "--measure", json.dumps(row)], capture_output=True,
                         text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return int(out.stdout.split()[-1]), time.time() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", type=int, nargs="+", help="row numbers (from 0) to run")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="configurations measured at once (each on one thread; default: one per core)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(measure(json.loads(args.measure)))
        return
    from ember.plan.memory import LINEARS, MiB, ModelShape, TrainShape, estimate

    print(f"{'#':>2} {'model':10} {'b':>2} {'seq':>4} {'method':6} {'ckpt':4} {'prec':4} {'chunk':>5} "
          f"{'estimate':>10} {'measured':>10} {'error':>7} {'states':>7} {'secs':>5}  peak phase")
    errors, states_errors = [], []
    t0 = time.time()
    rows = [(i, row) for i, row in enumerate(CONFIGS) if not args.only or i in args.only]
    with ThreadPoolExecutor(args.jobs) as pool:  # a peak is the process's own: measuring two at once is fair
        results = pool.map(measure_apart, [row for _, row in rows])
        for (i, row), (measured, secs) in zip(rows, results):
            name, b, s, method, ac, precision, chunk = row
            shape = TrainShape(b, s, lora=method == "lora", lora_targets=frozenset(LINEARS),
                               activation_checkpointing=ac, autocast=precision != "fp32", loss_chunk=chunk)
            est = estimate(ModelShape.from_config(config(name)), shape)
            err = est.peak / measured - 1
            errors.append(err)
            # What model-state estimators count: weights + gradients + optimizer state, no activations.
            states = (est.weights + est.trainable * 4 + est.optimizer) / measured - 1
            states_errors.append(states)
            print(f"{i:>2} {name:10} {b:>2} {s:>4} {method:6} {'on' if ac else 'off':4} {precision:4} {chunk:>5} "
                  f"{est.peak / MiB:9.2f}M {measured / MiB:9.2f}M {err:+7.1%} {states:+7.1%} {secs:5.0f}  "
                  f"{est.phase}", flush=True)
    print(f"\n{len(errors)} configurations in {time.time() - t0:.0f} s ({args.jobs} at once): mean |error| "
          f"{sum(map(abs, errors)) / len(errors):.1%}, worst over {max(errors):+.1%}, worst under "
          f"{min(errors):+.1%} (goal: within +-10%, never under by more than 5%); model states only "
          f"(weights + gradients + optimizer): mean |error| {sum(map(abs, states_errors)) / len(states_errors):.1%}, "
          f"worst {min(states_errors):+.1%}")


if __name__ == "__main__":
    main()
