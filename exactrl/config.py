"""Typed run configuration: dataclasses, TOML in and out, ``--set`` overrides, validation.

A run is described by one TOML file with one table per section (``[run]``, ``[model]``, ``[engine]``,
``[sampling]``, ``[task]``, ``[reward]``, ``[algorithm]``, ``[train]``, ``[sft]``). Every key is optional; a
missing key keeps the default written below. Command-line overrides use ``section.key=value`` where the
value is a TOML literal (``1e-5``, ``true``, ``[1, 2]``, ``"x"``); a bare word that is not valid TOML is taken
as a string. TOML has no null: on a field that may be None, the strings ``none`` / ``null`` mean None.

The machinery (:func:`config_from_dict`, :func:`dump_toml`, :func:`apply_overrides`, :func:`field_docs`, ...)
is generic over any tree of dataclasses; the schema is :class:`RunConfig`. Every field carries a docstring
(a string literal right after it), which :func:`config_reference_markdown` renders into the reference.

``python -m exactrl.config`` prints the Markdown reference; ``python -m exactrl.config --toml`` prints the
defaults as TOML.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import sys
import textwrap
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

__all__ = [
    "AlgorithmConfig",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "RewardConfig",
    "RunConfig",
    "RunSection",
    "SFTConfig",
    "SamplingConfig",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "config_reference_markdown",
    "config_to_dict",
    "dump_toml",
    "field_docs",
    "load_config",
    "parse_override",
    "resolve_device",
    "save_config",
]


class ConfigError(ValueError):
    """A configuration is malformed: unknown key, wrong type, or a failed validation check.

    ``key`` is the dotted name of the offending field (``"train.lr"``) when there is one.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ----------------------------------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------------------------------

Dtype = Literal["float32", "bfloat16"]
TaskName = Literal["arithmetic", "jsonl", "parquet"]
AlgorithmName = Literal["grpo", "dr_grpo", "rloo", "gspo", "ppo"]
AdvantageName = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "gae",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "gpg",
    "opo",
]
PolicyLossName = Literal["ppo_clip", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "gmpo"]
KLControllerKind = Literal["fixed", "adaptive"]
# algorithm.name is a preset: the (advantage, policy_loss) pair it stands for. These are exactly what each name
# meant before the two keys existed; tests/algorithms/test_menu_config.py holds that table too and compares.
ALGORITHM_PRESETS: dict[str, tuple[str, str]] = {
    "grpo": ("grpo", "ppo_clip"),
    "dr_grpo": ("dr_grpo", "ppo_clip"),
    "rloo": ("rloo", "ppo_clip"),
    "gspo": ("grpo", "gspo"),
    "ppo": ("gae", "ppo_clip"),
}
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AdvScale = Literal["group", "batch", "none"]
KLKind = Literal["k1", "k2", "k3"]
RolloutCorrection = Literal["token-tis", "seq-tis", "token-mis", "seq-mis", "icepop"]
LRSchedule = Literal["constant", "cosine", "linear"]
Overlap = Literal["none", "tail"]
DynamicSampling = Literal["off", "reward", "accuracy"]

ARITHMETIC_OPS = ("+", "-", "*")
_DEVICE_RE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{key} {message}", key=key)


def _check_positive(value: float, key: str) -> None:
    if not (math.isfinite(value) and value > 0):
        _fail(key, f"must be > 0, got {value!r}")


