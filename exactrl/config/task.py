"""The `[task]`, `[reward]` and `[env]` sections: the prompts, how completions are scored, and multi-turn
environments."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from exactrl.config.errors import _check_at_least, _check_nonneg, _check_positive, _fail

TaskName = Literal["arithmetic", "jsonl", "parquet"]

ARITHMETIC_OPS = ("+", "-", "*")


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
