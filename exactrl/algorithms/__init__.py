"""The pure math of policy-gradient post-training: advantages, losses, KL estimators, rollout correction, metrics.

Every function here is pure: tensors in, tensors (and a `dict[str, float]` of metrics) out, no hidden state.
Token tensors are padded `[B, T]` with a `mask` whose nonzero entries mark the response tokens that count.
"""

from exactrl.algorithms.advantages import gae, grpo_advantages, rloo_advantages
from exactrl.algorithms.correction import CORRECTION_MODES, mismatch_metrics, rollout_correction
from exactrl.algorithms.kl import K3_LOG_RATIO_CLAMP, K3_OUTPUT_CLAMP, kl_estimate
from exactrl.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSS_KINDS,
    aggregate,
    policy_loss,
    policy_loss_terms,
    value_loss,
)
from exactrl.algorithms.metrics import (
    advantage_metrics,
    masked_count,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_length_metrics,
    reward_metrics,
    scalars_to_floats,
)

__all__ = [
    "AGGREGATIONS",
    "CORRECTION_MODES",
    "K3_LOG_RATIO_CLAMP",
    "K3_OUTPUT_CLAMP",
    "POLICY_LOSS_KINDS",
    "advantage_metrics",
    "aggregate",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "masked_count",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "policy_loss",
    "policy_loss_terms",
    "response_length_metrics",
    "reward_metrics",
    "rloo_advantages",
    "rollout_correction",
    "scalars_to_floats",
    "value_loss",
]
