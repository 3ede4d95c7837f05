"""QLoRA's step time as `ember plan` prices it (LoRA's, plus each 4-bit call's fixed cost and its
bytes over the rate: ember.plan.planner.dequant_seconds, ember.metrics.peaks.memory_bandwidth)
against QLoRA's step measured, on this CPU, for a small Llama-shaped model (each arm the fastest
of --rounds calibrations, interleaved: the machine may be shared). The 4-bit part is predicted
from LoRA's measured step plus the priced calls, so the FLOPs' MFU guess is out of it.

usage: python bench/qlora_time.py [--threads N] [--steps N] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ember.doctor.measure import calibrate
    from ember.metrics.peaks import memory_bandwidth
    from ember.models import config_fields
    from ember.plan.dequant import dequantize_once
    from ember.plan.memory import ModelShape
    from ember.plan.planner import dequant_seconds
    from ember.plan.remedies import train_shape
    from ember.recipe import load_recipe
    from ember.data.tokenizer import ByteTokenizer
    from tests.helpers import write_recipe
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder)
        ByteTokenizer().save(folder)
        path = write_recipe(Path(tmp), model={"path": str(folder)}, method={"kind": "lora", "target_modules": ["all-linear"]},
                            data={"seq_len": 128}, train={"micro_batch": 4, "threads": args.threads})
        m = ModelShape.from_config(config_fields(str(folder)))
        rate = memory_bandwidth(0.0, "cpu", "cpu", args.threads, dequantize_once)
        print(f"model: {m.params() / 1e6:.1f} M parameters; micro batch 4 x 128; {args.threads} threads")
        print(f"rate: {rate.bytes_per_s / 1e9:.3g} GB/s ({rate.source})")
        print("| activation checkpointing | LoRA measured | QLoRA measured | dequantization priced | "
              "QLoRA predicted | predicted / measured - 1 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for ac in (False, True):
            sets = [f"train.activation_checkpointing={str(ac).lower()}"]
            q = load_recipe(path, [*sets, "method.quantize=nf4"])
            times: dict[str, list[float]] = {"lora": [], "qlora": []}
            for _ in range(args.rounds):  # interleaved, the fastest of each: load from elsewhere only slows
                times["lora"].append(calibrate(load_recipe(path, sets), steps=args.steps).step_seconds)
                times["qlora"].append(calibrate(q, steps=args.steps).step_seconds)
            lora, qlora = min(times["lora"]), min(times["qlora"])
            priced = dequant_seconds(m, train_shape(q), 1, rate)  # one micro-batch, as calibrated
            print(f"| {'on' if ac else 'off'} | {lora:.4f} s | {qlora:.4f} s | {priced:.4f} s | {lora + priced:.4f} s | "
                  f"{100 * ((lora + priced) / qlora - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
