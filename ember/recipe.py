"""Recipes: a TOML file mapped to typed dataclasses, one per section, validated before anything runs.

Every field carries its documentation and its allowed range in `setting(...)`, so the validator
(the config engine, ember.config), `ember recipe` and docs/recipe.md all read the same source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from ember.config import Source, build_file, read_toml, reference, rows, setting, to_toml, toml_key
from ember.errors import EmberError
from ember.parallel.registry import STRATEGIES, summaries



@dataclass
class ModelConfig:
    path: str = setting("builtin:tiny", "A local Hugging Face model folder, a .gguf file, "
                        "'package:DIST:FILE' (a file inside an installed Python package), or "
                        "'builtin:tiny' (a tiny Llama-style model with a byte-level tokenizer).")


@dataclass
class MethodConfig:
    kind: Literal["full", "lora"] = setting("full", "Full fine-tuning or LoRA adapters (peft).")
    rank: int = setting(8, "LoRA rank r.", min=1)
    alpha: float = setting(16.0, "LoRA alpha (scaling = alpha / rank).", min=0, exclusive_min=True)
    dropout: float = setting(0.0, "LoRA dropout probability.", min=0, max=0.9)
    target_modules: list[str] = setting(lambda: ["all-linear"], "Module names LoRA adapts; "
                                        "['all-linear'] adapts every linear layer but the output head.",
                                        factory=True)
    export_merged: bool = setting(False, "LoRA: also write merged full weights to OUT/final/merged.")
    quantize: Literal["none", "nf4", "gguf"] = setting(
        "none", "LoRA over a quantized frozen base (QLoRA). 'nf4': the base's linear layers (all but the "
        "output head) in 4-bit NF4 with double quantization (bitsandbytes' Linear4bit): about 0.13x their "
        "fp32 bytes, quantized again from the model files at every start; needs the `bitsandbytes` package. "
        "'gguf' (a .gguf model): the linears the file stores in Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K kept in "
        "the file's own blocks (0.56, 0.63, 1.06, 0.56, 0.69, 0.82 bytes a weight), dequantized for each matmul to exactly the weights "
        "LoRA trains over: no second rounding, where 'nf4' re-quantizes an already quantized file. The "
        "adapters, embeddings, norms and compute stay in fp32 (bf16 under [precision] bf16); checkpoints "
        "hold only the adapters; `ember export` merges the adapters into the dequantized base. One process "
        "only. See `ember plan`.")


class DataFormat(StrEnum):
    """What a training record is (ember.data.formats); AUTO, in a recipe only: detect it."""
    AUTO = "auto"
    TEXT = "text"
    CHAT = "chat"
    COMPLETION = "completion"


@dataclass
class DataConfig:
    files: list[str] = setting(list, "Training files: plain text (.txt, one document per file), "
                               "JSONL (.jsonl, one record per line), Parquet (.parquet, one record per "
                               "row) or a Hugging Face datasets folder written by save_to_disk. "
                               "Relative to the recipe.",
                               factory=True)
    text_field: str = setting("text", "The JSONL field that holds a document's text.")
    format: DataFormat = setting(
        DataFormat.AUTO, "What a JSONL record is: 'text' ({text_field: ...}), 'chat' ({\"messages\": [{role, "
        "content}, ...]}, OpenAI's format with tools and tool calls, rendered through the tokenizer's "
        "chat template) or 'completion' ({\"prompt\", \"completion\"}); 'auto' detects it from each "
        "file's first record. Chat and completion files together make a chat run (a completion "
        "record is a one-turn conversation); 'chat' reads completion records so too.")
    train_on: Literal["assistant", "all"] = setting(
        "assistant", "Which tokens of chat and completion records the loss learns: the assistant "
        "turns (the completion), or all of them; an assistant turn of weight 0 is never learned. "
        "Plain text learns every token.")
    packing: Literal["auto", "mixed", "documents", "padded"] = setting(
        "auto", "How records become sequences of seq_len: 'mixed' cuts the token stream into "
        "sequences whose documents attend to each other; 'documents' packs whole documents, "
        "positions restarting at each and attention block-diagonal (no cross-contamination); "
        "'padded' puts one document per row, padded to the longest of its length-sorted bucket. "
        "'auto' = documents for chat and completion data, mixed for text.")
    long_records: Literal["keep_answer", "truncate", "drop"] = setting(
        "keep_answer", "A chat or completion record longer than seq_len (documents and padded "
        "packing): 'keep_answer' cuts the prompt's beginning so the learned tokens (assistant turns, "
        "completion) stay whole (an answer longer than a row keeps its beginning, after seq_len/2 "
        "tokens of prompt); 'truncate' keeps the first seq_len tokens (a long prompt leaves nothing "
        "to learn); 'drop' leaves the record out. The default keeps what the loss learns. Counted in "
        "run.json's data notes; a run with no learned token left refuses to start. Long text "
        "documents are split into seq_len pieces.")
    seq_len: int = setting(128, "Tokens per packed training sequence.", min=2)
    workers: int = setting(0, "Data-loader worker processes (0 = load in the training process).",
                           min=0, max=64)
    tokenize_workers: int = setting(
        0, "Processes that tokenize the files into the token cache, shard by shard (0 = one per "
        "CPU core). The cache is byte-identical for any count; a tokenization that was killed "
        "resumes with the shards it had not finished; one that failed removes its work.", min=0, max=256)


@dataclass
class EvalConfig:
    holdout: float = setting(0.0, "Share of the training files' documents held out for evaluation, "
                             "chosen by a seeded hash of each document's content (appending files "
                             "never moves a document between the splits); .txt files are held out in "
                             "blocks cut at line ends; 0 = none.", min=0, max=0.5)
    files: list[str] = setting(list, "Separate evaluation files (same formats as [data] files).",
                               factory=True)
    seed: int = setting(0, "Seed of the held-out hash.", min=0)
    every_steps: int = setting(50, "Evaluate every N optimizer steps (0 = only at the end).", min=0)
    at_end: bool = setting(True, "Evaluate once the last step is done.")
    max_batches: int = setting(0, "Micro-batches per evaluation (0 = the whole evaluation set).", min=0)
    prompts: list[str] = setting(list, "Prompts to complete greedily at each evaluation, rendered as "
                                 "the training records were (in a chat run, a user turn through the chat "
                                 "template with its generation prompt); the completions are printed and "
                                 "kept in OUT/eval/generations.jsonl.", factory=True)
    max_new_tokens: int = setting(32, "Tokens generated per prompt.", min=1, max=4096)
    patience: int = setting(0, "Early stopping: end the run when this many evaluations in a row "
                            "do not lower the best held-out loss; it then completes at that step "
                            "(the reason in run.json and `ember report`), and `ember export "
                            "--checkpoint best` exports the best one. 0 = train to max_steps.", min=0)


INT8_STATE_MIN_ELEMENTS = 4096  # optimizer.state_dtype 'int8': smaller tensors keep fp32 moments


@dataclass
class OptimizerConfig:
    lr: float = setting(3e-4, "AdamW peak learning rate.", min=0, exclusive_min=True)
    beta1: float = setting(0.9, "AdamW beta1.", min=0, max=0.999999)
    beta2: float = setting(0.95, "AdamW beta2.", min=0, max=0.999999)
    eps: float = setting(1e-8, "AdamW epsilon.", min=0, exclusive_min=True)
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay.", min=0)
    state_dtype: Literal["fp32", "int8"] = setting(
        "fp32", "AdamW's two moments in fp32 (torch.optim.AdamW), or in 8 bits (bitsandbytes' blockwise "
        f"AdamW8bit: about a quarter of the memory; tensors under {INT8_STATE_MIN_ELEMENTS} elements keep "
        "fp32 moments). 8-bit moments train a little differently from fp32 ones, resume exactly, run in "
        "one process only, and need the `bitsandbytes` package. See `ember plan`.")
    grad_clip: float = setting(1.0, "Clip the global gradient norm to this value (0 = no clipping).",
                               min=0)


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "linear", "constant"] = setting("cosine", "Decay after warmup.")
    warmup_steps: int = setting(0, "Steps of linear warmup from 0 to the peak learning rate.", min=0)
    min_lr_ratio: float = setting(0.1, "Final learning rate as a share of the peak (cosine, linear).",
                                  min=0, max=1)


@dataclass
class TrainConfig:
    max_steps: int = setting(100, "Optimizer steps in the whole run.", min=1, max=10**12)
    micro_batch: int = setting(4, "Sequences per forward/backward pass.", min=1)
    grad_accum: int = setting(1, "Micro-batches accumulated per optimizer step.", min=1)
    seed: int = setting(0, "Seed for initialisation, data order and dropout.", min=0,
                        max=2**32 - 1)  # NumPy's global seed (ember.ckpt.state.seed_all) takes 32 bits
    activation_checkpointing: bool = setting(False, "Recompute activations in backward to save memory.")
    compile: bool | Literal["auto"] = setting(
        "auto", "torch.compile (inductor) the forward, loss and backward of the step: true, false, or "
        "'auto' = eager on every device (measured on an H200: compiling made full fine-tuning 1.24x slower "
        "and LoRA 1.12x faster after a 74-104 s compile; it halved the step's peak memory; ask with true). The checkpoint format is the eager model's; the compile cache is $EMBER_HOME/cache/inductor; "
        "compile seconds are the goodput bucket 'compile' and graph breaks are warned of. A compiled run "
        "resumes bit-identically to an uninterrupted compiled run on a CPU; compiled and eager runs differ "
        "in the last bits.")
    loss_chunk: int = setting(0, "Memory-efficient loss: cross-entropy over chunks of this many "
                              "tokens, so the batch x seq x vocab logits never exist at once "
                              "(0 = the plain loss). See `ember plan`.", min=0)
    device: str = setting("auto", "'auto' (the accelerator torch finds, else CPU), 'cpu', or a torch "
                          "device such as 'cuda', 'cuda:1', 'xpu', 'npu', 'mps'.")
    threads: int = setting(0, "CPU threads for torch (0 = all cores). Fixed for the whole run: "
                           "bit-exact resume needs the same count.", min=0)
    deterministic: bool = setting(True, "torch.use_deterministic_algorithms(True); see README.")
    restarts: int = setting(0, "Supervise the run: restart after a crash, up to this many crashes "
                            "within an hour (0 = no supervision; `--restarts` overrides).", min=0)
    restart_backoff_seconds: float = setting(2.0, "First wait before a restart; doubles with each "
                                             "crash, up to 5 minutes.", min=0)


@dataclass
class CheckpointConfig:
    every_steps: int = setting(50, "Checkpoint every N optimizer steps (0 = off).", min=0)
    every_seconds: float | Literal["auto"] = setting(
        0.0, "Also checkpoint when this many seconds passed since the last one (0 = off); 'auto' = "
        "the Young/Daly interval from the measured checkpoint cost and interruption_hours.", min=0)
    interruption_hours: float = setting(0.0, "Expected hours between interruptions of this machine "
                                        "(crashes, power cuts, preemptions), for every_seconds = "
                                        "'auto' and `ember plan`; 0 = from the ledger's history "
                                        "of this machine, else 24.", min=0, max=1e6)  # a century: seconds stay finite
    keep_last: int = setting(2, "Committed checkpoints to keep; older ones are deleted only after "
                             "a newer one is committed.", min=1)
    keep_best: bool = setting(True, "With evaluation on: checkpoint at every evaluation that lowers the "
                              "best held-out loss, and keep that checkpoint beyond keep_last until a "
                              "lower one replaces it (`ember export --checkpoint best`).")
    loss_budget_seconds: float = setting(0.0, "When a checkpoint cannot be written (full disk, I/O "
                                         "error), keep training while the last committed one is at "
                                         "most this many seconds old; 0 = stop at once.", min=0)
    async_: bool = setting(True, "Two-phase checkpoints: training blocks only for a snapshot into "
                           "host memory; a background thread makes it durable.", key="async")
    persist_nice: int = setting(13, "CPU niceness of the background persist: higher slows the steps "
                                "beside it less and makes the checkpoint durable later; the training "
                                "time it costs in all stays about the same (on 2 busy cores, a 1.6 GB "
                                "state: 10 = steps +50% for 1.6x its standalone time, 13 = +36% for "
                                "1.8x, 16 = +17% for 2.8x; bench/README.md).", min=0, max=19)


@dataclass
class PrecisionConfig:
    mode: Literal["fp32", "bf16", "fp16"] = setting("fp32", "Compute precision: fp32, or bf16/fp16 "
                                                    "autocast (fp16 uses a GradScaler).")


@dataclass
class GuardConfig:
    spike_action: Literal["off", "warn", "skip", "rollback"] = setting(
        "warn", "What a loss spike (above median + k*MAD of the recent window) does: warn and "
        "apply the step, skip its update, or roll back to the last checkpoint and skip its batches.")
    spike_k: float = setting(8.0, "Spike threshold in MADs above the window's median.", min=0,
                             exclusive_min=True)
    spike_window: int = setting(50, "Recent accepted losses the threshold is computed from.", min=3)
    spike_min_steps: int = setting(20, "Accepted steps before spikes are judged.", min=3)
    rollback_lr_factor: float = setting(0.5, "Learning-rate multiplier applied at each rollback.",
                                        min=0, max=1, exclusive_min=True)
    max_bad_steps: int = setting(5, "Consecutive bad steps (non-finite or spiking) before the run "
                                 "stops with an error naming them.", min=1)


@dataclass
class CostConfig:
    device_hour_price: float = setting(0.0, "Price of one accelerator (or the CPU machine) per hour; "
                                       "0 = take it from $EMBER_HOME/machine.toml, else unknown.", min=0)
    devices: int = setting(0, "Devices the price applies to (0 = the devices the run uses).", min=0)
    watts: float = setting(0.0, "Power draw of the machine while training, in watts (0 = machine.toml).",
                           min=0)
    energy_price_kwh: float = setting(0.0, "Price of one kWh (0 = machine.toml).", min=0)
    currency: str = setting("", "Currency of the prices ('' = machine.toml, else USD).")
    peak_tflops: float = setting(0.0, "Peak dense TFLOP/s of one device at the run's precision, "
                                 "for MFU and the plan's step time (0 = ember's table, or a measured peak on CPU, with the "
                                 "fixed cost of each op activation checkpointing recomputes; set, nothing is "
                                 "measured and the plan prices FLOPs alone).", min=0)
    memory_gbps: float = setting(0.0, "Memory bandwidth of one device in GB/s, for the time QLoRA's 4-bit "
                                 "dequantization takes in the plan (0 = ember's table; on a CPU, where the memory "
                                 "is not what limits it, bitsandbytes' 4-bit linear measured here: a fixed cost "
                                 "per call plus its bytes over a rate).", min=0)


@dataclass
class PlanConfig:
    local_max_hours: float = setting(72.0, "Longest run the machine's owner accepts locally; "
                                     "`ember plan` sends a longer one to remote compute.", min=0,
                                     exclusive_min=True)
    memory_margin: float = setting(0.10, "Share of device memory kept free beyond the estimated "
                                   "peak (allocator fragmentation, the runtime's own use).", min=0, max=1)
    assumed_mfu: float = setting(0.35, "Share of peak FLOP/s assumed for the time estimate when "
                                 "`ember plan` measures nothing (--calibrate measures).", min=0,
                                 max=1, exclusive_min=True)


# How the ranks of a distributed run split the work: one member per strategy of the registry
# (ember/parallel/registry.py), named like it ('fsdp+tp' is FSDP_TP).
Strategy = StrEnum("Strategy", {name.upper().replace("+", "_"): name for name in STRATEGIES})
# The pipeline schedules of strategy 'pp' (ember/parallel/pp.py), torch.distributed.pipelining's.
PipelineSchedule = StrEnum("PipelineSchedule", {"GPIPE": "gpipe", "ONE_F_ONE_B": "1f1b"})


@dataclass
class DistributedConfig:
    strategy: Strategy = setting(
        Strategy.DDP, "How ranks split the work when `ember run --nproc N` (or --nnodes) starts several: "
        f"{summaries()}. [train] micro_batch x grad_accum stays the global batch: the data-parallel "
        "ranks share it out, each taking grad_accum / ranks of the micro-batches (or, when grad_accum "
        "is not a multiple of the ranks, an equal slice of each micro-batch's rows); the ranks of a "
        "tensor-parallel group, and the stages of a pipeline, compute the same ones (under 'tp' and "
        "'pp', every rank computes all of them).")
    tp_size: int = setting(2, "Ranks in each tensor-parallel group under strategy 'fsdp+tp' (keep a group "
                           "within one node).", min=2)
    pp_size: int = setting(2, "Stages in each pipeline under strategy 'pp+ddp': the ranks divide into "
                           "ranks / pp_size replicas of one pipeline (under 'pp', every rank is a stage "
                           "of the one pipeline).", min=2)
    schedule: PipelineSchedule = setting(
        PipelineSchedule.ONE_F_ONE_B, "Under strategies 'pp' and 'pp+ddp', the order the stages run their "
        "pipeline's micro-batches in (grad_accum / replicas of them): '1f1b' (a backward as soon as a "
        "micro-batch's forward reaches the last stage: at most one micro-batch per stage in flight; it "
        "needs at least one micro-batch per stage) or "
        "'gpipe' (every forward, then every backward: every micro-batch's activations held at once). Both "
        "compute the same gradients; the idle share (the bubble) is (stages - 1) / (micro-batches + "
        "stages - 1) for either.")
    timeout_seconds: float = setting(300.0, "A collective (gradient all-reduce, the stop agreement, "
                                     "a checkpoint barrier) that waits longer than this fails the "
                                     "group instead of hanging it.", min=1)
    hang_factor: float = setting(10.0, "The watchdog calls a step hung when it takes this many times "
                                 "the run's own p99 step (at least hang_min_seconds): it dumps every "
                                 "thread's stack, names the ranks that did not arrive, and stops the "
                                 "group so the supervisor restarts it.", min=1)
    hang_min_seconds: float = setting(30.0, "The shortest step the watchdog may call hung.", min=1)


@dataclass
class LogConfig:
    tensorboard: bool = setting(False, "Also write the per-step scalars of metrics.jsonl as TensorBoard "
                                "event files in OUT/tensorboard (torch.utils.tensorboard; needs the "
                                "`tensorboard` package). Steps a resume computes again replace the "
                                "lost ones there too.")
    mlflow_tracking_uri: str = setting("", "Also log the per-step scalars to MLflow at this tracking URI "
                                       "(e.g. http://127.0.0.1:5000, or file:/path/mlruns); '' = off. "
                                       "Needs the `mlflow` package; every attempt logs to one MLflow run "
                                       "named after ember's run id.")
    mlflow_experiment: str = setting("ember", "The MLflow experiment the run is logged under.")


@dataclass
class ServeConfig:
    coserve: bool = setting(False, "Co-serving: the training process answers OpenAI-style requests "
                            "(/v1/completions, /v1/chat/completions) for its own model between micro-batches, "
                            "with the one copy of the weights it trains; training computes exactly what it "
                            "would without (README, Co-serving). Model names: 'live' (the weights now), "
                            "'committed' and 'base' (LoRA runs). One process only (no --nproc). The address "
                            "and a token go to OUT/serve.json.")
    host: str = setting("127.0.0.1", "Address co-serving listens on (loopback by default: every request "
                        "must still carry the token in OUT/serve.json, or $EMBER_SERVE_TOKEN if set).")
    port: int = setting(0, "Port co-serving listens on (0 = a free one, written to OUT/serve.json).",
                        min=0, max=65535)
    gap_share: float = setting(1.0, "Seconds of serving earned per second of training, spent in the gaps "
                               "between micro-batches (at least one decode step when requests wait; "
                               "see burst_seconds): under a steady stream training keeps about "
                               "1 / (1 + gap_share) of its speed.", min=0)
    burst_seconds: float = setting(1.0, "Serving time a gap may take beyond its share, saved up (at "
                                   "gap_share per second of training) while nothing waited: a request "
                                   "arriving at a quiet moment is answered whole in one gap, up to this "
                                   "long, instead of a share of a micro-batch at a time. A burst costs "
                                   "training at most this once; the steady rate stays gap_share. 0: no "
                                   "saving up.", min=0)


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {key: value}} under the TOML names."""
        out = {}
        for name, values in dataclasses.asdict(self).items():
            fields = dataclasses.fields(getattr(self, name))
            out[name] = {toml_key(f): values[f.name] for f in fields}
        return out

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of the resolved recipe."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()

    def to_toml(self) -> str:
        """The resolved recipe as a TOML file that `load_recipe` reads back to an equal recipe."""
        return to_toml(self.to_dict())

    def with_changes(self, changes: dict[str, Any], source: str = "changes") -> Recipe:
        """A new recipe with `section.key` values replaced, validated like a recipe file."""
        raw = self.to_dict()
        for dotted, value in changes.items():
            section, _, key = dotted.partition(".")
            if section not in raw or not key:
                raise EmberError(f"{source}: {dotted!r} is not a recipe setting (section.key)")
            raw[section][key] = value
        return build_recipe(raw, Source(source))


