"""Peak memory of a training step, from the architecture: pure arithmetic, no allocation.

The peak of a step is not "weights + gradients + optimizer + activations" at once. Gradients
(set to None after every step) do not exist during the forward pass; the peak is one of:

    loss backward   weights + optimizer state + every saved activation + the loss's
                    batch x seq x vocab fp32 buffers (log-softmax output and two gradients)
    layer backward  weights + optimizer state + the gradients made so far + the activations
                    still saved (with activation checkpointing: the layers' inputs and one
                    layer's, remade) + that layer's MLP gradients, while its product is
                    differentiated (the first or the last layer to run backward: the sum is
                    linear in the layer's position, so one of the two ends is highest)
    backward end    weights + optimizer state + all gradients (activations are freed by now)
    optimizer step  weights + gradients + optimizer state + the update's temporaries
    4-bit dequantize  (QLoRA, [method] quantize = 'nf4') the largest linear's weight dequantized
                    to fp32 for its matmul, in the last layer's forward or in a layer's
                    down_proj backward (measured -0.6%..+0.4% on 11 tiny shapes, one thread:
                    tests/plan/test_memory.py)

Accumulating (grad_accum > 1), the second and later micro-batches run beside every gradient of
the ones before (each added to in place): the loss's backward and a layer's carry all of them,
not none or those made so far (a recipe of full fine-tuning peaks 5-6% higher than one
micro-batch's step on the tiny shapes of tests/plan/test_memory.py).

Saved activations are counted tensor by tensor for the Llama family (Llama, Mistral, Qwen2/3,
SmolLM), as PyTorch autograd keeps them on the SDPA path: every figure below was checked
against the tensors autograd actually saves (see tests/plan/test_memory.py for two cases by
hand, bench/plan_accuracy.py for the measured table).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ember.errors import EmberError
from ember.recipe import INT8_STATE_MIN_ELEMENTS

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}
# what the estimate reads of a Llama-family config; num_key_value_heads and head_dim have defaults
LLAMA_SHAPE = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
F32 = 4
MiB = 1 << 20
GiB = 1 << 30
INT8_BLOCK = 256  # bitsandbytes' blockwise 8-bit state: one fp32 scale per 256 elements
NF4_BLOCK = 64  # [method] quantize = 'nf4': an absmax per 64 weights (ember.train.quantize)
NF4_NESTED_BLOCK = 256  # double quantization: an fp32 scale per 256 absmaxes


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model's config."""
    family: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape of a Llama-family config (ValueError for another family; EmberError for sizes
        the family cannot have: the run would fail on them)."""
        kind = getattr(config, "model_type", "?")
        if kind not in LLAMA_FAMILY:
            raise ValueError(f"the memory estimate knows the Llama family ({', '.join(sorted(LLAMA_FAMILY))}), "
                             f"not model_type {kind!r}")
        spec = getattr(config, "_spec", None)  # ember.models.ConfigFields: config.json's fields as read
        where = f"[model] path = {spec!r}: its config.json" if spec else "the model's config"
        for key in LLAMA_SHAPE:  # none is optional here: transformers would fill in its own defaults
            value = getattr(config, key, None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                has = f"no {key}" if value is None else f"{key} = {value!r}"
                raise EmberError(f"{where} has {has}: a {kind} model's {key} is a positive whole number; "
                                 f"fix config.json, or download the model again")
        heads, hidden = config.num_attention_heads, config.hidden_size
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        if not isinstance(kv_heads, int) or heads % kv_heads:  # the run fails in repeat_kv, mid-step
            raise EmberError(f"{where} has num_attention_heads = {heads}, not a multiple of num_key_value_heads = "
                             f"{kv_heads!r}: each key-value head serves as many query heads; fix config.json")
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:  # transformers refuses it (RoPE)
            given = "" if getattr(config, "head_dim", None) else f" (hidden_size {hidden} / num_attention_heads {heads})"
            raise EmberError(f"{where} has head_dim = {head_dim!r}{given}: rotary position embeddings need an even "
                             f"head size of at least 2; fix config.json")
        return cls("llama", config.num_hidden_layers, hidden, config.intermediate_size,
                   heads, kv_heads, head_dim, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)),
                   bool(getattr(config, "attention_bias", False)) or kind == "qwen2")

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear in one decoder layer."""
        h, f, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    def layer_params(self) -> int:
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return sum(i * o for i, o in self.linear_shapes().values()) + bias + 2 * self.hidden

    def params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params() + self.hidden + embed * (1 if self.tied else 2)