def _check_nonneg(value: float, key: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        _fail(key, f"must be >= 0, got {value!r}")


def _check_at_least(value: int, minimum: int, key: str) -> None:
    if value < minimum:
        _fail(key, f"must be >= {minimum}, got {value!r}")


@dataclass
class RunSection:
    """Run identity, output location, seeding and logging."""

    name: str = "run"
    """Human-readable run name, used in logs and the TensorBoard run label."""
    output_dir: str = "runs/run"
    """Directory for checkpoints, metrics, the saved config and TensorBoard events."""
    seed: int = 0
    """Seed for all random number generators (data order, sampling, model init)."""
    device: str = "auto"
    """Torch device: "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N" or "mps"."""
    exact: bool = True
    """Use batch-invariant kernels so rollout logprobs are bitwise equal to the trainer's; false = fast kernels."""
    on_mismatch: Literal["abort", "skip_step", "warn"] = "abort"
    """Exact mode: every rollout logprob is compared with the trainer's before an optimizer step uses it. On a
    difference: "abort" stops the run with no update applied (the last checkpoint stays the resume point) and
    writes output_dir/mismatch-STEP/ for `exactrl parity --replay`; "skip_step" drops the step's batch and goes
    on; "warn" trains on it and logs."""
    log_every: int = 1
    """Log metrics every this many optimizer steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to output_dir."""
    progress: bool = True
    """Show progress bars when the output is a terminal; otherwise (a log file, CI) a plain line every
    run.log_every steps is printed instead."""
    wandb: bool = False
    """Also log metrics to Weights & Biases (the `wandb` package must be installed; it is not a dependency)."""
    wandb_project: str = "exactrl"
    """Weights & Biases project name."""
    wandb_mode: Literal["online", "offline"] | None = None
    """Weights & Biases mode: "offline" writes to output_dir/wandb with no network (sync later with `wandb sync`);
    unset: the WANDB_MODE environment variable, else online."""
    log_samples_every: int = 0
    """Every this many RL steps, write a few prompts, completions and rewards to samples.jsonl (and TensorBoard
    text); 0 = never."""
    log_samples_count: int = 4
    """How many completions log_samples_every writes per time."""

    def validate(self) -> None:
        if not self.name.strip():
            _fail("run.name", "must not be empty")
        if not self.output_dir.strip():
            _fail("run.output_dir", "must not be empty")
        _check_at_least(self.seed, 0, "run.seed")
        if not _DEVICE_RE.fullmatch(self.device):
            _fail("run.device", f"must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}")
        _check_at_least(self.log_every, 1, "run.log_every")
        if self.wandb and not self.wandb_project.strip():
            _fail("run.wandb_project", "must not be empty when run.wandb = true")
        _check_at_least(self.log_samples_every, 0, "run.log_samples_every")
        _check_at_least(self.log_samples_count, 1, "run.log_samples_count")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LoraInit = Literal["default", "gaussian"]


@dataclass
class LoraConfig:
    """LoRA: train low-rank adapters on the decoder's projections instead of every weight (rank 0 = off)."""

    rank: int = 0
    """Adapter rank r; 0 = no LoRA (full fine-tune). The base weights are then frozen in the model dtype."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (alpha / sqrt(rank) with rslora)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Projections (HF names) that get adapters in every layer; default all seven linear projections."""
    init: LoraInit = "default"
    """Init of A (B starts at 0 either way): "default" = kaiming-uniform as PEFT, "gaussian" = N(0, 1/rank)."""
    rslora: bool = False
    """Rank-stabilised scale alpha / sqrt(rank) instead of alpha / rank."""
    dropout: float = 0.0
    """Must be 0: dropout would make the trainer's forward differ from the engine's (no exact logprobs)."""
    path: str | None = None
    """A PEFT adapter directory to start from (adapter_config.json + adapter_model.safetensors); its rank,
    alpha and targets must match this section."""

    def validate(self) -> None:
        _check_at_least(self.rank, 0, "lora.rank")
        if self.rank == 0:
            if self.path is not None:
                _fail("lora.path", "is set but lora.rank is 0 (LoRA off): set the adapter's rank")
            return
        _check_positive(self.alpha, "lora.alpha")
        if not self.target_modules:
            _fail("lora.target_modules", f"must name at least one of {list(LORA_TARGETS)}")
        for i, t in enumerate(self.target_modules):
            if t not in LORA_TARGETS:
                close = difflib.get_close_matches(t, LORA_TARGETS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                _fail(f"lora.target_modules[{i}]", f"{t!r} is not one of {list(LORA_TARGETS)}{hint}")
        if len(set(self.target_modules)) != len(self.target_modules):
            _fail("lora.target_modules", f"names a module twice: {self.target_modules}")
        if self.dropout != 0:
            _fail(
                "lora.dropout",
                f"must be 0, got {self.dropout!r}: LoRA dropout is not supported, since a random mask in the "
                "trainer's forward would break the bitwise equality with the engine's logprobs",
            )
        if self.path is not None and not self.path.strip():
            _fail("lora.path", "must not be empty")


@dataclass
class ModelConfig:
    """Which model to train: a random-init preset shape or a local Hugging Face checkpoint."""

    preset: str | None = None
    """Name of a built-in model shape to initialise randomly (set exactly one of preset and path)."""
    path: str | None = None
    """Local Hugging Face checkpoint directory (config.json + safetensors) to load (exactly one of preset/path)."""
    dtype: Dtype = "float32"
    """Parameter and activation dtype: "float32" or "bfloat16"."""
    fp32_lm_head: bool = False
    """Keep the LM head (final projection to vocabulary logits) in float32 even when dtype is bfloat16."""
    precision: Literal["dtype", "fp8"] = "dtype"
    """The projections' arithmetic: "dtype" (in the model dtype) or "fp8" (attention, MLP and expert weights in e4m3 with a scale per 128 x 128 block, activations per token and 128-channel group; the LM head, norms and attention stay in dtype; engine and trainer share it bitwise; docs/fp8.md). fp8 on CUDA needs compute capability 8.9+."""
    tokenizer: str | None = None
    """Path to a tokenizer.json; defaults to the one inside path."""
    init_draws: Literal["stream", "keyed"] = "stream"
    """A preset's random weights: "stream" (one generator draws every matrix in order on one core: the presets' values as they have always been) or "keyed" (each matrix from its own generator seeded by the run's seed and its name, drawn on several threads: other values, the same on every device, dtype and thread count; a 30B preset's one-core draws take minutes). Not used with model.path."""

    def validate(self) -> None:
        if self.precision not in ("dtype", "fp8"):
            _fail("model.precision", f'must be "dtype" or "fp8", got {self.precision!r}')
        if self.init_draws not in ("stream", "keyed"):
            _fail("model.init_draws", f'must be "stream" or "keyed", got {self.init_draws!r}')
        if self.preset is not None and self.path is not None:
            # The usual way here: a config written for a preset, pointed at a checkpoint with --set model.path=...
            _fail(
                "model.preset",
                f"({self.preset!r}) and model.path ({self.path!r}) are both set: set exactly one of them. To load "
                "the checkpoint instead of the preset, also set model.preset=none (--set model.preset=none)",
            )
        if self.preset is None and self.path is None:
            _fail("model.preset", "or model.path: set exactly one of them")
        if self.preset is not None and not self.preset.strip():
            _fail("model.preset", "must not be empty")
        if self.path is not None and not self.path.strip():
            _fail("model.path", "must not be empty")


@dataclass
class EngineConfig:
    """Rollout engine: paged KV cache, scheduler limits and CUDA graphs."""

    block_size: int = 16
    """Tokens per KV-cache block; must be a multiple of 16."""
    num_kv_blocks: int | None = None
    """Number of KV-cache blocks; unset = sized from kv_memory_fraction of free device memory."""
    kv_memory_fraction: float = 0.45
    """Fraction of free device memory given to the KV cache when num_kv_blocks is unset, in (0, 1]. In
    `exactrl train` on a GPU, free means what the memory plan leaves in the phases that hold the cache (with
    release_memory the generation phase alone, else all three), everything resident counted (optimizer state, the
    training graphs), so the cache never crowds out training; elsewhere, what the device has free when the cache
    is first allocated."""
    max_num_seqs: int = 256
    """Maximum number of sequences the scheduler runs concurrently."""
    max_num_batched_tokens: int = 4096
    """Maximum number of tokens (prefill + decode) in one engine forward pass."""
    prefill_chunk_size: int = 2048
    """Long prompts are prefilled in chunks of at most this many tokens."""
    cuda_graphs: bool = True
    """Capture decode steps in CUDA graphs (ignored on CPU)."""
    max_model_len: int = 2048
    """Maximum total sequence length (prompt + completion) the engine accepts."""
    release_memory: bool = True
    """Memory phases of `exactrl train`: free the KV cache (and under torchrun the engine's weight replica) while
    the trainer runs, and allocate them again before the next generation (the replica is rebuilt by the weight
    sync's all-gather), so that generation and training do not hold each other's memory. The same bits either
    way. Not with algorithm.max_off_policy_steps >= 1 or algorithm.overlap = "tail", where generation runs during
    training."""
    tensor_parallel: int = 1
    """Ranks that share one rollout engine, each holding 1/T of its weights and KV cache, sampling the bits of the
    one-device engine (exactrl/distributed/tensor_parallel.py). Under torchrun (`exactrl train --nproc N`, T
    dividing N) each group of T ranks samples the union of its ranks' prompts in one engine call and every rank
    trains on its own share, as at T = 1 (exactrl/distributed/shared_engine.py); `exactrl parity --tensor-parallel
    T` checks it. LoRA adapters split with their projections (A whole on every rank, B's rows with the weight's).
    With distributed.generator_ranks = G (T dividing G) the generators form G / T engines of T ranks each and the
    trainers hold whole replicas (one step off and partial rollouts run there too). Multi-turn episodes run in
    lockstep on the group's ranks, each calling its own prompts' environment (exactrl/envs/rollout.py). Not with one
    step off on colocated ranks (refused)."""
    expert_parallel: int = 1
    """Ranks that share one rollout engine of a mixture-of-experts model, each holding 1/E of every sparse layer's
    routed experts (exactrl/distributed/expert_parallel.py); E must divide the experts. Runs like
    engine.tensor_parallel (the same group when both are above 1, so then they must be equal); `exactrl parity
    --expert-parallel E` checks it. Refused for dense models. LoRA (attention adapters) stays whole on every rank."""

    def validate(self) -> None:
        _check_at_least(self.tensor_parallel, 1, "engine.tensor_parallel")
        _check_at_least(self.expert_parallel, 1, "engine.expert_parallel")
        if 1 < self.tensor_parallel != self.expert_parallel > 1:
            _fail(
                "engine.expert_parallel",
                f"({self.expert_parallel}) must equal engine.tensor_parallel ({self.tensor_parallel}) when both "
                "are above 1: they split one engine over the same ranks",
            )
        _check_at_least(self.block_size, 16, "engine.block_size")
        if self.block_size % 16:
            _fail("engine.block_size", f"must be a multiple of 16, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _check_at_least(self.num_kv_blocks, 1, "engine.num_kv_blocks")
        if not (0 < self.kv_memory_fraction <= 1):
            _fail("engine.kv_memory_fraction", f"must be in (0, 1], got {self.kv_memory_fraction!r}")
        _check_at_least(self.max_num_seqs, 1, "engine.max_num_seqs")
        _check_at_least(self.max_num_batched_tokens, 1, "engine.max_num_batched_tokens")
        _check_at_least(self.prefill_chunk_size, 1, "engine.prefill_chunk_size")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            _fail(
                "engine.prefill_chunk_size",
                f"({self.prefill_chunk_size}) must be <= engine.max_num_batched_tokens "
                f"({self.max_num_batched_tokens})",
            )
        _check_at_least(self.max_model_len, 1, "engine.max_model_len")


@dataclass
class SamplingConfig:
    """How rollouts are sampled from the policy."""

    temperature: float = 1.0
    """Sampling temperature; 0 = greedy. Logprobs are computed at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest token set with this much probability mass, in (0, 1]; 1 = off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    max_tokens: int = 128
    """Maximum number of generated tokens per completion (per model turn when env.name is set)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion when generated (the stop string is kept in the text)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a completion, besides the tokenizer's end-of-sequence token."""

    def validate(self) -> None:
        _check_nonneg(self.temperature, "sampling.temperature")
        if not (0 < self.top_p <= 1):
            _fail("sampling.top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check_at_least(self.top_k, 0, "sampling.top_k")
        _check_at_least(self.max_tokens, 1, "sampling.max_tokens")
        for i, s in enumerate(self.stop):
            if not s:
                _fail(f"sampling.stop[{i}]", "must not be an empty string")
        for i, t in enumerate(self.stop_token_ids):
            _check_at_least(t, 0, f"sampling.stop_token_ids[{i}]")


@dataclass
class TaskConfig:
    """The prompts to train and evaluate on: the built-in arithmetic task or a dataset file (JSONL or parquet)."""

    name: TaskName = "arithmetic"
    """Task: "arithmetic" (generated sums, no data needed), "jsonl" or "parquet" (records from path; parquet needs pyarrow)."""
    path: str | None = None
    """Training file: one record (JSON object / parquet row) per prompt with prompt_field and answer_field; bad records are skipped and logged with file:line."""
    eval_path: str | None = None
    """Evaluation file (same format); unset = a held-out split (arithmetic: fresh problems with another seed)."""
    prompt_field: str = "prompt"
    """Field holding the prompt: a string or a chat (a list of {role, content} messages, e.g. "messages"); a dotted path reaches nested fields."""
    answer_field: str = "answer"
    """Field holding the reference answer passed to the reward functions; a dotted path reaches nested fields (verl: "reward_model.ground_truth")."""
    use_chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template (when it has one)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking = false} for Qwen3."""
    system_prompt: str | None = None
    """System message prepended when the chat template is used; unset = none."""
    num_eval: int = 200
    """Number of evaluation prompts."""
    eval_every: int = 0
    """Evaluate every this many steps; 0 = only before and after training."""
    eval_samples: int = 1
    """Completions sampled per evaluation prompt (metrics are averaged)."""
    eval_temperature: float = 0.0
    """Sampling temperature for evaluation; 0 = greedy."""
    max_prompt_tokens: int = 256
    """Prompts longer than this many tokens are skipped, in RL and SFT alike, each logged with its file:line."""
    arithmetic_max_operand: int = 20
    """Arithmetic task: operands are drawn uniformly from 0..arithmetic_max_operand."""
    arithmetic_ops: list[str] = field(default_factory=lambda: ["+", "-"])
    """Arithmetic task: operators to draw from, a subset of "+", "-", "*"."""
    arithmetic_num_terms: int = 2
    """Arithmetic task: number of operands in each expression."""

    def validate(self) -> None:
        if self.name in ("jsonl", "parquet") and not self.path:
            _fail("task.path", f'is required when task.name = "{self.name}"')
        for key in self.chat_template_kwargs:
            if key in ("messages", "add_generation_prompt"):
                _fail(f"task.chat_template_kwargs.{key}", "is set by exactrl itself; remove it")
        if not self.prompt_field:
            _fail("task.prompt_field", "must not be empty")
        if not self.answer_field:
            _fail("task.answer_field", "must not be empty")
        _check_at_least(self.num_eval, 0, "task.num_eval")
        _check_at_least(self.eval_every, 0, "task.eval_every")
        _check_at_least(self.eval_samples, 1, "task.eval_samples")
        _check_nonneg(self.eval_temperature, "task.eval_temperature")
        _check_at_least(self.max_prompt_tokens, 1, "task.max_prompt_tokens")
        _check_at_least(self.arithmetic_max_operand, 1, "task.arithmetic_max_operand")
        if not self.arithmetic_ops:
            _fail("task.arithmetic_ops", "must not be empty")
        for i, op in enumerate(self.arithmetic_ops):
            if op not in ARITHMETIC_OPS:
                _fail(f"task.arithmetic_ops[{i}]", f"must be one of {list(ARITHMETIC_OPS)}, got {op!r}")
        if len(set(self.arithmetic_ops)) != len(self.arithmetic_ops):
            _fail("task.arithmetic_ops", f"has duplicates: {self.arithmetic_ops}")
        _check_at_least(self.arithmetic_num_terms, 2, "task.arithmetic_num_terms")


@dataclass
class RewardConfig:
    """Reward functions applied to each completion; the reward is their weighted sum."""

    functions: list[str] = field(default_factory=lambda: ["numeric_match"])
    """Reward functions: built-in names (e.g. "numeric_match"), "path/to/file.py:function" (a relative path is from the working directory) or "module:function"; user functions run in worker processes."""
    weights: list[float] = field(default_factory=list)
    """One weight per function; empty = all 1.0."""
    timeout_s: float = 5.0
    """Seconds a reward call may run (one completion; a batched function's whole batch) before its worker is killed and the call scores 0."""
    model: str | None = None
    """A learned reward: a local Hugging Face *ForSequenceClassification checkpoint (Qwen2/Qwen3/Llama) scoring prompt + completion on the run's device; its score is added with model_weight."""
    model_label: int = 0
    """Which logit of the reward model is the score."""
    model_weight: float = 1.0
    """Weight of the reward model's score in the reward."""
    model_batch_size: int = 16
    """Completions scored per reward-model forward pass."""
    model_max_tokens: int = 4096
    """Longest reward-model input in tokens; longer ones keep their end (where the score is read)."""
    model_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Reward model weights' dtype."""
    accuracy: str = "auto"
    """Which reward function is the correctness verdict that accuracy counts (a sample is correct when its unweighted score is > 0.5), named as in functions; "auto" = the built-in numeric_match / exact_match if exactly one is listed, else the first function that is not "format", else none (accuracy not reported); "off" = no accuracy. Multi-turn runs (env.name set): always the environment's verdict, episode reward > 0.5 (keep "auto")."""
    overlong_buffer_tokens: int = 0
    """DAPO's soft overlong penalty: the band of tokens before sampling.max_tokens inside which the reward falls linearly, from 0 at sampling.max_tokens - overlong_buffer_tokens to -overlong_penalty at sampling.max_tokens (length = completion tokens); 0 = off. Logged as reward/overlong_penalty and overlong/penalized_samples. Single-turn only."""
    overlong_penalty: float = 1.0
    """The soft overlong penalty at the band's end (DAPO's penalty factor), added to the reward as -overlong_penalty * (length - (max_tokens - overlong_buffer_tokens)) / overlong_buffer_tokens inside the band."""
    max_error_share: float = 0.5
    """A reward function failing (error, non-finite value, timeout) on more than this share of a step's calls is logged as a warning with its first error's file and line; 0 = any failure."""

    def validate(self) -> None:
        if not self.functions and not self.model:
            _fail("reward.functions", "must name at least one reward function (or set reward.model)")
        if self.accuracy not in ("auto", "off") and self.accuracy not in self.functions:
            _fail(
                "reward.accuracy",
                f"= {self.accuracy!r} must name one of reward.functions {self.functions} (as listed), "
                '"auto" or "off"',
            )
        _check_at_least(self.overlong_buffer_tokens, 0, "reward.overlong_buffer_tokens")
        if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0):
            _fail("reward.overlong_penalty", f"must be finite and >= 0, got {self.overlong_penalty!r}")
        if not (math.isfinite(self.max_error_share) and 0.0 <= self.max_error_share <= 1.0):
            _fail("reward.max_error_share", f"must be within [0, 1], got {self.max_error_share!r}")
        for i, name in enumerate(self.functions):
            if not name.strip():
                _fail(f"reward.functions[{i}]", "must not be empty")
        if self.weights and len(self.weights) != len(self.functions):
            _fail(
                "reward.weights",
                f"must be empty or have one weight per function ({len(self.functions)}), "
                f"got {len(self.weights)}",
            )
        for i, w in enumerate(self.weights):
            if not math.isfinite(w):
                _fail(f"reward.weights[{i}]", f"must be finite, got {w!r}")
        _check_positive(self.timeout_s, "reward.timeout_s")
        if self.model is not None:
            _check_at_least(self.model_label, 0, "reward.model_label")
            _check_at_least(self.model_batch_size, 1, "reward.model_batch_size")
            _check_at_least(self.model_max_tokens, 2, "reward.model_max_tokens")
            if not math.isfinite(self.model_weight):
                _fail("reward.model_weight", f"must be finite, got {self.model_weight!r}")


# Advantage estimators whose baseline is the sample's own group.
GROUP_BASELINE_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "opo")


@dataclass
class AlgorithmConfig:
    """The RL objective: advantages, clipping, loss aggregation, KL, value function, rollout correction."""

    name: AlgorithmName = "grpo"
    """Preset for a common (advantage, policy_loss) pair: "grpo" = (grpo, ppo_clip), "dr_grpo" = (dr_grpo, ppo_clip), "rloo" = (rloo, ppo_clip), "gspo" = (grpo, gspo), "ppo" = (gae, ppo_clip). algorithm.advantage / algorithm.policy_loss, when set, override its half."""
    advantage: AdvantageName | None = None
    """Advantage estimator (names as in verl): "grpo", "dr_grpo", "rloo", "gae" (learned critic), "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax" (greedy-rollout baseline), "gpg", "opo"; unset = the preset's. See docs/algorithms.md."""
    policy_loss: PolicyLossName | None = None
    """Policy loss (names as in verl): "ppo_clip", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "gmpo"; unset = the preset's. See docs/algorithms.md."""
    whiten_advantages: bool | None = None
    """Normalise advantages to zero mean and unit variance over the step's tokens; unset = on for "gae", off for the group estimators (as verl). The reinforce_plus_plus estimators normalise by definition."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are computed within each group."""
    rollouts_per_step: int = 64
    """Sequences per optimizer step (prompts per step = rollouts_per_step / group_size)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    minibatches_per_rollout: int = 1
    """Optimizer steps per pass over a rollout batch; rollouts_per_step must be divisible by it."""
    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip range: the ratio is clipped at 1 + eps_high (raise it for DAPO-style clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss for negative advantages (ppo_clip and gspo only); unset = off."""
    cispo_eps_high: float = 0.28
    """cispo: the detached importance weight is capped at 1 + cispo_eps_high."""
    cispo_eps_low: float | None = None
    """cispo: the weight is floored at 1 - cispo_eps_low; unset = no floor (as the paper)."""
    sapo_tau_pos: float = 1.0
    """sapo: gate temperature for tokens with a positive advantage."""
    sapo_tau_neg: float = 1.05
    """sapo: gate temperature for tokens with a zero or negative advantage (larger = damped faster)."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: fraction of a microbatch's tokens whose gradient is detached, in (0, 1]."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens with covariance term above this are candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: only tokens with covariance term below this are candidates."""
    kl_cov_ratio: float = 2e-4
    """kl_cov: fraction of a microbatch's tokens (largest covariance term) that get the KL penalty, in (0, 1]."""
    kl_cov_coef: float = 1.0
    """kl_cov: coefficient of the |log ratio| penalty on the selected tokens."""
    aggregation: Aggregation = "token-mean"
    """How per-token losses are reduced to a scalar: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or "seq-mean-token-sum-norm"."""
    adv_scale: AdvScale = "group"
    """Divide advantages by the reward std of the "group", of the whole "batch", or "none"."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the reference (initial) policy; 0 = no reference model."""
    kl_kind: KLKind = "k3"
    """KL estimator: "k1" (log ratio), "k2" (squared log ratio / 2) or "k3" (unbiased, non-negative)."""
    kl_in_reward: bool = False
    """Subtract the KL penalty from the reward instead of adding it to the loss."""
    kl_controller: KLControllerKind = "fixed"
    """"fixed" keeps kl_coef; "adaptive" steers the measured KL to kl_target (Ziegler et al. 2019), starting from kl_coef."""
    kl_target: float = 0.1
    """Adaptive KL: target per-token KL to the reference policy."""
    kl_horizon: int = 10000
    """Adaptive KL: horizon in sequences; the coefficient moves by at most 20% per kl_horizon sequences trained."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus in the loss; 0 = off."""
    gamma: float = 1.0
    """PPO: discount factor, in [0, 1]."""
    lam: float = 1.0
    """PPO: GAE lambda, in [0, 1]."""
    value_clip: float | None = 0.2
    """PPO: clip value predictions to within this distance of the old values; none = off."""
    vf_coef: float = 0.5
    """PPO: coefficient of the value loss."""
    rollout_correction: RolloutCorrection | None = None
    """Importance correction for rollout/trainer mismatch: "token-tis", "seq-tis", "token-mis", "seq-mis", "icepop"; unset = off."""
    rollout_correction_threshold: float = 2.0
    """Truncation (TIS) or masking (MIS, IcePop) threshold on the trainer/rollout probability ratio."""
    max_off_policy_steps: int = 0
    """Off-policy staleness bound k: the batch trained at step t may have been sampled by policy t - k or later.
    0 = the synchronous loop (sample, then train on it). 1 = one-step-off: the engine samples the next batch from
    its own weight copy while the trainer updates on this one, every token keeps the logprob and version of the
    policy that sampled it, the guard checks those logprobs against the behaviour weights before any update uses
    them, and the loss is decoupled PPO (see docs/algorithms.md). Exact mode; multi-turn episodes too (the next batch's episodes run in the worker; not with partial_rollouts); under torchrun each
    rank's engine replica is the weight copy. >= 2 only with partial_rollouts (a cut sample's tokens wait one more
    version)."""
    off_policy_is_cap: float = 2.0
    """Decoupled PPO (max_off_policy_steps >= 1): cap on the per-token importance weight pi_prox / pi_behav."""
    overlap: Overlap = "none"
    """"none": sample the whole batch, then train on it. "tail": on-policy overlap within a step: the engine generates in a worker thread and each prompt's group, once all its samples are finished and scored, is trained on (forward + backward, gradients accumulated) while the rest of the batch keeps generating from the same weights; the one optimizer step waits for the whole batch. Rollouts are the synchronous run's bit for bit; the update agrees with it to float rounding (microbatches follow the finish order). Exact mode, one process, single-turn, one update per step, group-local advantages (see docs/algorithms.md)."""
    partial_rollouts: bool = False
    """Off-policy generation stops once the step's prompts_per_step groups have finished (over-sampled by
    partial_oversample); the unfinished samples keep their tokens and behaviour logprobs and continue in the next
    step's generation, re-prefilled under the new weights. Needs max_off_policy_steps >= 2: a carried token is
    trained two versions after the one that sampled it; a group that would exceed the bound is finished in the
    generation where it is due, never cut. Under torchrun each rank keeps its own pool (its share of the prompts,
    extra groups sized from that share) and cuts by its own count. See docs/algorithms.md."""
    partial_oversample: float = 0.25
    """Partial rollouts: groups in flight beyond prompts_per_step, as a fraction of it (rounded up), in (0, 1]."""
    dynamic_sampling: DynamicSampling = "off"
    """DAPO's dynamic sampling, named by the value it filters on: a group whose samples all have the same "reward" (the reward the advantages see, overlong penalty included) or the same "accuracy" verdict (correct or not, by reward.accuracy's function; a multi-turn episode's: reward > 0.5) carries no gradient under a group baseline and is dropped; more prompts are drawn and sampled, in up to dynamic_sampling_max_rounds extra rounds, until the step holds prompts_per_step groups with signal (surplus ones are discarded). Short after the cap, the step trains on what there is (dynamic_sampling/groups_missing says so). "off" = every group is trained on. See docs/algorithms.md."""
    dynamic_sampling_max_rounds: int = 8
    """Dynamic sampling: extra generation rounds allowed per step beyond the first (verl's max_num_gen_batches - 1); 0 = drop groups without signal, never draw more."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: a truncated sample (single-turn: it hit sampling.max_tokens; multi-turn: its episode hit env.max_turns or its token limit) is masked out of the loss (its group's advantages still count its reward); the guard still checks its tokens. Counted in overlong/filtered_samples."""

    @property
    def prompts_per_step(self) -> int:
        """Distinct prompts per optimizer step (rollouts_per_step / group_size)."""
        return self.rollouts_per_step // self.group_size

    @property
    def partial_extra_groups(self) -> int:
        """Partial rollouts: groups kept in flight beyond prompts_per_step (at least 1, at most prompts_per_step)."""
        return self.partial_groups(0, 1)[1]

    def partial_groups(self, rank: int, world_size: int) -> tuple[int, int]:
        """Partial rollouts: a rank's pool, (the groups it trains each step, its extra groups in flight): its share
        of prompts_per_step (as `DistContext.shard` splits it) and max(1, ceil(share x partial_oversample)) extra.
        Extras sized per rank, so every rank's pool can be cut without the others'."""
        base, rest = divmod(self.prompts_per_step, world_size)
        share = base + (rank < rest)
        return share, max(1, math.ceil(share * self.partial_oversample))

    @property
    def resolved_advantage(self) -> str:
        """The advantage estimator this section selects: algorithm.advantage, else the preset's."""
        return self.advantage or ALGORITHM_PRESETS[self.name][0]

    @property
    def resolved_policy_loss(self) -> str:
        """The policy loss this section selects: algorithm.policy_loss, else the preset's."""
        return self.policy_loss or ALGORITHM_PRESETS[self.name][1]

    @property
    def resolved_whiten_advantages(self) -> bool:
        """algorithm.whiten_advantages, else on for "gae" only."""
        if self.whiten_advantages is not None:
            return self.whiten_advantages
        return self.resolved_advantage == "gae"

    @property
    def needs_critic(self) -> bool:
        """A learned value model is trained iff the advantages are GAE's."""
        return self.resolved_advantage == "gae"

    def policy_loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `exactrl.algorithms.policy_loss_terms` that this section fixes (kind and the loss's
        own constants; aggregation and the divisors are the trainer's)."""
        return {
            "kind": self.resolved_policy_loss,
            "eps_low": self.eps_low,
            "eps_high": self.eps_high,
            "dual_clip": self.dual_clip,
            "cispo_eps_high": self.cispo_eps_high,
            "cispo_eps_low": self.cispo_eps_low,
            "sapo_tau_pos": self.sapo_tau_pos,
            "sapo_tau_neg": self.sapo_tau_neg,
            "clip_cov_ratio": self.clip_cov_ratio,
            "clip_cov_lb": self.clip_cov_lb,
            "clip_cov_ub": self.clip_cov_ub,
            "kl_cov_ratio": self.kl_cov_ratio,
            "kl_cov_coef": self.kl_cov_coef,
        }

    def validate(self) -> None:
        _check_at_least(self.group_size, 1, "algorithm.group_size")
        adv, loss = self.resolved_advantage, self.resolved_policy_loss
        if adv in GROUP_BASELINE_ADVANTAGES and self.group_size < 2:
            # These subtract the group's mean (rloo the others'): a group of one gets an advantage of exactly
            # zero on every sample, and the run would train on nothing.
            _fail(
                "algorithm.group_size",
                f'must be >= 2 for advantage "{adv}" (a group of one makes every advantage zero); '
                'sample several completions per prompt (e.g. group_size = 8) or use algorithm.name = "ppo", '
                "whose critic needs no group",
            )
        if adv == "reinforce_plus_plus" and self.gamma != 1:
            _fail(
                "algorithm.gamma",
                f"must be 1 with advantage reinforce_plus_plus (outcome rewards, undiscounted: a discounted "
                f"token-level return is not implemented), got {self.gamma!r}",
            )
        if self.dual_clip is not None and loss not in ("ppo_clip", "gspo"):
            _fail("algorithm.dual_clip", f'applies to policy_loss "ppo_clip" and "gspo" only, not "{loss}"')
        _check_nonneg(self.cispo_eps_high, "algorithm.cispo_eps_high")
        if self.cispo_eps_low is not None:
            _check_nonneg(self.cispo_eps_low, "algorithm.cispo_eps_low")
        _check_positive(self.sapo_tau_pos, "algorithm.sapo_tau_pos")
        _check_positive(self.sapo_tau_neg, "algorithm.sapo_tau_neg")
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, key)
            if not (math.isfinite(value) and 0 < value <= 1):
                _fail(f"algorithm.{key}", f"must be in (0, 1], got {value!r}")
        if not (math.isfinite(self.clip_cov_lb) and math.isfinite(self.clip_cov_ub)) or not (
            self.clip_cov_lb < self.clip_cov_ub
        ):
            _fail(
                "algorithm.clip_cov_lb",
                f"({self.clip_cov_lb!r}) must be < algorithm.clip_cov_ub ({self.clip_cov_ub!r})",
            )
        _check_nonneg(self.kl_cov_coef, "algorithm.kl_cov_coef")
        if self.kl_controller == "adaptive":
            if not self.kl_coef > 0:
                _fail(
                    "algorithm.kl_controller",
                    f'"adaptive" needs algorithm.kl_coef > 0 (its starting value; it scales it), got {self.kl_coef!r}',
                )
            _check_positive(self.kl_target, "algorithm.kl_target")
        _check_at_least(self.kl_horizon, 1, "algorithm.kl_horizon")
        _check_at_least(self.dynamic_sampling_max_rounds, 0, "algorithm.dynamic_sampling_max_rounds")
        if self.dynamic_sampling != "off":
            why = f"with algorithm.dynamic_sampling = {self.dynamic_sampling!r}"
            if adv not in GROUP_BASELINE_ADVANTAGES:
                # Only a group baseline makes an all-equal group's advantages zero: elsewhere (a critic, a greedy
                # baseline, batch-whitened returns) such a group still carries a gradient, and dropping it would bias.
                _fail(
                    "algorithm.advantage",
                    f"{adv!r} is not supported {why}: a group whose rewards are all equal has zero advantage only "
                    f"under a group baseline; use one of {GROUP_BASELINE_ADVANTAGES}",
                )
            if self.partial_rollouts:
                _fail(
                    "algorithm.partial_rollouts",
                    f"must be false {why}: partial rollouts cut generation by a count of finished groups, and a "
                    "group dropped after that cut would leave the step short with its samples already carried",
                )
        _check_at_least(self.rollouts_per_step, 1, "algorithm.rollouts_per_step")
        if self.rollouts_per_step % self.group_size:
            _fail(
                "algorithm.rollouts_per_step",
                f"({self.rollouts_per_step}) must be divisible by algorithm.group_size ({self.group_size})",
            )
        _check_at_least(self.ppo_epochs, 1, "algorithm.ppo_epochs")
        _check_at_least(self.minibatches_per_rollout, 1, "algorithm.minibatches_per_rollout")
        if self.rollouts_per_step % self.minibatches_per_rollout:
            _fail(
                "algorithm.rollouts_per_step",
                f"({self.rollouts_per_step}) must be divisible by algorithm.minibatches_per_rollout "
                f"({self.minibatches_per_rollout})",
            )
        if not (0 <= self.eps_low < 1):
            _fail("algorithm.eps_low", f"must be in [0, 1), got {self.eps_low!r}")
        _check_nonneg(self.eps_high, "algorithm.eps_high")
        if self.dual_clip is not None and not (math.isfinite(self.dual_clip) and self.dual_clip > 1):
            _fail("algorithm.dual_clip", f"must be > 1 (or unset), got {self.dual_clip!r}")
        _check_nonneg(self.kl_coef, "algorithm.kl_coef")
        if not math.isfinite(self.entropy_coef):
            _fail("algorithm.entropy_coef", f"must be finite, got {self.entropy_coef!r}")
        if not (0 <= self.gamma <= 1):
            _fail("algorithm.gamma", f"must be in [0, 1], got {self.gamma!r}")
        if not (0 <= self.lam <= 1):
            _fail("algorithm.lam", f"must be in [0, 1], got {self.lam!r}")
        if self.value_clip is not None:
            _check_positive(self.value_clip, "algorithm.value_clip")
        _check_nonneg(self.vf_coef, "algorithm.vf_coef")
        _check_positive(self.rollout_correction_threshold, "algorithm.rollout_correction_threshold")
        if self.partial_rollouts:
            if self.overlap == "tail":
                # Said first: each mode's own check would ask for a max_off_policy_steps the other refuses.
                _fail(
                    "algorithm.partial_rollouts",
                    '= true cannot be combined with algorithm.overlap = "tail": partial rollouts train off-policy '
                    "(max_off_policy_steps >= 2), the tail overlap on-policy (0); choose one of the two",
                )
            if isinstance(self.max_off_policy_steps, bool) or not (
                isinstance(self.max_off_policy_steps, int) and self.max_off_policy_steps >= 2
            ):
                _fail(
                    "algorithm.max_off_policy_steps",
                    f"must be >= 2 with algorithm.partial_rollouts = true, got {self.max_off_policy_steps!r}: a "
                    "sample cut in one step's generation finishes in the next, so its first tokens are trained two "
                    "versions after the one that sampled them",
                )
            if not (math.isfinite(self.partial_oversample) and 0 < self.partial_oversample <= 1):
                _fail("algorithm.partial_oversample", f"must be in (0, 1], got {self.partial_oversample!r}")
        elif self.max_off_policy_steps not in (0, 1):
            _fail(
                "algorithm.max_off_policy_steps",
                f"must be 0 (synchronous) or 1 (one-step-off), got {self.max_off_policy_steps!r}: on one device one "
                "batch in flight already overlaps generation with the update; a deeper queue is not implemented "
                "(>= 2 is for algorithm.partial_rollouts = true)",
            )
        if not (math.isfinite(self.off_policy_is_cap) and self.off_policy_is_cap >= 1):
            _fail(
                "algorithm.off_policy_is_cap", f"must be a finite number >= 1, got {self.off_policy_is_cap!r}"
            )


@dataclass
class TrainConfig:
    """Optimisation of the policy (and the PPO critic): steps, AdamW, schedule, microbatching, checkpoints."""

    steps: int = 100
    """Number of RL optimizer steps (each consumes algorithm.rollouts_per_step rollouts)."""
    lr: float = 1e-5
    """Peak learning rate of the policy."""
    critic_lr: float = 1e-5
    """Peak learning rate of the PPO critic."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value."""
    warmup_steps: int = 0
    """Linear learning-rate warmup from 0 over this many steps."""
    lr_schedule: LRSchedule = "constant"
    """Learning rate after warmup: "constant", or "cosine" / "linear" decay to 0 at the last step."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one packed forward/backward microbatch (gradients are accumulated across them)."""
    fsdp_tokens_per_microbatch: int | None = None
    """Under torchrun (FSDP2), at any world size (`--nproc 1` included): the sharded trainer's microbatch
    token budget. Each FSDP2 microbatch pays a round of per-layer all-gathers and reduce-scatters and runs
    without CUDA graphs, so fewer, larger ones are faster (qwen3-0.6b on one H100, 2026-11-26: 1.98x the
    tokens/s at 32,768 tokens than at 8,192). Unset = on GPUs, with engine.release_memory on, the largest of 32768 and
    16384 (above max_tokens_per_microbatch) that the memory plan fits with 10% of the device to spare, else
    max_tokens_per_microbatch; on CPU ranks max_tokens_per_microbatch. Ignored on one device without torchrun.
    Episode and SFT length limits keep following max_tokens_per_microbatch."""
    fsdp_reduce: Literal["minibatch", "microbatch"] = "minibatch"
    """Under torchrun (FSDP2): when the gradients are reduce-scattered. "minibatch": once, after a minibatch's last
    microbatch; until then each rank accumulates the gradients of every trained parameter unsharded, in fp32 (4
    bytes per trained parameter of the whole model on each rank, the memory plan's fsdp_accumulated_grads).
    "microbatch": after every microbatch, the shards accumulating (1/N of that): a round of reduce-scatters per
    microbatch, and the gradient summed in another (fixed) order, so not the bits of "minibatch"; what a model
    whose fp32 gradients do not fit beside its shards needs (qwen3-30b-a3b on 2 x H200). One microbatch a
    minibatch: the same either way."""
    cuda_graphs: bool = True
    """Replay each microbatch's forward, loss and backward from a CUDA graph (ignored on CPU). Microbatches are
    then padded to a few bucket shapes; padding never reaches the loss."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's inputs from the forward and recompute the layer in the backward
    (torch.utils.checkpoint, non-reentrant): less activation memory for about one more forward. Exact either way:
    the recomputation runs the same kernels on the same inputs, so losses and gradients are bitwise the same."""
    offload: Literal["none", "optimizer"] = "none"
    """Where the policy's (and critic's) fp32 master weights and AdamW moments wait between optimizer steps:
    "none" = on the device; "optimizer" = in pinned host memory, brought to the device for each step (12 bytes
    per trainable parameter off the device during generation and the forward/backward, for two copies of them per
    step). Under torchrun (FSDP2) the fp32 shards stay on the device and each rank's AdamW moment shards move (8
    bytes per element of its shard). The same bits either way. `exactrl plan` shows what it saves."""
    check_memory: bool = True
    """On a CUDA device, check the memory plan (`exactrl plan`) before anything loads and refuse a run whose
    generation, training or optimizer phase is predicted not to fit, naming the settings that would; false
    skips the check (the plan's activation term is an estimate)."""
    save_every: int = 50
    """Save a checkpoint every this many steps (and always at the end); 0 = only at the end."""
    save_at_end: bool = True
    """Write a checkpoint when the run reaches train.steps (false: only save_every's and Ctrl-C's, e.g. for a
    benchmark of a large model whose checkpoint would take long to write)."""
    keep_checkpoints: int = 2
    """Number of most recent checkpoints kept on disk; older ones are deleted."""
    max_nan_steps: int = 3
    """Abort after this many consecutive steps with a non-finite loss or gradient (those steps are skipped)."""
    moe_aux_loss_coef: float = 0.0
    """Mixture of experts: weight of the router's load-balancing loss (the Switch loss transformers scales by a
    checkpoint's `router_aux_loss_coef`, e.g. 0.001), added to the policy loss per microbatch. Off by default in
    RL: a pretrained router is already balanced, and a second objective beside the reward moves the routing, hence
    the sampling policy, for reasons the reward does not see; turn it on when `moe/load_max_over_mean` drifts up.
    It changes no logprob (the exactness check is unaffected); the `moe/*` metrics are logged either way."""
    moe_z_loss_coef: float = 0.0
    """Mixture of experts: weight of the router z-loss (ST-MoE: mean over tokens and sparse layers of
    logsumexp(router logits)^2), which keeps router logits small; e.g. 0.001. Off by default for the reason above."""

    def validate(self) -> None:
        _check_at_least(self.steps, 0, "train.steps")
        _check_nonneg(self.moe_aux_loss_coef, "train.moe_aux_loss_coef")
        _check_nonneg(self.moe_z_loss_coef, "train.moe_z_loss_coef")
        _check_positive(self.lr, "train.lr")
        _check_positive(self.critic_lr, "train.critic_lr")
        _check_nonneg(self.weight_decay, "train.weight_decay")
        if len(self.betas) != 2:
            _fail("train.betas", f"must have exactly 2 values, got {len(self.betas)}")
        for i, b in enumerate(self.betas):
            if not (0 <= b < 1):
                _fail(f"train.betas[{i}]", f"must be in [0, 1), got {b!r}")
        _check_positive(self.grad_clip, "train.grad_clip")
        _check_at_least(self.warmup_steps, 0, "train.warmup_steps")
        _check_at_least(self.max_tokens_per_microbatch, 1, "train.max_tokens_per_microbatch")
        if self.fsdp_tokens_per_microbatch is not None:
            _check_at_least(self.fsdp_tokens_per_microbatch, 1, "train.fsdp_tokens_per_microbatch")
        _check_at_least(self.save_every, 0, "train.save_every")
        _check_at_least(self.keep_checkpoints, 1, "train.keep_checkpoints")
        _check_at_least(self.max_nan_steps, 0, "train.max_nan_steps")


@dataclass
class SFTConfig:
    """Optional supervised warm start on the task's reference answers before RL."""

    steps: int = 0
    """Supervised fine-tuning steps before RL; 0 = no SFT warm start."""
    lr: float = 1e-3
    """SFT learning rate (AdamW, using train.betas and train.weight_decay)."""
    batch_size: int = 32
    """Prompt/answer pairs per SFT step."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many SFT steps."""
    checkpoint: str | None = None
    """Start RL from this existing SFT checkpoint directory instead of running SFT."""
    save_every: int = 100
    """Write a resumable SFT checkpoint (weights, optimizer, data position) to <output_dir>/sft-checkpoints every this many SFT steps; 0 = only when the run is stopped (Ctrl-C, SIGTERM). `--resume` continues SFT from the last one; they are removed once SFT has finished."""

    def validate(self) -> None:
        _check_at_least(self.steps, 0, "sft.steps")
        _check_positive(self.lr, "sft.lr")
        _check_at_least(self.batch_size, 1, "sft.batch_size")
        _check_at_least(self.warmup_steps, 0, "sft.warmup_steps")
        _check_at_least(self.save_every, 0, "sft.save_every")
        if self.checkpoint is not None and self.steps > 0:
            _fail("sft.checkpoint", "and sft.steps > 0 are exclusive: load a checkpoint or run SFT, not both")


@dataclass
class EnvConfig:
    """Multi-turn episodes: the model talks to an environment (a tool, a game) for several turns; unset name = single-turn completions."""

    name: str | None = None
    """Environment: "calculator" (<calc>expr</calc> tool calls, then an answer), "guess" (guess the number), or "module:ClassName" (an exactrl.envs.Environment or AsyncEnvironment subclass); unset = no environment. A model turn ends at a stop token, at sampling.stop or the environment's stop strings, or after sampling.max_tokens tokens."""
    max_turns: int = 4
    """Most model turns per episode; an episode still going after its last turn ends with the last step's reward (0 for the built-ins)."""
    max_episode_tokens: int | None = None
    """Most tokens per episode: prompt + every model turn + every observation; unset = engine.max_model_len (at most train.max_tokens_per_microbatch). A turn samples at most what is left; an observation that would leave no room for one more model token ends the episode (finish "max_tokens", the observation not appended)."""
    timeout_s: float = 30.0
    """Time limit of each environment call (reset + the first step: twice this); a call past it ends its episode with reward 0, counted in env/timeouts; a call that raises or returns garbage, in env/errors (its text, with the file and line that raised, is printed)."""
    isolation: str = "auto"
    """Where a synchronous environment's calls run: "process" (worker processes; a hung or busy-looping call is stopped at env.timeout_s by killing its worker, which also ends the other episodes that worker held), "thread" (a thread per call in the trainer's process: cheapest, but a hung call cannot be stopped), or "auto" (the built-ins calculator and guess, which cannot hang, in threads; any "module:ClassName" environment in processes). An AsyncEnvironment always runs on an event loop, where a call past its time is cancelled."""
    workers: int = 4
    """Worker processes for isolation "process": episodes are spread over them and stay on one (an environment keeps state across its episode's calls); more workers lose fewer episodes when one call hangs."""
    max_error_share: float = 0.1
    """A step whose environment calls fail (errors and timeouts) on more than this share prints a warning with the first failure; env/error_share logs the share every step."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor, e.g. {call_cost = 0.05, format_penalty = 0.1} for the calculator (taken off the reward per tool call / for a final answer that is more than a number); an option the environment does not take is refused by name."""

    def validate(self) -> None:
        if self.name is not None:
            builtin = ("calculator", "guess")
            if self.name not in builtin and ":" not in self.name:
                _fail("env.name", f"must be one of {builtin} or 'module:ClassName', got {self.name!r}")
        if self.options and self.name is None:
            _fail("env.options", "is set but env.name is not: options are for an environment")
        _check_at_least(self.max_turns, 1, "env.max_turns")
        if self.max_episode_tokens is not None:
            _check_at_least(self.max_episode_tokens, 2, "env.max_episode_tokens")
        _check_positive(self.timeout_s, "env.timeout_s")
        isolations = ("auto", "process", "thread")
        if self.isolation not in isolations:
            _fail("env.isolation", f"must be one of {isolations}, got {self.isolation!r}")
        _check_at_least(self.workers, 1, "env.workers")
        if not (isinstance(self.max_error_share, (int, float)) and 0 <= self.max_error_share <= 1):
            _fail("env.max_error_share", f"must be in [0, 1], got {self.max_error_share!r}")


@dataclass
class DistributedConfig:
    """The layout of a torchrun run's ranks: every rank colocated (engine and trainer take turns), or generator ranks apart."""

    generator_ranks: int = 0
    """Under torchrun: how many ranks (the last ones) run only the rollout engine, while the others run only the trainer (FSDP2 among themselves) and send it their new weights after every update; 0 = colocated (every rank holds an engine replica and a trainer shard). With G generators and N trainers a run's metrics and weights equal the colocated run's at world size N (k = 0 or 1, dynamic sampling, LoRA (the sync then moves the adapters alone), partial rollouts and multi-turn environments (the episodes run on the generators, each against its own instance of the environment) too). Refused with it: tail overlap."""
    generator_kv_memory_fraction: float = 0.85
    """A generator rank's KV cache: this fraction of the device memory its model leaves free (it holds no trainer, so the card is the engine's; engine.kv_memory_fraction sizes a colocated rank's cache, which shares its card with training). engine.num_kv_blocks, when set, sizes both. A cache too small for the batch makes the engine preempt and recompute; the size never changes a token's bits, but where a partial rollout's cut falls depends on the schedule, so set engine.num_kv_blocks where a disaggregated partial-rollouts run must equal a colocated one on a GPU."""

    def validate(self) -> None:
        _check_at_least(self.generator_ranks, 0, "distributed.generator_ranks")
        if not (0 < self.generator_kv_memory_fraction <= 1):
            _fail(
                "distributed.generator_kv_memory_fraction",
                f"must be in (0, 1], got {self.generator_kv_memory_fraction!r}",
            )


@dataclass
class RunConfig:
    """The complete configuration of a run; one attribute per TOML section."""

    run: RunSection = field(default_factory=RunSection)
    """Run identity, output location, seeding and logging."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model to train: a random-init preset shape or a local Hugging Face checkpoint."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Rollout engine: paged KV cache, scheduler limits and CUDA graphs."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How rollouts are sampled from the policy."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The prompts to train and evaluate on: the built-in arithmetic task or a JSONL dataset."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions applied to each completion; the reward is their weighted sum."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL objective: advantages, clipping, loss aggregation, KL, value function, rollout correction."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation of the policy (and the PPO critic): steps, AdamW, schedule, microbatching, checkpoints."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Optional supervised warm start on the task's reference answers before RL."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes: the model talks to an environment (a tool, a game) for several turns; unset name = single-turn completions."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: train low-rank adapters on the decoder's projections instead of every weight (rank 0 = off)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """The layout of a torchrun run's ranks: every rank colocated (engine and trainer take turns), or generator ranks apart."""

    def validate(self) -> None:
        """Run every section's checks, then the checks that span sections. Raises ConfigError."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        seq_len = self.task.max_prompt_tokens + self.sampling.max_tokens
        if seq_len > self.engine.max_model_len:
            _fail(
                "engine.max_model_len",
                f"({self.engine.max_model_len}) must be >= task.max_prompt_tokens + sampling.max_tokens "
                f"({self.task.max_prompt_tokens} + {self.sampling.max_tokens} = {seq_len})",
            )
        if self.env.name is not None:
            for key, limit in (
                ("engine.max_model_len", self.engine.max_model_len),
                ("train.max_tokens_per_microbatch", self.train.max_tokens_per_microbatch),
            ):
                if self.env.max_episode_tokens is not None and self.env.max_episode_tokens > limit:
                    _fail(key, f"({limit}) must be >= env.max_episode_tokens ({self.env.max_episode_tokens})")
        for key, budget in (
            ("train.max_tokens_per_microbatch", self.train.max_tokens_per_microbatch),
            ("train.fsdp_tokens_per_microbatch", self.train.fsdp_tokens_per_microbatch),
        ):
            if budget is not None and seq_len > budget:
                _fail(
                    key,
                    f"({budget}) must fit one full sequence: "
                    f"task.max_prompt_tokens + sampling.max_tokens = {seq_len}",
                )
        if self.algorithm.overlap == "tail":
            _check_tail_overlap(self)
        _check_dapo(self)
        if self.env.name is not None and self.reward.accuracy != "auto":
            # Episodes are scored by the environment, not by reward.functions: there is no function to name.
            _fail(
                "reward.accuracy",
                f"= {self.reward.accuracy!r} with env.name = {self.env.name!r}: a multi-turn run's accuracy is the "
                'environment\'s verdict (episode reward > 0.5); leave reward.accuracy = "auto"',
            )


def _check_dapo(cfg: RunConfig) -> None:
    """Dynamic sampling and the soft overlong penalty against the other sections (their own checks are in
    AlgorithmConfig and RewardConfig)."""
    a, r = cfg.algorithm, cfg.reward
    if a.dynamic_sampling == "accuracy" and r.accuracy == "off" and cfg.env.name is None:
        _fail(
            "algorithm.dynamic_sampling",
            '= "accuracy" needs a correctness verdict, and reward.accuracy = "off" turns it off; name the '
            'correctness function in reward.accuracy (or filter on "reward")',
        )
    if a.dynamic_sampling != "off" and a.overlap == "tail":
        _fail(
            "algorithm.overlap",
            f'"tail" is not supported with algorithm.dynamic_sampling = {a.dynamic_sampling!r}: the tail overlap '
            "trains on a group as soon as it finishes, before the step knows which groups it keeps",
        )
    if r.overlong_buffer_tokens > 0:
        if cfg.env.name is not None:
            _fail(
                "reward.overlong_buffer_tokens",
                f"must be 0 with env.name = {cfg.env.name!r}: the soft overlong penalty is measured against "
                "sampling.max_tokens, a single completion's limit (an episode's limits are env.max_turns and "
                "env.max_episode_tokens); algorithm.overlong_filter does apply to episodes",
            )
        if r.overlong_buffer_tokens >= cfg.sampling.max_tokens:
            _fail(
                "reward.overlong_buffer_tokens",
                f"({r.overlong_buffer_tokens}) must be < sampling.max_tokens ({cfg.sampling.max_tokens}): it is "
                "the band before max_tokens in which the reward falls; a band as long as max_tokens penalises "
                "every length",
            )


# Advantages computed within each group: a group is scored and trained on as soon as it finishes.
TAIL_OVERLAP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "opo")


def _check_tail_overlap(cfg: RunConfig) -> None:
    """algorithm.overlap = "tail" trains on each group before the batch has finished: every option that needs the
    whole batch before the first backward, or a second update in the step, is refused here by name."""
    a, why = cfg.algorithm, 'with algorithm.overlap = "tail"'
    if not cfg.run.exact:
        _fail("run.exact", f"must be true {why}: its guard is exact mode's check inside the training forward")
    if a.max_off_policy_steps:
        _fail(
            "algorithm.max_off_policy_steps",
            f"must be 0 {why}: the tail overlap stays on-policy (one-step-off is the other kind of overlap)",
        )
    if a.ppo_epochs != 1 or a.minibatches_per_rollout != 1:
        _fail(
            "algorithm.ppo_epochs",
            f"and algorithm.minibatches_per_rollout must be 1 {why} (got {a.ppo_epochs} and "
            f"{a.minibatches_per_rollout}): a second update would change the weights the batch's tail samples from",
        )
    adv = a.resolved_advantage
    if adv not in TAIL_OVERLAP_ADVANTAGES:
        _fail(
            "algorithm.advantage",
            f"{adv!r} is not supported {why}: it needs the whole batch (a critic, batch whitening, a greedy "
            f"baseline or batch counts) before a group can be trained on; use one of {TAIL_OVERLAP_ADVANTAGES}",
        )
    if adv == "grpo" and a.adv_scale == "batch":
        _fail(
            "algorithm.adv_scale", f'"batch" needs the whole batch\'s reward std {why}; use "group" or "none"'
        )
    if a.resolved_whiten_advantages:
        _fail("algorithm.whiten_advantages", f"whitens over the whole batch: set it false {why}")
    if a.rollout_correction:
        _fail("algorithm.rollout_correction", f"is fast mode's correction: leave it unset {why}")
    if cfg.env.name is not None:
        _fail("env.name", f"= {cfg.env.name!r}: multi-turn episodes are not supported {why}")
    if cfg.lora.rank > 0 and a.kl_coef > 0:
        _fail(
            "algorithm.kl_coef",
            f"must be 0 with LoRA {why}: the reference is the policy with its adapters switched off, and the engine "
            "samples from that same model while the trainer scores the reference",
        )


def episode_token_limit(cfg: RunConfig) -> int:
    """The most tokens of one episode: env.max_episode_tokens, or when unset what both the engine
    (engine.max_model_len) and one training microbatch hold, so that turning an environment on needs no other key."""
    if cfg.env.max_episode_tokens is not None:
        return cfg.env.max_episode_tokens
    return min(cfg.engine.max_model_len, cfg.train.max_tokens_per_microbatch)


def resolve_device(cfg: RunConfig | str | torch.device) -> str:
    """The torch device string for ``cfg.run.device`` (or a device string or torch.device): "auto" -> "cuda" if
    available else "cpu"."""
    import torch

    if isinstance(cfg, torch.device):
        return str(cfg)
    device = cfg if isinstance(cfg, str) else cfg.run.device
    if device != "auto":
        return device

    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------------------
# Generic machinery: dict/TOML -> dataclasses with type checking
# ----------------------------------------------------------------------------------------------------------

_T = TypeVar("_T")
_NoneType = type(None)
_NONE_WORDS = frozenset({"none", "null"})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _init_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    """A readable name for an annotation: ``float | None``, ``list[str]``, ``"a" | "b"``."""
    if tp is _NoneType or tp is None:
        return "None"
    if tp is Any:
        return "any"
    if _is_dataclass_type(tp):
        return "table"
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in get_args(tp))
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, dict, tuple):
        args = get_args(tp)
        inner = ", ".join(_type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", repr(tp))


def _expected(tp: Any) -> str:
    """How a type is described in an error message."""
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return _type_name(tp)


def _show(value: Any) -> str:
    r = repr(value)
    if len(r) > 80:
        r = r[:77] + "..."
    return f"{r} ({type(value).__name__})"


def _in(where: str | None) -> str:
    return f" in {where}" if where else ""


def _type_error(key: str, expected: str, value: Any, where: str | None, hint: str = "") -> ConfigError:
    return ConfigError(f"{key}: expected {expected}, got {_show(value)}{_in(where)}{hint}", key=key)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field under a dataclass type."""
    out: list[str] = []
    hints = _hints(cls)
    for name in _init_fields(cls):
        key = f"{prefix}{name}"
        if _is_dataclass_type(hints[name]):
            out.extend(_all_keys(hints[name], key + "."))
        else:
            out.append(key)
    return out


def _all_sections(cls: type, prefix: str = "") -> list[str]:
    out: list[str] = []
    hints = _hints(cls)
    for name in _init_fields(cls):
        if _is_dataclass_type(hints[name]):
            out.append(f"{prefix}{name}")
            out.extend(_all_sections(hints[name], f"{prefix}{name}."))
    return out


@dataclass
class _Ctx:
    root: type
    where: str | None


def _unknown_error(cls: type, prefix: str, name: str, is_section: bool, ctx: _Ctx) -> ConfigError:
    """'unknown key 'train.lrr' in x.toml; did you mean 'train.lr'?' with the best suggestion we can find."""
    full = f"{prefix}{name}"
    hints = _hints(cls)
    siblings = list(_init_fields(cls))
    suggestion: str | None = None
    if is_section:
        candidates = [n for n in siblings if _is_dataclass_type(hints[n])]
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
        if close:
            suggestion = f"[{prefix}{close[0]}]"
        else:
            sections = _all_sections(ctx.root)
            close = difflib.get_close_matches(full, sections, n=1, cutoff=0.6)
            if close:
                suggestion = f"[{close[0]}]"
    else:
        # A value cannot be a section: suggest keys only ('lr' at the top is not [lora]). The same key in another
        # section comes first (train.release_memory is engine.release_memory, not the sibling train.check_memory a
        # spelling match would offer), then a sibling spelled alike.
        scalars = [n for n in siblings if not _is_dataclass_type(hints[n])]
        keys = _all_keys(ctx.root)
        same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == name]
        close = difflib.get_close_matches(name, scalars, n=1, cutoff=0.6)
        if same_leaf:
            suggestion = same_leaf[0]
        elif close:
            suggestion = f"{prefix}{close[0]}"
        else:
            leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
            close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.75)
            if close:
                suggestion = leaves[close[0]]
    shown = f"[{full}]" if is_section else full
    msg = f"unknown {'section' if is_section else 'key'} '{shown}'{_in(ctx.where)}"
    if suggestion is not None:
        msg += f"; did you mean '{suggestion}'?"
    else:
        valid = ", ".join(siblings)
        msg += f"; valid keys{f' in [{prefix[:-1]}]' if prefix else ''}: {valid}"
    return ConfigError(msg, key=full)


