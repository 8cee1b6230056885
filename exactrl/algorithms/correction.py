"""Rollout correction and rollout/trainer mismatch metrics.

In exact mode the rollout engine and the trainer compute bitwise-identical log-probabilities, so the behaviour
policy is the old policy and nothing here is needed beyond checking `mismatch_metrics` reads 0 mismatched tokens.
In fast mode they differ, and the samples come from pi_rollout while the PPO ratio is taken against the trainer's
pi_old. The correction reweights (or drops) tokens by rho = pi_old / pi_rollout = exp(old - rollout):

  * "token-tis": w_t = min(rho_t, threshold)                        truncated IS, per token (Yao et al. 2025)
  * "seq-tis":   w_i = min(rho_i, threshold), rho_i = prod_t rho_t  truncated IS, per sequence
  * "token-mis": keep token t iff low <= rho_t <= threshold; w_t = rho_t on kept tokens (masked IS)
  * "seq-mis":   keep sequence i iff low <= rho_i <= threshold; w = rho_i on its tokens
  * "icepop":    token-level masking with both bounds (Ring-1T's IcePop, M(rho) = rho inside [low, threshold],
                 0 outside). It is the same computation as "token-mis", offered under its paper's name.
  * None:        no correction (weights None, mask unchanged).

low = low_threshold, default 1 / threshold; pass low_threshold=0 for upper-only masking (the original MIS).
Masking modes return the IS weight as well as the reduced mask, as in masked IS and IcePop; a caller that wants
pure rejection can ignore the weights. Weights are constants (no gradient) and 0 at masked positions; they are
meant for `policy_loss(..., is_weights=weights)` together with `mask=new_mask`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from exactrl.algorithms.kl import kl_estimate
from exactrl.algorithms.metrics import masked_count, masked_mean, masked_sum, scalars_to_floats

__all__ = ["CORRECTION_MODES", "rollout_correction", "mismatch_metrics"]

CorrectionMode = Literal["token-tis", "seq-tis", "token-mis", "seq-mis", "icepop"]
CORRECTION_MODES: tuple[str | None, ...] = ("token-tis", "seq-tis", "token-mis", "seq-mis", "icepop", None)

# Same safety bound as the policy ratio: exp of a log ratio beyond +-20 is clamped so a sequence-level product of
# thousands of token ratios cannot overflow. Thresholds are compared in log space, so the clamp never changes
# which tokens are kept or truncated (for thresholds below e^20).
_LOG_RATIO_CLAMP = 20.0


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: CorrectionMode | None = "token-tis",
    threshold: float = 2.0,
    low_threshold: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """old_logprobs [B, T] (trainer's pi_old), rollout_logprobs [B, T] (engine's), mask [B, T] ->
    (weights [B, T] or None, new_mask [B, T] (same dtype as mask), metrics). See the module docstring for modes.

    Metrics, all under `rollout_corr/`: ratio_mean|min|max of rho at the mode's level (over valid tokens for token
    modes and None, over non-empty sequences for seq modes), clipped_frac (TIS: fraction of those units with
    rho > threshold; 0 otherwise), masked_frac (fraction of valid tokens removed from the mask) and
    masked_seq_frac (fraction of non-empty sequences that lost at least one token).
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"mode must be one of {CORRECTION_MODES}, got {mode!r}")
    if not threshold >= 1.0:
        raise ValueError(f"threshold must be >= 1 (a ratio of 1 must always pass), got {threshold!r}")
    is_tis = mode in ("token-tis", "seq-tis")
    if low_threshold is not None:
        if is_tis or mode is None:
            raise ValueError(f"low_threshold only applies to the masking modes, not mode={mode!r}")
        if not 0.0 <= low_threshold <= 1.0:
            raise ValueError(f"low_threshold must be in [0, 1], got {low_threshold!r}")
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != mask.shape or mask.dim() != 2:
        raise ValueError(
            "old_logprobs, rollout_logprobs and mask must all be [B, T]; got "
            f"{tuple(old_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )

    m = mask.bool()
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    log_rho_tok = torch.where(m, (old_logprobs - rollout_logprobs).detach(), zero)
    seq_level = mode in ("seq-tis", "seq-mis")
    if seq_level:
        log_rho = masked_sum(log_rho_tok, m, dim=-1).unsqueeze(-1).expand_as(log_rho_tok)  # log prod_t rho_t
    else:
        log_rho = log_rho_tok
    rho = torch.exp(log_rho.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))

    log_hi = math.log(threshold)
    weights: torch.Tensor | None = None
    new_mask = mask
    clipped = torch.zeros_like(m)
    if is_tis:
        clipped = log_rho > log_hi
        weights = torch.where(m, rho.clamp(max=threshold), zero)
    elif mode is not None:
        low = 1.0 / threshold if low_threshold is None else low_threshold
        log_lo = math.log(low) if low > 0 else -math.inf
        keep = m & (log_rho <= log_hi) & (log_rho >= log_lo)
        weights = torch.where(keep, rho, zero)
        new_mask = keep.to(mask.dtype)

    # Statistics at the level the mode acts on: one unit per valid token, or one per non-empty sequence.
    if seq_level:
        units = masked_count(m, dim=-1) > 0
        unit_rho, unit_clipped = rho[:, 0], clipped[:, 0]
    else:
        units, unit_rho, unit_clipped = m, rho, clipped
    inf = torch.tensor(float("inf"), dtype=rho.dtype, device=rho.device)
    dropped = m & ~new_mask.bool()
    non_empty = masked_count(m, dim=-1) > 0
    metrics = scalars_to_floats(
        {
            "rollout_corr/ratio_mean": masked_mean(unit_rho, units),
            "rollout_corr/ratio_min": torch.where(units, unit_rho, inf).min(),
            "rollout_corr/ratio_max": torch.where(units, unit_rho, -inf).max(),
            "rollout_corr/clipped_frac": masked_mean(unit_clipped.to(rho.dtype), units),
            "rollout_corr/masked_frac": masked_mean(dropped.to(rho.dtype), m),
            "rollout_corr/masked_seq_frac": masked_mean(dropped.any(dim=-1).to(rho.dtype), non_empty),
        }
    )
    return weights, new_mask, metrics