SECTIONS: dict[str, type] = typing.get_type_hints(Recipe)

# Keys that change how a run is operated, not what it computes: they may differ on resume.
OPERATIONAL_KEYS = frozenset({
    "data.workers", "data.tokenize_workers", "checkpoint.every_steps", "checkpoint.every_seconds", "checkpoint.keep_last",
    "checkpoint.keep_best", "checkpoint.async", "checkpoint.persist_nice", "checkpoint.loss_budget_seconds", "train.restarts", "train.restart_backoff_seconds",
    "method.export_merged", "cost.device_hour_price", "cost.devices", "cost.watts",
    "cost.energy_price_kwh", "cost.currency", "cost.peak_tflops", "cost.memory_gbps", "checkpoint.interruption_hours",
    "plan.local_max_hours", "plan.memory_margin", "plan.assumed_mfu",
    # How ranks split the work changes the order of floating-point sums, not the optimization:
    # a run may resume under another strategy or world size (within the tolerance in README).
    "distributed.strategy", "distributed.tp_size", "distributed.pp_size", "distributed.timeout_seconds",
    "distributed.hang_factor", "distributed.hang_min_seconds",
    # Evaluation reads the model; it never changes what training computes. (eval.patience is not
    # here: it decides where the run ends. Under it, a changed every_steps or max_batches changes
    # which evaluations the counter counts from then on: allowed, like any operational change.)
    "eval.every_steps", "eval.at_end", "eval.max_batches", "eval.prompts", "eval.max_new_tokens",
    # Where else the figures go: never what is computed.
    "log.tensorboard", "log.mlflow_tracking_uri", "log.mlflow_experiment",
    # Co-serving reads the model between micro-batches; what training computes is the same.
    "serve.coserve", "serve.host", "serve.port", "serve.gap_share", "serve.burst_seconds",
})


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def load_recipe(path: str | Path, overrides: list[str] = (),
                warn: typing.Callable[[str], None] | None = None) -> Recipe:
    """Read a TOML recipe, apply `section.key=value` overrides, validate, resolve data paths.
    Settings that are valid but probably not what the user meant go to `warn` (see lint())."""
    path = Path(path)
    if not path.is_file():
        raise EmberError(f"{path}: recipe file not found")
    raw, source = read_toml(path)
    given = set()
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise EmberError(f"{path}: '{section}' must be a [section] table")
        raw[section][key] = value
        given.add((section, key))
    source = dataclasses.replace(source, overridden=frozenset(given))
    recipe = build_recipe(raw, source)
    if warn is not None:
        for message in lint(raw, recipe, source):
            warn(message)
    base = path.resolve().parent
    recipe.data.files = [str((base / f).resolve()) for f in recipe.data.files]
    recipe.eval.files = [str((base / f).resolve()) for f in recipe.eval.files]
    if not recipe.model.path.startswith(("builtin:", "package:")):
        candidate = base / recipe.model.path
        recipe.model.path = str(candidate.resolve()) if candidate.exists() else recipe.model.path
    return recipe