@dataclass(frozen=True)
class TrainShape:
    """What the estimate needs from a recipe."""
    micro_batch: int
    seq_len: int
    lora: bool = False
    lora_rank: int = 8
    lora_targets: frozenset[str] = frozenset(LINEARS)
    lora_dropout: float = 0.0
    activation_checkpointing: bool = False
    autocast: bool = False  # bf16/fp16 autocast over fp32 weights
    loss_chunk: int = 0  # tokens per chunk of the memory-efficient loss (0 = the plain loss)
    optimizer: str = "adamw"  # or "adamw8bit": [optimizer] state_dtype = 'int8' (bitsandbytes)
    quantize: str = "none"  # or "nf4": [method] quantize, the decoder layers' linears in 4 bits (QLoRA)
    accumulating: bool = False  # grad_accum > 1: from the second micro-batch on, every gradient exists

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass
class Breakdown:
    """Bytes of one device at the step's peak, and the phase where it happens."""
    weights: int
    gradients: int
    optimizer: int
    activations: int
    loss_buffers: int
    temporaries: int
    peak: int
    phase: str
    phases: dict[str, int] = field(default_factory=dict)
    trainable: int = 0
    params: int = 0

    def with_margin(self, share: float) -> int:
        return int(self.peak * (1 + share))


def qlora(t: TrainShape, rank: int = 16) -> TrainShape:
    """`t` as QLoRA: LoRA adapters of `rank` on every decoder linear over a 4-bit NF4 base."""
    return replace(t, lora=True, lora_rank=rank, lora_targets=frozenset(LINEARS), quantize="nf4")


