"""Per-token estimators of KL(pi || ref) from the log-probabilities of tokens sampled from pi.

Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html. With
log r = logprobs - ref_logprobs (so ref/pi = exp(-log r)):

    k1 = log r                          unbiased, high variance, can be negative per token
    k2 = 0.5 * (log r)^2                biased, low variance, >= 0
    k3 = exp(-log r) - 1 + log r        unbiased, low variance, >= 0 ("low_var_kl" in verl)

The sample must come from the first argument's distribution for the estimate to mean KL(first || second).

`KLController` holds the penalty coefficient across steps (fixed, or adaptive as in Ziegler et al. 2019).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = ["KL_CONTROLLERS", "KLController", "kl_estimate", "K3_LOG_RATIO_CLAMP", "K3_OUTPUT_CLAMP"]

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


KL_CONTROLLERS = ("fixed", "adaptive")


class KLController:
    """The KL-penalty coefficient beta across steps: "fixed" keeps it, "adaptive" steers the measured KL towards a
    target (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593, Sec. 2.2):

        e = clip(KL / target - 1, -0.2, 0.2),   beta <- beta * (1 + e * n / horizon),

    where KL is the step's measured KL to the reference policy and n the number of sequences the step trained on.
    The clip bounds the change per sequence; beta grows while the policy drifts beyond the target and shrinks while
    it stays closer.

    This is the one stateful object of `exactrl.algorithms`: its state (the current beta) is part of a run's
    checkpoint (`state_dict` / `load_state_dict`: plain floats, JSON-serialisable), so a resumed run continues with
    the coefficient it had, not the initial one.
    """

    def __init__(self, kind: str, init_coef: float, *, target: float = 0.1, horizon: int = 10_000) -> None:
        if kind not in KL_CONTROLLERS:
            raise ValueError(f"kind must be one of {KL_CONTROLLERS}, got {kind!r}")
        if not (math.isfinite(init_coef) and init_coef >= 0):
            raise ValueError(f"init_coef must be finite and >= 0, got {init_coef!r}")
        if kind == "adaptive":
            if not init_coef > 0:
                raise ValueError(
                    "an adaptive KL controller needs init_coef > 0 (it scales beta multiplicatively)"
                )
            if not (math.isfinite(target) and target > 0):
                raise ValueError(f"target must be > 0, got {target!r}")
            if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
                raise ValueError(f"horizon must be a positive int, got {horizon!r}")
        self.kind, self.target, self.horizon = kind, float(target), horizon
        self.value = float(init_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Fold in one step's measured KL (a float, e.g. the trainer's `kl_ref` metric) over n_steps sequences;
        returns the new coefficient. A non-finite KL leaves the coefficient unchanged (that step was skipped)."""
        if self.kind == "adaptive" and math.isfinite(current_kl):
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float | int | str]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float | int | str]) -> None:
        """Restore `state_dict()`. The kind must match: resuming a fixed-beta run as adaptive (or the reverse) is a
        configuration change, refused rather than silently mixed."""
        if state.get("kind") != self.kind:
            raise ValueError(
                f"KL controller state is for kind {state.get('kind')!r}, this controller is {self.kind!r}"
            )
        value = float(state["value"])
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"KL controller state has an invalid value {value!r}")
        self.value = value