def _build(cls: type[_T], data: Any, prefix: str, ctx: _Ctx) -> _T:
    """Instantiate dataclass ``cls`` from a dict, type-checking every value."""
    if not isinstance(data, dict):
        raise _type_error(prefix[:-1] or "<root>", "table", data, ctx.where)
    fields = _init_fields(cls)
    hints = _hints(cls)
    for name, value in data.items():
        if name not in fields:
            raise _unknown_error(cls, prefix, str(name), isinstance(value, dict), ctx)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{prefix}{name}", ctx)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key '{prefix}{name}'{_in(ctx.where)}", key=f"{prefix}{name}")
    return cls(**kwargs)


def _convert(value: Any, tp: Any, key: str, ctx: _Ctx) -> Any:
    """Check ``value`` against annotation ``tp`` and return it (ints widened to float, lists copied)."""
    if tp is Any:
        return copy.deepcopy(value)
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise _type_error(key, "table", value, ctx.where)
        return _build(tp, value, key + ".", ctx)
    origin = get_origin(tp)
    if _is_union(tp):
        args = get_args(tp)
        optional = _NoneType in args
        if value is None and optional:
            return None
        if optional and isinstance(value, str) and value.strip().lower() in _NONE_WORDS:
            return None
        arms = [a for a in args if a is not _NoneType]
        first_error: ConfigError | None = None
        for arm in arms:
            try:
                return _convert(value, arm, key, ctx)
            except ConfigError as e:
                first_error = first_error or e
        if len(arms) == 1 and first_error is not None and first_error.key != key:
            raise first_error  # a nested element failed: its message is the precise one
        expected = _expected(arms[0]) if len(arms) == 1 else " | ".join(_type_name(a) for a in arms)
        if optional:
            expected += " or None" if len(arms) == 1 and get_origin(arms[0]) is Literal else " | None"
        raise _type_error(key, expected, value, ctx.where)
    if origin is Literal:
        allowed = get_args(tp)
        for a in allowed:
            if value == a and type(value) is type(a):
                return a
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [a for a in allowed if isinstance(a, str)], n=1)
            if close:
                hint = f"; did you mean {close[0]!r}?"
        raise _type_error(key, _expected(tp), value, ctx.where, hint)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, "bool", value, ctx.where)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(key, "int", value, ctx.where)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(key, "float", value, ctx.where)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(key, "str", value, ctx.where)
    if tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, _type_name(tp), value, ctx.where)
        (elem,) = get_args(tp) or (Any,)
        return [_convert(v, elem, f"{key}[{i}]", ctx) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _type_error(key, _type_name(tp), value, ctx.where)
        _, vt = get_args(tp) or (str, Any)
        return {str(k): _convert(v, vt, f"{key}.{k}", ctx) for k, v in value.items()}
    raise TypeError(f"{key}: unsupported annotation {tp!r} in a config dataclass")


def config_from_dict(d: dict[str, Any], cls: type[_T] = RunConfig, source: str | None = None) -> _T:  # type: ignore[assignment]
    """Build ``cls`` from a nested dict (as parsed from TOML); missing keys keep their defaults.

    Unknown keys/sections and wrong types raise :class:`ConfigError`; ``source`` (a file name) is named in
    the message. Does not run ``validate()``.
    """
    return _build(cls, d, "", _Ctx(root=cls, where=source))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The nested-dict form of a config dataclass (None values kept; lists copied)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"config_to_dict expects a dataclass instance, got {type(cfg).__name__}")
    return conv(cfg)