def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); the value is read as TOML, else as a string."""
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise EmberError(f"--set {item!r}: expected section.key=value, e.g. train.max_steps=200")
    try:
        read = tomllib.loads(f"v = {text.strip()}")
    except tomllib.TOMLDecodeError:
        read = {}
    # One TOML value, or else the text: "1\ntrain.seed=2" reads as v = 1 and a second key, which
    # would be dropped without a word (the key's check then says the text is not its kind).
    value = read["v"] if set(read) == {"v"} else text.strip()
    return section, key, value


def build_recipe(raw: dict[str, Any], source: str | Source) -> Recipe:
    """Map a raw TOML dict onto the dataclasses (ember.config); reject unknown keys, wrong types,
    bad ranges and settings that contradict each other."""
    source = source if isinstance(source, Source) else Source(source)
    recipe = build_file(Recipe, raw, source)
    check_recipe(recipe, source)
    return recipe


def check_recipe(recipe: Recipe, source: Source) -> None:
    """Cross-field rules that no single field's range can express."""
    at = source.where
    if not recipe.data.files:
        raise EmberError(f"{at('data', 'files')} is empty: name at least one .txt or .jsonl file")
    if recipe.eval.prompts and not (recipe.eval.holdout or recipe.eval.files):
        raise EmberError(f"{at('eval', 'prompts')} are generated at each evaluation, and there is none: "
                         f"set [eval] holdout or [eval] files")
    if recipe.eval.patience and not (recipe.eval.holdout or recipe.eval.files):
        raise EmberError(f"{at('eval', 'patience')} = {recipe.eval.patience} stops the run when the held-out "
                         f"loss stops improving, and there is no held-out set: set [eval] holdout or [eval] files")
    if recipe.eval.patience and not recipe.eval.every_steps:
        raise EmberError(f"{at('eval', 'patience')} = {recipe.eval.patience} needs evaluations during the run, "
                         f"and [eval] every_steps = 0 evaluates only at the end: set [eval] every_steps")
    if recipe.method.quantize != "none" and recipe.method.kind != "lora":
        raise EmberError(f"{at('method', 'quantize')} = '{recipe.method.quantize}' stores the frozen base in 4 bits "
                         f"under trained LoRA adapters (QLoRA); full fine-tuning trains the base itself, which "
                         f"cannot be 4-bit: set [method] kind = 'lora', or quantize = 'none'")
    if recipe.method.quantize == "gguf" and recipe.train.compile is True:
        raise EmberError(f"{at('train', 'compile')} = true with [method] quantize = 'gguf': the GGUF layers "
                         f"dequantize again in backward through saved-tensor hooks, which torch.compile breaks its "
                         f"graph at, layer after layer; set compile = false (or 'auto'), or quantize = 'nf4'")
    if recipe.method.kind == "lora" and not recipe.method.target_modules:
        raise EmberError(f"{at('method', 'target_modules')} is empty: name the modules LoRA "
                         f"adapts, or use ['all-linear']")


