"""`RunConfig`: every section together, and the checks that span sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from exactrl.config.algorithm import AlgorithmConfig
from exactrl.config.engine import EngineConfig, SamplingConfig
from exactrl.config.errors import _fail
from exactrl.config.model import LoraConfig, ModelConfig
from exactrl.config.run import RunSection
from exactrl.config.task import EnvConfig, RewardConfig, TaskConfig
from exactrl.config.train import DistributedConfig, SFTConfig, TrainConfig

if TYPE_CHECKING:
    import torch


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
