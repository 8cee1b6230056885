"""The `[algorithm]` section: the RL objective, and the names of its estimators, losses and presets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from exactrl.config.errors import _check_at_least, _check_nonneg, _check_positive, _fail

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
Overlap = Literal["none", "tail"]
DynamicSampling = Literal["off", "reward", "accuracy"]

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
