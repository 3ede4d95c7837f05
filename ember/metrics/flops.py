"""Model FLOPs per token and MFU, as pure functions of the architecture.

Full fine-tuning: 6N + 12·L·H·Q·T per token (Kaplan et al. / PaLM appendix B): 2N forward, 4N
backward (input and weight gradients), and the attention score and value products, which hold
no weights, 4·L·H·Q·T forward and twice that backward. N counts the weights used in matmuls:
every parameter except the input embedding table (a lookup, no FLOPs); a tied output head
counts once.

LoRA: frozen weights still need input gradients but no weight gradients, so they cost 2N
forward + 2N backward; the adapters cost the full 6 per parameter: 4·N_frozen + 6·N_lora +
12·L·H·Q·T. Activation checkpointing's recomputation is not counted (model FLOPs, not hardware
FLOPs), so MFU stays comparable across remedies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    matmul_params: int       # N: parameters used in matmuls (all but the input embedding)
    trainable_params: int    # parameters updated (all of N for full fine-tuning; adapters for LoRA)
    layers: int              # L
    heads: int               # H (query heads)
    head_dim: int            # Q
    seq_len: int             # T
    lora: bool


@dataclass(frozen=True)
class FlopsPerToken:
    total: float
    formula: str


def flops_per_token(a: Architecture) -> FlopsPerToken:
    attention = 12 * a.layers * a.heads * a.head_dim * a.seq_len
    if a.lora:
        frozen = a.matmul_params - a.trainable_params
        return FlopsPerToken(4 * frozen + 6 * a.trainable_params + attention,
                             "4*N_frozen + 6*N_lora + 12*L*H*Q*T")
    return FlopsPerToken(6 * a.matmul_params + attention, "6*N + 12*L*H*Q*T")


def mfu(tokens_per_second_per_device: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Achieved model FLOP/s over peak FLOP/s, a share in [0, 1]; None when the peak is unknown
    (a guessed peak is how a tool reports 563% MFU) or below what was achieved (then the peak is
    wrong, and the share is no figure: share_of_peak() gives it, to flag)."""
    share = share_of_peak(tokens_per_second_per_device, flops_per_token, peak_flops)
    return share if share is not None and share <= 1.0 else None


def share_of_peak(tokens_per_second_per_device: float, flops_per_token: float,
                  peak_flops: float | None) -> float | None:
    """Achieved model FLOP/s over peak FLOP/s as computed, above 1 included; None for no peak."""
    if not peak_flops or peak_flops <= 0:
        return None
    return tokens_per_second_per_device * flops_per_token / peak_flops


def architecture_of(model, seq_len: int) -> Architecture:
    """Read the architecture off a transformers (or peft-wrapped) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    embedding = base.get_input_embeddings().weight
    params = {id(p): p for p in model.parameters()}  # tied weights once
    matmul = sum(p.numel() for p in params.values() if p is not embedding)
    if getattr(cfg, "tie_word_embeddings", False):
        matmul += embedding.numel()  # the output head multiplies by the tied table
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return Architecture(matmul_params=matmul, trainable_params=trainable,
                        layers=cfg.num_hidden_layers, heads=heads, head_dim=head_dim,
                        seq_len=seq_len, lora=hasattr(model, "get_base_model"))
