"""Two helpers of bench/gpu.py, each run as a child process of it.

    python bench/gpu_probe.py model DIR SHAPE     write a random-init model folder (no hub)
    python bench/gpu_probe.py run FILE ARGS...    `ember ARGS` in this process, recording CUDA's
                                                  allocator peaks into FILE as the process ends

`run` calls the very function the `ember` console script calls (ember.cli.main:main), so the
command is ember's real `ember run`; it only adds a reading of torch.cuda.max_memory_allocated
and max_memory_reserved at exit. ember leaves through os._exit once everything is durable (no
interpreter teardown, no atexit), so the reading is taken there too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Qwen2.5-0.5B's shape (494M parameters, tied embeddings, GQA 14:2, q/k/v bias), and the same
# family at a size a CPU trains in milliseconds, for --cpu-smoke.
SHAPES = {
    "qwen2.5-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "qwen2-tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                   "tie_word_embeddings": True},
}


def write_model(folder: Path, shape: str) -> None:
    """A Hugging Face folder: config.json, random weights (seeded, bf16 on disk: ember loads them
    as fp32) and ember's byte-level tokenizer (token ids 0-256; the model keeps its own vocabulary,
    so the output layer costs what it costs the real model)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ember.data.tokenizer import ByteTokenizer
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], bos_token_id=None, eos_token_id=256, pad_token_id=None,
                         use_cache=False)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialising 494M: seconds on a GPU
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    ByteTokenizer().save(tmp)
    tmp.rename(folder)
    print(sum(p.numel() for p in model.parameters()))


def run_recording(record: Path, argv: list[str]) -> None:
    """`ember ARGS`, writing the CUDA caching allocator's peaks to `record` as the process ends."""
    real_exit = os._exit

    def write() -> None:
        torch = sys.modules.get("torch")
        peaks = {"cuda": False}
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            peaks = {"cuda": True, "device": torch.cuda.get_device_name(),
                     "max_allocated": torch.cuda.max_memory_allocated(),
                     "max_reserved": torch.cuda.max_memory_reserved()}
        record.write_text(json.dumps(peaks))

    def leave(code: int) -> None:
        write()
        real_exit(code)

    os._exit = leave  # ember's fast_exit leaves through it
    from ember.cli.main import main
    code = main(argv)
    write()
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "model":
        write_model(Path(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "run":
        run_recording(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(f"usage: {sys.argv[0]} model DIR SHAPE | run FILE EMBER-ARGS...")