def nf4_bytes(n: int) -> int:
    """Bytes of one n-element weight in NF4 with double quantization, as bitsandbytes' Params4bit
    holds it: the codes two to a byte, an 8-bit absmax per block of 64, an fp32 scale per 256
    absmaxes, their fp32 offset, and the two fp32 code maps (16 and 256 entries)."""
    blocks = -(-n // NF4_BLOCK)
    return -(-n // 2) + blocks + F32 * (-(-blocks // NF4_NESTED_BLOCK) + 1 + 16 + 256)


def base_bytes(m: ModelShape, t: TrainShape) -> int:
    """Bytes of the model's own weights: fp32, or (quantize 'nf4') the decoder layers' linears in
    NF4 and the rest (embeddings, norms, output head, biases) in fp32."""
    if t.quantize != "nf4":
        return m.params() * F32
    linears = [i * o for i, o in m.linear_shapes().values()]
    return (m.params() - m.layers * sum(linears)) * F32 + m.layers * sum(nf4_bytes(n) for n in linears)


def trainable_params(m: ModelShape, t: TrainShape) -> int:
    if not t.lora:
        return m.params()
    return m.layers * sum(t.lora_rank * (i + o) for name, (i, o) in m.linear_shapes().items()
                          if name in t.lora_targets)


def layer_activations(m: ModelShape, t: TrainShape, first: bool = False) -> float:
    """Bytes per token one decoder layer leaves saved for backward."""
    h, f, n = m.hidden, m.intermediate, m.heads
    q, kv = n * m.head_dim, m.kv_heads * m.head_dim
    if t.activation_checkpointing:
        return h * F32  # the layer's input; the rest is recomputed during backward
    a = 2 if t.autocast else F32  # bytes of a linear's output under autocast
    full = not t.lora
    adapted = t.lora_targets if t.lora else frozenset()
    inputs = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": q, "gate_proj": h, "up_proj": h, "down_proj": f}
    norm_w = h * F32 if full else 0
    norm1 = 0 if (first and t.lora) else h * F32 + F32 + norm_w  # input, rsqrt, normalised
    norm2 = h * F32 + F32 + norm_w
    b = 0.0
    if t.autocast:
        # Every linear casts its input for itself; a trained weight keeps that cast for backward,
        # and so does each LoRA adapter (peft casts back to fp32 first, autocast copies again).
        for name, width in inputs.items():
            if name == "o_proj" and full:
                continue  # the attention output is already bf16: no copy
            if name == "down_proj" and full:
                b += width * a  # the bf16 product is kept as is
            elif full or name in adapted:
                b += width * a
    else:
        # One fp32 tensor feeds q/k/v (and one gate/up); it is kept once if any of them trains.
        if full or adapted & {"q_proj", "k_proj", "v_proj"}:
            b += h * F32
        if full or adapted & {"gate_proj", "up_proj"}:
            b += h * F32
        if full or "down_proj" in adapted:
            b += f * F32
    b += len(adapted) * t.lora_rank * a  # LoRA A outputs, kept for B
    if t.lora and t.lora_dropout > 0:
        # Each adapter's own dropped-out input copy and the dropout mask (one byte each).
        b += sum(w * (a + 1) for name, w in inputs.items() if name in adapted)
    b += (q + 2 * kv + q) * a + n * F32  # SDPA keeps q, k, v, output, log-sum-exp
    # Gate output (for SiLU), SiLU output and up output (for the product); a 4-bit linear
    # returns its input's dtype, so over fp32 norms these are fp32 under autocast too.
    b += 3 * f * mlp_bytes(t)
    return norm1 + norm2 + b


def mlp_bytes(t: TrainShape) -> int:
    """Bytes of an element of the gate and up outputs: half precision under autocast, except
    from a 4-bit linear, which casts its output back to its (fp32) input's dtype."""
    return 2 if t.autocast and t.quantize != "nf4" else F32


def weight_copies(m: ModelShape, t: TrainShape) -> int:
    """Autocast keeps a half-precision copy of every linear weight from forward to backward
    (under activation checkpointing only the output layer's: a layer's are remade when it is)."""
    if not t.autocast:
        return 0
    if t.activation_checkpointing:
        return 2 * m.vocab * m.hidden
    # A 4-bit linear casts inside its own matmul (autograd keeps the packed weight, not a copy).
    layers = 0 if t.quantize == "nf4" else m.layers * sum(i * o for i, o in m.linear_shapes().values())
    adapters = trainable_params(m, t) if t.lora else 0
    return 2 * (layers + m.vocab * m.hidden + adapters)


def dequantized(m: ModelShape, t: TrainShape) -> int:
    """Bytes a 4-bit linear's matmul allocates for its weight, in forward and in backward: the
    largest linear dequantized to fp32 (its absmaxes first, to fp32 with their offset added), and
    its half-precision cast under autocast."""
    if t.quantize != "nf4":
        return 0
    n = max(i * o for i, o in m.linear_shapes().values())
    return n * (F32 + (2 if t.autocast else 0)) + -(-n // NF4_BLOCK) * F32


def forward_dequantize(m: ModelShape, t: TrainShape, acts: int) -> int:
    """Bytes alive, the dequantized weight aside, while the last layer's down_proj (the last of the
    largest 4-bit linears) runs in forward, without activation checkpointing; `acts` is what
    the whole forward saves."""
    T, h, f, a, r = t.tokens, m.hidden, m.intermediate, 2 if t.autocast else F32, t.lora_rank
    down = "down_proj" in t.lora_targets
    # Not made yet: the output layer's half-precision weight, the final norm's saved input and
    # rsqrt, down_proj's adapter (its A output, and under autocast its weights' copies).
    later = (2 * m.vocab * h if t.autocast else 0) + T * (h * F32 + F32) + \
        (T * r * a + (2 * r * (f + h) if t.autocast else 0) if down else 0)
    # Alive but not saved for backward: the embeddings' output (the model's forward holds it to
    # the end), the MLP's input and product (saved in fp32 as the adapters' inputs; under
    # autocast their half-precision copies are saved instead).
    kept = T * h * F32
    if t.autocast or not t.lora_targets & {"gate_proj", "up_proj"}:
        kept += T * h * F32
    if t.autocast or not down:
        kept += T * f * mlp_bytes(t)
    return acts - later + kept


def fixed_activations(m: ModelShape, t: TrainShape) -> float:
    """Bytes per token outside the decoder layers, without the loss's own buffers."""
    h, full = m.hidden, not t.lora
    b = h * F32 + F32 + (h * F32 if full else 0)  # final norm
    if full:
        b += h * (2 if t.autocast else F32) + 8  # lm_head input; the embedding's token ids
    b += 8  # the loss's targets
    return b


def trainable_sizes(m: ModelShape, t: TrainShape) -> list[int]:
    """Elements of each trained tensor, in parameter order."""
    h, r = m.hidden, t.lora_rank
    if t.lora:
        layer = [n for name, (i, o) in m.linear_shapes().items() if name in t.lora_targets for n in (r * i, o * r)]
        return m.layers * layer
    bias = {"q_proj": m.heads * m.head_dim, "k_proj": m.kv_heads * m.head_dim, "v_proj": m.kv_heads * m.head_dim}
    layer = [n for name, (i, o) in m.linear_shapes().items()
             for n in ((i * o, bias[name]) if m.qkv_bias and name in bias else (i * o,))]
    return [m.vocab * h] + m.layers * (layer + [h, h]) + [h] + ([] if m.tied else [m.vocab * h])


def optimizer_bytes(m: ModelShape, t: TrainShape) -> int:
    """AdamW's two moments: fp32; or (adamw8bit, bitsandbytes) per tensor of at least
    INT8_STATE_MIN_ELEMENTS an 8-bit code per element, an fp32 scale per block of 256 and the
    256-entry fp32 code map, for each moment (smaller tensors: fp32), as the checkpoint stores them."""
    if t.optimizer != "adamw8bit":
        return 2 * trainable_params(m, t) * F32
    return sum(moment_bytes(n, t.optimizer) for n in trainable_sizes(m, t))


def moment_bytes(n: int, optimizer: str) -> int:
    """AdamW's two moments of one tensor of `n` elements (see optimizer_bytes)."""
    if optimizer == "adamw8bit" and n >= INT8_STATE_MIN_ELEMENTS:
        return 2 * (n + -(-n // INT8_BLOCK) * F32 + 256 * F32)
    return 2 * n * F32


def update_temporaries(m: ModelShape, t: TrainShape) -> int:
    """Bytes the AdamW update allocates at most while it updates (on CPU)."""
    sizes = trainable_sizes(m, t)
    if t.optimizer == "adamw8bit":
        # bitsandbytes' CPU update, tensor by tensor: both moments dequantized to fp32, the scaled
        # gradient, sqrt(v) and its quotient (fp32-state tensors: the gradient, sqrt(v), + eps and
        # the quotient); all freed before the next tensor.
        return F32 * max((5 if n >= INT8_STATE_MIN_ELEMENTS else 4) * n for n in sizes)
    # Single-tensor torch.optim.AdamW (the CPU default), per tensor in parameter order: sqrt(v)
    # and its quotient `denom`, while the previous tensor's `denom` is still alive (the loop
    # variable is rebound only once the new one exists). Equal neighbours (gate, up and down)
    # make that three of the largest.
    return F32 * max(prev + 2 * cur for prev, cur in zip([0, *sizes], sizes))


def layer_backward(m: ModelShape, t: TrainShape, i: int) -> tuple[int, int, int]:
    """(gradients, activations, temporaries) in bytes while decoder layer `i` differentiates its
    MLP product act(gate) * up, the fullest moment of that layer's backward."""
    T, h, f = t.tokens, m.hidden, m.intermediate
    a = 2 if t.autocast else F32
    plain = replace(t, activation_checkpointing=False)
    # down_proj's backward has run just before: its saved input is freed (and its weight copy).
    down_in = f * a if not t.lora or "down_proj" in t.lora_targets else 0
    if t.activation_checkpointing:
        # The inputs of layers 0..i-1, kept by their checkpoints, and layer i's own activations,
        # remade by its forward again (its input is the checkpoint's: counted with the layer).
        below, held = i * h * F32, 1
        own = layer_activations(m, plain)
    else:
        below = (layer_activations(m, t, first=True) + (i - 1) * layer_activations(m, t)) if i else 0
        held = i + 1
        own = layer_activations(m, t, first=i == 0)
    adapters = trainable_params(m, t) // m.layers if t.lora else 0  # one layer's
    copies = 0
    if t.autocast and t.quantize == "nf4":  # only the adapters' (see weight_copies)
        copies = 2 * held * adapters
    elif t.autocast:  # the half-precision weights of the layers still holding activations
        copies = 2 * (held * (sum(x * y for x, y in m.linear_shapes().values()) + adapters) - f * h)
    rope = 2 * t.seq_len * m.head_dim * F32
    acts = int((below + own - down_in + 8) * T) + rope + copies  # 8: the batch's token ids
    # The product's backward: autograd holds the gradient it receives (that of down_proj's input,
    # b x s x intermediate) until the node returns, while the node makes one gradient of that
    # size for act(gate) and one for up; the gate, SiLU and up outputs saved for it and for the
    # SiLU are still kept (in `own`). Beside them, the residual stream's gradient entering the
    # layer (fp32 under autocast too).
    temps = int((3 * f * mlp_bytes(t) + h * F32) * T)
    if t.lora:  # the adapters of the layers above, and of this layer's down_proj
        grads = (m.layers - 1 - i) * adapters + (t.lora_rank * (f + h) if "down_proj" in t.lora_targets else 0)
    else:  # all but this layer's and those below it (down_proj's is done); untied: no embedding's
        grads = m.params() - (i + 1) * m.layer_params() + f * h - (0 if m.tied else m.vocab * h)
    return grads * F32, acts, temps


def estimate(m: ModelShape, t: TrainShape) -> Breakdown:
    """The step's peak memory (from the second step on, once optimizer state exists)."""
    T, V = t.tokens, m.vocab
    params, trainable = m.params(), trainable_params(m, t)
    weights = base_bytes(m, t) + (trainable * F32 if t.lora else 0)
    grads = trainable * F32
    optim = optimizer_bytes(m, t)  # AdamW: exp_avg and exp_avg_sq
    update_tmp = update_temporaries(m, t)
    rope = 2 * t.seq_len * m.head_dim * F32
    layers = layer_activations(m, t, first=True) + (m.layers - 1) * layer_activations(m, t)
    acts = int((layers + fixed_activations(m, t)) * T) + rope + weight_copies(m, t)
    if t.loss_chunk:
        # One chunk's log-softmax and two gradients, beside the output layer's gradient (from the
        # first chunk on) and the hidden states' gradient being summed chunk by chunk.
        c = min(t.loss_chunk, T)
        saved_loss = 0
        loss_peak = 3 * c * V * F32 + (V * m.hidden * F32 if not t.lora else 0) + T * m.hidden * F32
    else:
        saved_loss, loss_peak = T * V * F32, 2 * T * V * F32  # log-softmax kept; two gradients
    # Accumulating, a later micro-batch runs forward and backward beside every gradient of the
    # ones before (added to in place); the first runs beside those its backward has made so far.
    before = grads if t.accumulating else 0
    backward = [layer_backward(m, t, i) for i in {0, m.layers - 1}]
    if t.accumulating:
        backward = [(grads, a, tmp) for _, a, tmp in backward]
    layer = max(backward, key=sum)
    parts = {  # phase: gradients, activations, loss buffers, temporaries
        "loss backward": (before, acts, saved_loss + loss_peak, 0),
        "layer backward": (layer[0], layer[1], 0, layer[2]),
        "backward end": (grads, 0, 0, 2 * T * m.hidden * F32),
        "optimizer step": (grads, 0, 0, update_tmp),
    }
    if t.quantize == "nf4":  # a layer's weight dequantized, late in forward or during a layer's backward
        dq = dequantized(m, t)
        # In down_proj's backward beside it: the gradient it receives, and the fp32 gradient it
        # makes for its input (backward runs outside autocast), beside the adapter's own, made
        # first and not yet summed with it.
        adapted = "down_proj" in t.lora_targets
        back = dq + T * (m.hidden * F32 + m.intermediate * F32 * (2 if adapted else 1))
        fwd = forward_dequantize(m, t, acts) if not t.activation_checkpointing else acts
        parts["4-bit dequantize"] = max((before, fwd, 0, dq), (layer[0], layer[1], 0, back), key=sum)
    phases = {name: weights + optim + sum(p) for name, p in parts.items()}
    phase = max(phases, key=phases.__getitem__)
    g, a, loss, tmp = parts[phase]
    return Breakdown(weights=weights, gradients=g, optimizer=optim, activations=a, loss_buffers=loss,
                     temporaries=tmp, peak=phases[phase], phase=phase, phases=phases, trainable=trainable,
                     params=params)