# ----------------------------------------------------------------------------------------------------------
# Overrides
# ----------------------------------------------------------------------------------------------------------


def _parse_literal(text: str) -> Any:
    """A TOML literal (``1e-5``, ``true``, ``[1, 2]``, ``"x"``), or the text itself when it is not one."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    return parsed["v"] if list(parsed) == ["v"] else text


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``"section.key=value"`` into the dotted key and the value parsed as a TOML literal."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override {item!r}: expected section.key=value")
    return key, _parse_literal(raw.strip())


def apply_overrides(cfg: _T, overrides: Iterable[str]) -> _T:
    """Return a copy of ``cfg`` with each ``section.key=value`` override applied and type-checked.

    The value is a TOML literal; when that does not fit the field's type, the raw text is tried as a string
    (so ``run.name=42`` gives ``"42"``) and as a Python number (``.5``). Does not run ``validate()``.
    """
    cfg = copy.deepcopy(cfg)
    root = type(cfg)
    for item in overrides:
        key, value = parse_override(item)
        raw = item.partition("=")[2].strip()
        ctx = _Ctx(root=root, where=f"--set {item}")
        parts = key.split(".")
        obj: Any = cfg
        prefix = ""
        for i, part in enumerate(parts):
            cls = type(obj)
            fields = _init_fields(cls)
            last = i == len(parts) - 1
            if part not in fields:
                raise _unknown_error(cls, prefix, part, not last, ctx)
            tp = _hints(cls)[part]
            if not last:
                if not _is_dataclass_type(tp):
                    raise ConfigError(
                        f"'{prefix}{part}' is not a section (in --set {item})", key=f"{prefix}{part}"
                    )
                obj = getattr(obj, part)
                prefix += part + "."
                continue
            if _is_dataclass_type(tp):
                raise ConfigError(
                    f"'{key}' is a section; set one of its keys, e.g. --set {key}.<key>=value", key=key
                )
            setattr(obj, part, _convert_override(value, raw, tp, key, ctx))
    return cfg


def _convert_override(value: Any, raw: str, tp: Any, key: str, ctx: _Ctx) -> Any:
    candidates: list[Any] = [value]
    if raw != value:
        candidates.append(raw)
    for number in (int, float):
        try:
            candidates.append(number(raw))
            break
        except ValueError:
            pass
    error: ConfigError | None = None
    for candidate in candidates:
        try:
            return _convert(candidate, tp, key, ctx)
        except ConfigError as e:
            error = error or e
    assert error is not None
    raise error


# ----------------------------------------------------------------------------------------------------------
# Loading and saving
# ----------------------------------------------------------------------------------------------------------


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    cls: type[_T] = RunConfig,  # type: ignore[assignment]
) -> _T:
    """Read a TOML config (``None`` = all defaults), apply ``section.key=value`` overrides, validate.

    Raises :class:`ConfigError` for invalid TOML, unknown keys, wrong types and failed checks.
    """
    if path is None:
        data: dict[str, Any] = {}
        source = None
    else:
        source = str(path)
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"invalid TOML in {source}: {e}") from e
    cfg = config_from_dict(data, cls, source=source)
    cfg = apply_overrides(cfg, overrides)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    if path is not None and isinstance(cfg, RunConfig):
        check_path_anchors(cfg, Path(path).resolve().parent)
    return cfg


# Relative paths: one rule. Every relative path of a run (run.output_dir, data, models, checkpoints, reward files,
# environment and reward modules), written in the config file, given with --set or with a flag, is resolved from
# the working directory, never from the config file's folder. That is what run.output_dir and the recipes'
# data and model paths always did, and what keeps a run's saved config.toml (in its output_dir, far from the
# original config) meaning the same files.
_PATH_KEYS = (
    "model.path",
    "model.tokenizer",
    "task.path",
    "task.eval_path",
    "sft.checkpoint",
    "lora.path",
    "reward.model",
)


def relative_path_refs(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """Every relative file or module a config names: (key, what is written, the path or module looked up)."""
    refs: list[tuple[str, str, str]] = []
    for key in _PATH_KEYS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section, None), name, None)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            refs.append((key, value, value))
    specs = [("reward.functions", f) for f in cfg.reward.functions if isinstance(f, str)]
    if cfg.env.name:
        specs.append(("env.name", cfg.env.name))
    for key, spec in specs:
        target, sep, _ = spec.rpartition(":")
        if not sep or not target:
            continue  # a built-in name
        if target.endswith(".py"):
            if not Path(target).expanduser().is_absolute():
                refs.append((key, spec, target))
        else:  # "package.module:attr": its top package is a file or folder on the import path
            refs.append((key, spec, "module:" + target.split(".")[0]))
    return refs


def _found_in(folder: Path, target: str) -> bool:
    if target.startswith("module:"):
        top = target[len("module:") :]
        return (folder / f"{top}.py").is_file() or (folder / top).is_dir()
    return (folder / Path(target).expanduser()).exists()


def check_path_anchors(cfg: RunConfig, config_dir: Path, cwd: Path | None = None) -> None:
    """Refuse a relative path that is missing from the working directory but present next to the config file:
    the one mistake the working-directory rule invites. Raises ConfigError naming the key, both places and the
    path to write instead. A path found in neither place is left to whatever loads it (that names the file)."""
    import importlib.util

    cwd = (cwd or Path.cwd()).resolve()
    if config_dir.resolve() == cwd:
        return
    for key, written, target in relative_path_refs(cfg):
        if _found_in(cwd, target) or not _found_in(config_dir, target):
            continue
        if target.startswith("module:"):
            module = target[len("module:") :]
            if importlib.util.find_spec(module) is not None:
                continue  # importable as installed: the file next to the config is not what it names
            fix = f"move it into the working directory, or run exactrl from {config_dir}"
            what = f"module {module!r}"
        else:
            rel = os.path.relpath(config_dir / target, cwd)
            fix = f"write {written.replace(target, rel, 1)!r}"
            what = repr(target)
        _fail(
            key,
            f"= {written!r}: {what} is not in the working directory {cwd} but is next to the config file, in "
            f"{config_dir}. Relative paths are resolved from the working directory: {fix}",
        )


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_str(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest repr round-trips exactly; inf/nan/1e-05 are valid TOML
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None)
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} as TOML")


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _toml_tree(obj: Any) -> Any:
    """Dataclasses -> dicts. None is omitted when it is the default, else written as the string "none"."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            v = getattr(obj, f.name)
            if v is None:
                if _default_of(f) is not None:
                    out[f.name] = "none"
                continue
            out[f.name] = _toml_tree(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [_toml_tree(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _toml_tree(x) for k, x in obj.items()}
    return obj


def _write_table(lines: list[str], table: dict[str, Any], path: list[str]) -> None:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, dict)]
    if path and (scalars or not tables):
        lines.append("")
        lines.append("[" + ".".join(_toml_key(p) for p in path) + "]")
    for k, v in scalars:
        lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    for k, v in tables:
        _write_table(lines, v, [*path, k])


