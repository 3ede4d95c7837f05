"""QLoRA's planned peak (ember.plan.memory.estimate) against the peak measured on a real step, on
tiny Llama shapes, one thread (oneDNN's bf16 matmul takes scratch space that grows with threads,
which the plan does not model). The last six rows are wide linears over few tokens, where a 4-bit
linear's dequantized weight is at the peak.

usage: nice -n 19 python bench/qlora_memory.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [  # hidden, mlp, layers, heads, kv heads, vocab, micro batch, seq, checkpointing, precision
    (128, 352, 2, 4, 2, 2000, 2, 128, False, "fp32"), (128, 352, 2, 4, 2, 2000, 2, 64, False, "bf16"),
    (64, 176, 2, 4, 2, 257, 4, 64, False, "fp32"), (64, 176, 2, 4, 2, 257, 8, 64, True, "fp32"),
    (128, 352, 2, 4, 2, 2000, 2, 128, True, "bf16"),
    (256, 704, 2, 4, 2, 1000, 1, 32, True, "fp32"), (256, 704, 2, 4, 2, 1000, 1, 32, False, "fp32"),
    (256, 704, 2, 4, 2, 1000, 1, 32, True, "bf16"), (512, 1408, 2, 8, 4, 500, 1, 16, True, "fp32"),
    (512, 1408, 2, 8, 4, 500, 1, 16, False, "bf16"), (384, 1024, 3, 6, 2, 300, 1, 8, False, "fp32"),
]


def main() -> None:
    import torch

    from tests.plan.test_memory import estimated_and_measured
    torch.set_num_threads(1)
    print("| hidden x mlp x layers | tokens | checkpointing | precision | planned | measured | error |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: |")
    for h, f, layers, heads, kv, vocab, b, s, ac, precision in SHAPES:
        est, measured = estimated_and_measured((h, f, layers, heads, kv, vocab, b, s, "qlora", ac, precision, 0))
        print(f"| {h} x {f} x {layers} | {b} x {s} | {'on' if ac else 'off'} | {precision} | {est / 2**20:.3f} MiB | "
              f"{measured / 2**20:.3f} MiB | {est / measured - 1:+.2%} |", flush=True)


if __name__ == "__main__":
    main()
