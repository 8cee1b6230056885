"""The pure math of policy-gradient post-training: advantages, losses, KL estimators, rollout correction, metrics.

Every function here is pure: tensors in, tensors (and a `dict[str, float]` of metrics) out, no hidden state. The
one object with state, `KLController` (the adaptive KL coefficient), shows it through `state_dict`.
The RL loop calls `compute_advantages` (by `algorithm.advantage`) and the trainer `policy_loss_terms` (by
`algorithm.policy_loss`); docs/algorithms.md lists the menu.
Token tensors are padded `[B, T]` with a `mask` whose nonzero entries mark the response tokens that count.
"""

from exactrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    SEQUENCE_ESTIMATORS,
    compute_advantages,
    gae,
    gae_advantages,
    gpg_advantages,
    grpo_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    weighted_whiten,
)
from exactrl.algorithms.correction import CORRECTION_MODES, mismatch_metrics, rollout_correction
from exactrl.algorithms.kl import (
    K3_LOG_RATIO_CLAMP,
    K3_OUTPUT_CLAMP,
    KL_CONTROLLERS,
    KLController,
    kl_estimate,
)
from exactrl.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSS_KINDS,
    aggregate,
    decoupled_is_weights,
    decoupled_weights_and_capped,
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
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_CONTROLLERS",
    "KLController",
    "SEQUENCE_ESTIMATORS",
    "compute_advantages",
    "gae_advantages",
    "gpg_advantages",
    "opo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "weighted_whiten",
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
    "decoupled_is_weights",
    "decoupled_weights_and_capped",
    "scalars_to_floats",
    "value_loss",
]
