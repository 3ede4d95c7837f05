"""What each weight format torch offers here does to the built-in engine's decode step, against
llama.cpp on the same GGUF, in one run.

Issue 29, item 1 asks for the engine within 1.5x of llama.cpp. A decode step of one request is a
matrix-vector product per weight matrix, bound by reading the weights: the engine holds them in
float32 (4 bytes a weight), llama.cpp reads the Q4_1 file's blocks (0.75 bytes a weight). This
bench asks whether any format torch ships with a CPU kernel closes that gap on this machine.

Every arm is ember's own engine (ember.infer.engine.Engine: its batcher thread, its decode loop
over the KV cache) on the same GGUF, one thread (as `ember serve` takes on 2 cores: half), with
its linear layers (every decoder layer's and the output head) swapped for one weight format:

    fp32        as the engine ships (the GGUF dequantized once to float32)
    bf16, fp16  the whole model cast (activations in the same type)
    int8-woq    int8 weights per output channel, bf16 activations, torch's
                `aten._weight_int8pack_mm` (the kernel torchao's int8 weight-only mode calls)
    int4-woq    4-bit weights in groups of 32 (Q4_1's block size), bf16 activations, torch's
                `aten._weight_int4pack_mm_for_cpu`
    int8-dyn    int8 weights per output channel and int8 activations quantized per call,
                FBGEMM's kernel (`torch.ao.quantization.quantize_dynamic`)
    no-weights  every linear layer replaced by one that returns a constant of its output's shape
                (the output head's favours one token that is not end-of-text): what a step costs
                besides its weight products, the floor no kernel for them can go below
    llama.cpp   llama-cpp-python (`llama_cpp.Llama`, n_threads 1) on the GGUF file as it is

Per round and arm (rounds alternate the arms' order): one greedy 64-token answer of the same
prompt, streamed; `decode` is the p50 of the gaps between tokens after the first, `first` the
time to the first token (prefill). `same as fp32` counts the leading greedy tokens equal to the
fp32 arm's (the formats move the weights, so greedy text drifts). Figures are printed, never
asserted.

usage: python bench/decode_kernels.py [--rounds 3] [--tokens 64] [--arms fp32 bf16 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from ember.infer.engine import Engine, Sampling  # noqa: E402
from ember.models import resolve_path  # noqa: E402
from tests.engines import SMOLLM2_GGUF  # noqa: E402

ARMS = ["fp32", "bf16", "fp16", "int8-woq", "int4-woq", "int8-dyn", "no-weights", "llama.cpp"]
PROMPT = ("In the beginning God created the heaven and the earth. And the earth was without form, "
          "and void; and darkness was upon the face of the deep.")
GROUP = 32


class Int8WeightOnly(torch.nn.Module):
    """A linear layer's weight as int8 per output channel; x in bfloat16 through torch's kernel."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.to(torch.bfloat16).reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


class Int4WeightOnly(torch.nn.Module):
    """A linear layer's weight as 4-bit codes in groups of 32 with a scale and an offset each (the
    shape of Q4_1's blocks); x in bfloat16 through torch's CPU kernel."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        g = w.reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        # the kernel's value is (code - 8) * scale + zero, so zero = lo + 8 * scale
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(n, k), 2)
        self.scales_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.to(torch.bfloat16).reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


class NoWeights(torch.nn.Module):
    """A linear layer's output shape at no cost of reading weights: ones, or for the output head a
    fixed token's logit raised, so greedy decoding runs its full length."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.out = torch.ones(linear.out_features)
        if linear.out_features > 10_000:  # the output head: any token but end-of-text
            self.out = torch.zeros(linear.out_features)
            self.out[1000] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out.to(x.dtype).expand(*x.shape[:-1], -1)


