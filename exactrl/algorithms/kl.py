"""Per-token estimators of KL(pi || ref) from the log-probabilities of tokens sampled from pi.

Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html. With
log r = logprobs - ref_logprobs (so ref/pi = exp(-log r)):

    k1 = log r                          unbiased, high variance, can be negative per token
    k2 = 0.5 * (log r)^2                biased, low variance, >= 0
    k3 = exp(-log r) - 1 + log r        unbiased, low variance, >= 0 ("low_var_kl" in verl)

The sample must come from the first argument's distribution for the estimate to mean KL(first || second).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["kl_estimate", "K3_LOG_RATIO_CLAMP", "K3_OUTPUT_CLAMP"]

KlKind = Literal["k1", "k2", "k3"]
_KINDS = ("k1", "k2", "k3")

# k3 exponentiates the log ratio. As in verl, the log ratio is clamped to [-20, 20] before exp (exp(20) ~ 5e8 still
# fits float32 comfortably; an unbounded exp overflows to inf for a single badly-mismatched token) and the result
# is clamped to [-10, 10] so one outlier token cannot dominate a mean or a gradient step. Inside the clamps the
# value and gradient are exact; outside, the gradient is 0.
K3_LOG_RATIO_CLAMP = 20.0
K3_OUTPUT_CLAMP = 10.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KlKind = "k3") -> torch.Tensor:
    """logprobs, ref_logprobs: [B, T] float -> per-token KL estimate [B, T] (no masking, no reduction).

    Differentiable with respect to both inputs. See the module docstring for the formulas and the k3 clamps
    (log ratio to [-20, 20] before exp, output to [-10, 10]).
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs and ref_logprobs must have the same shape, got {tuple(logprobs.shape)} "
            f"and {tuple(ref_logprobs.shape)}"
        )
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    lr = log_ratio.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(-lr) - 1.0 + lr).clamp(-K3_OUTPUT_CLAMP, K3_OUTPUT_CLAMP)
