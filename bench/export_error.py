"""How far each `ember export` format's logits are from the model ember trained, on the real
SmolLM2-135M: a LoRA run of examples/smollm2-lora.toml (2 steps by default), exported as hf and
gguf in f32 and f16, each loaded in its engine (transformers, llama.cpp) and run on the same
tokens as ember's own model (the base with the adapter unmerged, float32). The figure is the
README's: the largest absolute logit difference over every position and vocabulary entry; the
largest logit is printed beside it for scale. llama.cpp runs with its default f16 KV cache (as
llama-server does) and with an f32 one, which separates the export's error from the engine's.

usage: python bench/export_error.py [--run RUN] [--steps 2] [--data FILE.jsonl]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
F32 = 0  # GGML_TYPE_F32: llama.cpp's KV cache is f16 unless told
TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, "
        "and void; and darkness was upon the face of the deep.")


def train(out: Path, steps: int, data: Path) -> None:
    """A LoRA run of the example recipe, `steps` optimizer steps long."""
    cmd = [sys.executable, "-m", "ember", "run", str(ROOT / "examples" / "smollm2-lora.toml"), "--out", str(out),
           "--no-ledger", "--set", f"train.max_steps={steps}", "--set", f"data.files=['{data}']"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", type=Path, help="a completed LoRA run of SmolLM2 (default: train one)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--data", type=Path, default=ROOT / "examples" / "data" / "kjv.jsonl",
                        help="the recipe's data (examples/prepare_kjv.py writes it)")
    args = parser.parse_args()
    import numpy as np
    import torch
    from llama_cpp import Llama
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ember.events import Events
    from ember.infer.export import check_base_files, export_run, read_run

    hf_logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="ember-export-error-"))
    run = args.run or work / "run"
    if args.run is None:
        train(run, args.steps, args.data.resolve())
    trained = read_run(run)
    base_folder = check_base_files(trained, Events())
    tok = AutoTokenizer.from_pretrained(run / "final")
    ids = tok(TEXT)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    with torch.no_grad():
        untrained = base.eval()(torch.tensor([ids])).logits[0].float()
        want = PeftModel.from_pretrained(base, run / "final").eval()(torch.tensor([ids])).logits[0].float()
    print(f"run {run}: {len(ids)} tokens; largest |logit| of ember's model {want.abs().max().item():.2f}; "
          f"training moved the logits by up to {(want - untrained).abs().max().item():.2e}")
    for fmt in ("hf", "gguf"):
        for dtype in ("f32", "f16"):
            out = work / f"{fmt}-{dtype}" if fmt == "hf" else work / f"{dtype}.gguf"
            export_run(run, fmt, out, dtype)
            if fmt == "hf":
                with torch.no_grad():
                    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(
                        torch.tensor([ids])).logits[0].float()
                report(f"hf {dtype}", got, want)
                continue
            for cache, kv in (("f16", {}), ("f32", {"type_k": F32, "type_v": F32})):
                llama = Llama(str(out), logits_all=True, n_ctx=len(ids) + 8, n_threads=2, verbose=False, **kv)
                llama.eval(ids)
                report(f"gguf {dtype}, llama.cpp KV cache {cache}", torch.tensor(np.array(llama.scores[:len(ids)])), want)


def report(what: str, got, want) -> None:
    diff = (got - want).abs()
    print(f"{what}: largest |logit difference| {diff.max().item():.2e}, mean {diff.mean().item():.2e}, "
          f"top token agrees at {(got.argmax(-1) == want.argmax(-1)).float().mean().item():.0%} of positions")


if __name__ == "__main__":
    main()