def swap_linears(model: torch.nn.Module, make) -> None:
    """Replace every nn.Linear in `model` with make(linear)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, make(child))


def engine_for(arm: str) -> Engine:
    """The engine on the GGUF, loaded, its weights in `arm`'s format."""
    engine = Engine(SMOLLM2_GGUF, seed=0)
    engine.load()
    model = engine.model
    with torch.no_grad():
        if arm == "bf16":
            model.to(torch.bfloat16)
        elif arm == "fp16":
            model.to(torch.float16)
        elif arm == "int8-woq":
            swap_linears(model, Int8WeightOnly)
        elif arm == "int4-woq":
            swap_linears(model, Int4WeightOnly)
        elif arm == "no-weights":
            swap_linears(model, NoWeights)
        elif arm == "int8-dyn":
            import torch.ao.quantization as tq
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its notice that the eager API moves to torchao
                tq.quantize_dynamic(model, {torch.nn.Linear: tq.per_channel_dynamic_qconfig},
                                    dtype=torch.qint8, inplace=True)
    return engine


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the linear layers' weights: what one decode step of one request reads."""
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.nbytes
        elif isinstance(m, Int8WeightOnly):
            total += m.q.nbytes + m.scale.nbytes
        elif isinstance(m, NoWeights):
            total += 0
        elif isinstance(m, Int4WeightOnly):
            total += m.packed.nbytes + m.scales_zeros.nbytes
        elif type(m).__name__ == "Linear" and hasattr(m, "_packed_params"):  # torch.ao's dynamic one
            w = m.weight()
            total += w.int_repr().nbytes + w.q_per_channel_scales().numel() * 4
    return total


def timed(stream) -> tuple[list[float], list]:
    """Seconds from the start to each piece of `stream`, and the pieces."""
    t0 = time.perf_counter()
    stamps, pieces = [], []
    for piece in stream:
        stamps.append(time.perf_counter() - t0)
        pieces.append(piece)
    return stamps, pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 2:
        raise SystemExit("--rounds must be at least 1 and --tokens at least 2 (a decode step is the gap between two)")
    torch.set_num_threads(1)
    engines: dict[str, object] = {}
    for arm in args.arms:
        if arm == "llama.cpp":
            from llama_cpp import Llama
            engines[arm] = Llama(model_path=str(resolve_path(SMOLLM2_GGUF)), n_threads=1, n_ctx=512,
                                 verbose=False)
        else:
            engines[arm] = engine_for(arm)
    decode: dict[str, list[float]] = {a: [] for a in args.arms}
    first: dict[str, list[float]] = {a: [] for a in args.arms}
    text: dict[str, str] = {}
    size = {a: os.path.getsize(resolve_path(SMOLLM2_GGUF)) if a == "llama.cpp" else weight_bytes(e.model)
            for a, e in engines.items()}
    for r in range(args.rounds):
        order = args.arms[r % len(args.arms):] + args.arms[:r % len(args.arms)]
        for arm in order:
            e = engines[arm]
            if arm == "llama.cpp":
                e.reset()
                stream = e.create_completion(PROMPT, max_tokens=args.tokens, temperature=0.0, stream=True)
                stamps, pieces = timed(t for c in stream if (t := c["choices"][0]["text"]) != "")
                text[arm] = "".join(pieces)
                assert len(stamps) == args.tokens, f"llama.cpp gave {len(stamps)} tokens, not {args.tokens}"
            else:
                gen = e.generate("base", PROMPT, Sampling(max_tokens=args.tokens, temperature=0.0))
                stamps, pieces = timed(p for p in gen if p != "")
                text[arm] = "".join(pieces)
                assert gen.usage.completion_tokens == args.tokens, \
                    f"{arm}: {gen.usage.completion_tokens} tokens, not {args.tokens}"
            first[arm].append(stamps[0])
            decode[arm].append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
    ref = "llama.cpp" if "llama.cpp" in args.arms else None
    base = text.get("fp32")
    print(f"\n{args.rounds} rounds, {args.tokens} greedy tokens, 1 thread, torch {torch.__version__}\n")
    print(f"| arm | weights read a token | decode a token (p50 of rounds) | read at | first token | "
          f"{args.tokens} tokens | vs llama.cpp | same text as fp32 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for arm in args.arms:
        d, f = statistics.median(decode[arm]), statistics.median(first[arm])
        total = f + d * (args.tokens - 1)
        ratio = "-"
        if ref:
            rd, rf = statistics.median(decode[ref]), statistics.median(first[ref])
            ratio = f"{total / (rf + rd * (args.tokens - 1)):.2f}x"
        same = "-" if base is None else f"{common_prefix(text[arm], base)} of {len(base)} chars"
        print(f"| {arm} | {size[arm] / 1e6:.0f} MB{' (file)' if arm == 'llama.cpp' else ''} | {d * 1e3:.1f} ms | "
              f"{size[arm] / d / 1e9 if size[arm] else 0:.1f} GB/s | {f * 1e3:.0f} ms | {total:.2f} s | {ratio} | {same} |")


def common_prefix(a: str, b: str) -> int:
    """How many leading characters a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