def dump_toml(cfg: Any) -> str:
    """Serialise a config dataclass to TOML, every field included; ``load(dump(cfg)) == cfg``."""
    tree = _toml_tree(cfg)
    if not isinstance(tree, dict):
        raise TypeError(f"dump_toml expects a dataclass instance, got {type(cfg).__name__}")
    lines: list[str] = []
    _write_table(lines, tree, [])
    return "\n".join(lines).lstrip("\n") + "\n"


def save_config(cfg: Any, path: str | Path) -> None:
    """Write ``dump_toml(cfg)`` to ``path`` atomically, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_toml(cfg), encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------
# Field documentation
# ----------------------------------------------------------------------------------------------------------


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    docs: dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` for every field of dataclass ``cls`` ("" where a field has none).

    The docstring of a field is the string literal written right after it in the class body.
    """
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _md_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _md_default(f: dataclasses.Field[Any]) -> str:
    d = _default_of(f)
    if d is dataclasses.MISSING:
        return "*required*"
    if d is None:
        return "*unset*"
    return "`" + _md_cell(_toml_value(_toml_tree(d))) + "`"


def _md_tables(cls: type, prefix: str, doc: str, out: list[str]) -> None:
    hints = _hints(cls)
    docs = field_docs(cls)
    fields = list(_init_fields(cls).values())
    leaves = [f for f in fields if not _is_dataclass_type(hints[f.name])]
    if leaves:
        out.append(f"## `[{prefix}]`" if prefix else "## Top-level keys")
        out.append("")
        if doc:
            out.append(" ".join(doc.split()))
            out.append("")
        out.append("| Key | Type | Default | Description |")
        out.append("| --- | --- | --- | --- |")
        for f in leaves:
            typ = _md_cell(_type_name(hints[f.name]))
            out.append(f"| `{f.name}` | `{typ}` | {_md_default(f)} | {_md_cell(docs[f.name])} |")
        out.append("")
    for f in fields:
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            sub_doc = docs[f.name] or inspect.cleandoc(tp.__doc__ or "")
            _md_tables(tp, f"{prefix}.{f.name}" if prefix else f.name, sub_doc, out)


def config_reference_markdown(cls: type = RunConfig) -> str:
    """A Markdown reference of every config key: one table (key, type, default, description) per section."""
    out = [
        "# Configuration reference",
        "",
        "A run is configured by one TOML file with the sections below; every key is optional and defaults to",
        "the value shown. Override any key on the command line with `--set section.key=value` (the value is a",
        "TOML literal: `--set train.lr=3e-6`, `--set sampling.stop='[\"\\n\"]'`; a bare word is a string).",
        "On keys that may be unset, `none` unsets them.",
        "",
        f"<!-- generated by `python -m exactrl.config` from `exactrl.config.{cls.__qualname__}` -->",
        "",
    ]
    _md_tables(cls, "", "", out)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":  # pragma: no cover
    if "--toml" in sys.argv[1:]:
        sys.stdout.write(dump_toml(RunConfig()))
    else:
        sys.stdout.write(config_reference_markdown())