LORA_ONLY = ("rank", "alpha", "dropout", "target_modules", "export_merged")  # quantize: refused


def lint(raw: dict[str, Any], recipe: Recipe, source: Source) -> list[str]:
    """Settings that validate but that users get wrong, each with the reason."""
    out = []
    t, s = recipe.train, recipe.schedule
    if s.warmup_steps >= t.max_steps:
        out.append(f"{source.where('schedule', 'warmup_steps')} = {s.warmup_steps} is not shorter than the run "
                   f"([train] max_steps = {t.max_steps}): the learning rate never reaches its peak")
    given = [k for k in raw.get("method", {}) if k in LORA_ONLY]
    if recipe.method.kind == "full" and given:
        out.append(f"{source.at('method', given[0])}: [method] {', '.join(given)} set, but kind = 'full': LoRA "
                   f"settings have no effect on full fine-tuning; set kind = 'lora' to train adapters")
    cores = os.cpu_count() or 1
    if t.threads > cores:
        out.append(f"{source.where('train', 'threads')} = {t.threads} is more than this machine's {cores} cores: "
                   f"threads would contend for them and every step slows down; use {cores} or fewer")
    return out


def diff_recipes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two resolved recipe dicts. A key the older one
    lacks (a run begun before that setting existed) counts as its default."""
    keys = set()
    defaults = Recipe().to_dict()
    for section in set(old) | set(new):
        a, b = {**defaults.get(section, {}), **old.get(section, {})}, new.get(section, {})
        keys |= {f"{section}.{k}" for k in set(a) | set(b) if a.get(k) != b.get(k)}
    return sorted(keys)


def get_dotted(d: dict[str, Any], dotted: str) -> Any:
    """d["section"]["key"] for "section.key", None if absent."""
    section, key = dotted.split(".", 1)
    return d.get(section, {}).get(key)


def explain() -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every setting, in recipe order."""
    return [(row.key, row.type, row.default, row.help) for row in rows(SECTIONS)]


MARKDOWN_HEADER = """# Recipe settings

Generated by `ember recipe --markdown > docs/recipe.md` from `ember/recipe.py`; `ember recipe`
prints the same in the terminal, and `ember recipe FILE` validates a recipe and prints it
resolved, or says what is wrong, on which line, and what to do. Paths in `data.files` and
`model.path` are relative to the recipe file. Operational keys (`data.workers`, `checkpoint.*`,
`method.export_merged`, `cost.*`) may change between attempts of one run; any other change needs
`--allow-recipe-change`. `[cost]` values left at 0 are taken from `$EMBER_HOME/machine.toml`
(docs/machine.md).
"""


def recipe_reference() -> str:
    """docs/recipe.md: every setting with its type, default, range and meaning."""
    return reference(MARKDOWN_HEADER, rows(SECTIONS))
