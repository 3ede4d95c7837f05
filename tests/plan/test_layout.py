"""What a pipeline stage holds, priced from the model's shape (ember.plan.layout.stage_parts), and
the plan's memory per device under 'pp' and 'pp+ddp' with more than two stages: worked by hand
for a small Llama shape, full fine-tuning in fp32 (bench/pipeline_memory.py measures the same
arithmetic per stage against each rank's peak)."""

from __future__ import annotations

from dataclasses import replace

from ember.hardware import Device, Kind
from ember.parallel.pp import stage_memory
from ember.parallel.strategy import Part
from ember.plan.layout import cast_copies, footprint, rank_memory, stage_parts
from ember.plan.memory import ModelShape, TrainShape, estimate

# hidden 8, MLP 16, 2 heads of 4, vocab 32; one row of 4 tokens a micro-batch
M = ModelShape("llama", layers=4, hidden=8, intermediate=16, heads=2, kv_heads=2, head_dim=4, vocab=32)
T = TrainShape(micro_batch=1, seq_len=4)


def test_a_stages_pieces_from_the_models_shape():
    sp = stage_parts(M, T, (4, "1f1b", 4))
    # a layer: q, k, v, o 8 x 8, gate, up, down 8 x 16, two norms of 8: 656 parameters, each with
    # fp32 weight, gradient and two Adam moments (16 bytes); its activations per token: two norms
    # (input, rsqrt, output: 68 each), the q/k/v and gate/up inputs (32 each) and down_proj's (64),
    # SDPA's q, k, v, output and log-sum-exp (136), the gate, SiLU and up outputs (192): 592 x 4 tokens
    assert sp.layer == Part(656 * 16, 656 * 4, 592 * 4)
    # the embeddings: 32 x 8 parameters; the token ids, 8 bytes a token
    assert sp.first == Part(256 * 16, 256 * 4, 8 * 4)
    # the final norm and the head: 264 parameters; per token the norm's 68, the head's input 32,
    # the ids and targets 16, then the logits and the loss's log-softmax (2 x 32 x 4 bytes a
    # token, kept until backward) and, while the loss differentiates, two more such gradients
    assert sp.last == Part(264 * 16, 264 * 4, 116 * 4 + 2 * 4 * 32 * 4, 0, 2 * 4 * 32 * 4)
    # hidden states between stages 4 x 8 x 4; the rotary tables (2 x 4 x 4 x 4) and the position
    # ids (8 a token); AdamW's largest temporaries: the norm's then the head's sqrt(v) and quotient
    assert (sp.boundary, sp.per_forward, sp.update) == (128, 128 + 32, (8 + 2 * 256) * 4)


def test_four_stages_each_priced_from_the_layers_it_holds():
    fp = footprint(M, estimate(M, T), T, (4, "1f1b", 4))
    # stage 0 (layer 0, the embeddings): 4 in flight, no gradient yet, 14592 - 3648 of state,
    # 4 gradient receive buffers of 128, 4 x (2368 + 32 + 160 + 128 kept as its output)
    # stage 1 (layer 1): 3 in flight, with gradients (a forward follows the first backward):
    # 10496 + 2 x 4 x 128 of receive buffers + 3 x (2368 + 160 + 128); stage 2 the same with 2
    # stage 3 (layer 3, the head): 14720 + 512 + 1 x (2368 + 1488 + 160) + the loss's 1024
    assert stage_memory(fp.stages, 4, 4, "1f1b") == [22208, 19488, 16832, 20272]
    cpu = [Device(0, "cpu", Kind.CPU, 1 << 40, 1 << 40)]
    # the check before `ember run --nproc 4` reads the fullest stage (stage 0), not a quarter of
    # the state beside the whole model's activations
    assert rank_memory(M, T, "pp", 4, 4, cpu, (4, "1f1b", 4)).per_rank == 22208
    # 'pp+ddp' with pp_size 4 over 8 ranks: each replica's pipeline runs 2 micro-batches, 2 in flight
    # at most, so stage 0 holds 2; the last stage, with the head and the loss, is the fullest:
    # 14720 + 2 x 128 + 4016 + 1024
    assert rank_memory(M, T, "pp+ddp", 8, 8, cpu, (4, "1f1b", 4)).per_rank == 20016


def test_autocast_keeps_one_copy_of_a_trained_weight_and_one_per_micro_batch_of_a_frozen_one():
    # a layer's linears: 640 weights, 2 bytes each in bf16; the head's 32 x 8
    assert cast_copies(M, replace(T, autocast=True)) == ((1280, 0), (512, 0))
    # LoRA: the frozen base's casts are made by each micro-batch's forward (kept until its backward),
    # the adapters' (rank 8 on q, k, v, o: 8 x 16 each; gate, up, down: 8 x 24 each) cached once
    assert cast_copies(M, replace(T, autocast=True, lora=True)) == ((2 * 8 * (4 * 16 + 3 * 24), 1280), (0, 512))
    assert cast_copies(M, T) == ((0, 0), (0, 0))
    sp = stage_parts(M, replace(T, autocast=True, lora=True), (4, "gpipe", 4))
    # the last stage per micro-batch: the final norm's input and rsqrt and the targets (44 a token),
    # the bf16 logits and the fp32 log-softmax (4 x 32 x (2 + 4)), the head's own bf16 copy (512)
    assert sp.last.acts == 44 * 4 + 4 * 32 * 6 + 512 and sp.last.copies == 0
    assert sp.layer.copies == 2176