def mismatch_metrics(
    rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens are from the engine's. rollout_logprobs,
    trainer_logprobs, mask: [B, T] -> exactly these keys (over valid tokens; all computed in float64):

      mismatch/num_tokens               number of valid tokens
      mismatch/num_mismatched_tokens    tokens where the two values are not bitwise equal (`!=`; NaN counts)
      mismatch/logprob_abs_diff_max     max |trainer - rollout|
      mismatch/logprob_abs_diff_mean    mean |trainer - rollout|
      mismatch/token_mult_prob_error    mean exp(|trainer - rollout|): the multiplicative per-token probability
                                        error, NeMo-RL's definition of this metric. It is 1.0 (not 0) when the two
                                        agree, and ~1 + mean|diff| for small differences.
      mismatch/kl_k3                    mean k3 estimate of KL(pi_rollout || pi_trainer): the tokens were sampled
                                        from the rollout policy (verl's / NeMo-RL's "vllm-kl", gen_kl_error).
                                        Uses `kl_estimate`, so per-token values are clamped to [-10, 10].

    With no valid token every value is 0 except token_mult_prob_error, which is 1 (the no-error value).
    """
    if rollout_logprobs.shape != trainer_logprobs.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError(
            "rollout_logprobs, trainer_logprobs and mask must have the same shape; got "
            f"{tuple(rollout_logprobs.shape)}, {tuple(trainer_logprobs.shape)}, {tuple(mask.shape)}"
        )
    m = mask.bool()
    # Bitwise comparison on the original dtype, before any cast could merge or split values.
    mismatched = m & (rollout_logprobs.detach() != trainer_logprobs.detach())
    roll = rollout_logprobs.detach().to(torch.float64)
    train = trainer_logprobs.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=roll.device)
    roll = torch.where(m, roll, zero)
    train = torch.where(m, train, zero)
    abs_diff = (train - roll).abs()
    n = masked_count(m)
    return scalars_to_floats(
        {
            "mismatch/num_tokens": n,
            "mismatch/num_mismatched_tokens": mismatched.sum(),
            "mismatch/logprob_abs_diff_max": torch.where(m, abs_diff, zero).max()
            if abs_diff.numel()
            else zero,
            "mismatch/logprob_abs_diff_mean": masked_mean(abs_diff, m),
            "mismatch/token_mult_prob_error": torch.where(
                n > 0,
                masked_mean(torch.exp(abs_diff), m),
                torch.ones((), dtype=torch.float64, device=roll.device),
            ),
            "mismatch/kl_k3": masked_mean(kl_estimate(roll, train, "k3"), m),
        }
    )
