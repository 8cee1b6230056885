"""Policy and value losses, and the reduction of a per-token loss matrix to a scalar.

All losses are *minimised*. Inputs are padded `[B, T]` tensors with a `mask` (nonzero = response token that counts);
values at masked positions are never read (see `metrics.py`), so padding may hold anything, including -inf.

Microbatching. A step is often cut into microbatches whose gradients are accumulated. Each aggregation is
numerator / denominator, where the numerator is a sum over the microbatch; passing the *whole step's* denominator
as `loss_divisor` (e.g. the step's total valid-token count for token-mean) makes the microbatch losses add up to
the full-batch loss, so the accumulated gradient does not depend on how the step was cut. Without it each
microbatch divides by its own count, which re-weights tokens across microbatches.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from exactrl.algorithms.kl import kl_estimate
from exactrl.algorithms.metrics import masked_count, masked_mean, masked_sum, masked_var, scalars_to_floats
from exactrl.config import Aggregation, PolicyLossName

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSS_KINDS",
    "aggregate",
    "decoupled_is_weights",
    "decoupled_weights_and_capped",
    "policy_loss",
    "policy_loss_terms",
    "value_loss",
]

PolicyLossKind = Literal["ppo_clip", "ppo", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "gmpo"]
Divisor = float | int | torch.Tensor

AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)  # the config's list (algorithm.aggregation)
# Names as in verl's `actor.policy_loss.loss_mode` (verl calls GMPO "geo_mean" and PPO-clip "vanilla").
POLICY_LOSS_KINDS: tuple[str, ...] = get_args(PolicyLossName)  # the config's list (algorithm.policy_loss)
# "ppo" was the PPO-clip kind's name before the menu; the trainer and older callers still pass it.
_KIND_ALIASES = {"ppo": "ppo_clip"}

# The importance ratio is exp(log ratio); as in verl the log ratio is clamped first so one token whose probability
# moved by e^20 (or whose log-prob is garbage) cannot overflow to inf and turn the whole loss into NaN.
_LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------------- validation


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_divisor(name: str, value: Divisor | None) -> None:
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        # Not checked for > 0: that would need a device sync; a tensor divisor is the trainer's own count.
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number or a scalar tensor, got {value!r}")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    first_name, first = next(iter(shapes.items()))
    if len(first) != 2:
        raise ValueError(f"{first_name} must be [B, T], got shape {first}")
    for k, s in shapes.items():
        if s != first:
            raise ValueError(f"{k} has shape {s}, expected {first} (the shape of {first_name})")


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] advantages -> [B, T], detached (advantages are targets, never differentiated)."""
    if advantages.shape == like.shape:
        return advantages.detach()
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.detach().unsqueeze(-1).expand_as(like)
    raise ValueError(
        f"advantages must be [B] or [B, T] = {tuple(like.shape)}, got shape {tuple(advantages.shape)}"
    )


def _zero_masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # Replace padding by 0 before any arithmetic: exp(-inf - -inf) = NaN would otherwise reach the backward pass
    # through exp's derivative even though the forward masks it out.
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


# -------------------------------------------------------------------------------------------------- aggregation


def _aggregate_parts(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, norm_constant: Divisor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, default denominator) of an aggregation. The numerator is a plain sum over this batch, so it is
    additive across microbatches; the denominator is what the mode divides by when no divisor is given."""
    m = mask.bool()
    if mode == "token-mean":
        return masked_sum(loss_mat, m), masked_count(m)
    per_seq = masked_sum(loss_mat, m, dim=-1)  # [B]
    n_tok = masked_count(m, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / n_tok.clamp(min=1).to(per_seq.dtype)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / (loss_mat.shape[-1] if norm_constant is None else norm_constant)
    # Sequences without a valid token (padding rows, or rows dropped by rollout correction) are not counted.
    return per_seq.sum(), (n_tok > 0).sum()


def _divide(
    numerator: torch.Tensor,
    default_denominator: torch.Tensor,
    divisor: Divisor | None,
    grad_divisor: Divisor | None,
) -> torch.Tensor:
    """numerator / divisor, with the gradient optionally scaled as numerator / grad_divisor instead.

    loss = num / grad_divisor + sg(num / divisor - num / grad_divisor): the value is num / divisor and the gradient
    is that of num / grad_divisor. This lets a trainer report a loss on one scale (e.g. per token) while the
    backward pass uses another (e.g. a divisor that also folds in data-parallel world size).
    """
    dtype, device = numerator.dtype, numerator.device
    den = (
        default_denominator.clamp(min=1).to(dtype)
        if divisor is None
        else torch.as_tensor(divisor, dtype=dtype, device=device)
    )
    value = numerator / den
    if grad_divisor is None:
        return value
    for_grad = numerator / torch.as_tensor(grad_divisor, dtype=dtype, device=device)
    return for_grad + (value - for_grad).detach()


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation = "token-mean",
    *,
    divisor: Divisor | None = None,
    norm_constant: Divisor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss loss_mat: [B, T] with mask: [B, T] to a 0-d tensor (names as in verl's loss_agg_mode).

    Let s_i = sum of loss_mat over valid tokens of row i, n_i its number of valid tokens, S the number of rows with
    n_i > 0:
      * "token-mean":              sum_i s_i / sum_i n_i             (DAPO; every token weighs the same)
      * "seq-mean-token-mean":     sum_i (s_i / n_i) / S             (GRPO paper; every sequence weighs the same)
      * "seq-mean-token-sum":      sum_i s_i / S
      * "seq-mean-token-sum-norm": sum_i (s_i / C) / S, C = norm_constant or T (Dr.GRPO: a constant, e.g. the max
                                   response length, so no length bias is introduced)

    divisor, if given, replaces the denominator (sum_i n_i for token-mean, S for the seq-* modes): pass the whole
    optimizer step's count so the result is independent of microbatching. For seq-mean-token-sum-norm pass
    norm_constant too, since the default C = T depends on each microbatch's padding.
    """
    _check_choice("mode", mode, AGGREGATIONS)
    _check_divisor("divisor", divisor)
    _check_divisor("norm_constant", norm_constant)
    _check_same_shape(loss_mat=loss_mat, mask=mask)
    num, den = _aggregate_parts(loss_mat, mask, mode, norm_constant)
    return _divide(num, den, divisor, None)


# ------------------------------------------------------------------------------------------------- policy loss


def _token_hash(old_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, T] float -> [B, T] int64 in [0, 2^32): a deterministic pseudo-random key per token, mixed from the bits
    of its old log-prob (float32) and its position. Clip-Cov picks among its candidate tokens in this order: a
    random choice without RNG state, so the choice replays bit for bit and nothing stateful enters a captured CUDA
    graph. Multipliers stay below 2^31 so every product fits int64 without overflow."""
    m32 = 0xFFFFFFFF
    bits = old_logprobs.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & m32
    idx = torch.arange(old_logprobs.numel(), device=old_logprobs.device, dtype=torch.int64).view_as(bits)
    h = (bits ^ ((idx * 0x27D4EB2F) & m32)) & m32
    for _ in range(3):  # the xor-shift-multiply mixing rounds of a common 32-bit integer hash
        h = ((h >> 16) ^ h) & m32
        h = (h * 0x45D9F3B) & m32
    return (h >> 16) ^ h


def _top_k_mask(score: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the k eligible entries of largest score (ties: lower flat index first). k is a 0-d tensor.

    Fixed shapes and no host read (a stable sort, then each entry's rank compared with k), so it runs inside a
    captured CUDA graph even though k and the number of eligible tokens depend on the data."""
    low = -torch.inf if score.is_floating_point() else torch.iinfo(score.dtype).min
    key = torch.where(eligible, score, torch.full((), low, dtype=score.dtype, device=score.device)).reshape(
        -1
    )
    order = torch.sort(key, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return eligible & (rank.view_as(eligible) < k)


def _covariance(adv: torch.Tensor, logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per-token centred cross product (A_t - mean A)(log pi_t - mean log pi) over the valid tokens of the call: the
    token's contribution to Cov(log pi, A), which drives the entropy change under a policy-gradient step (Cui et al.
    2025). Detached: it only selects tokens."""
    a = adv.detach()
    lp = logp.detach()
    return (a - masked_mean(a, m)) * (lp - masked_mean(lp, m))


def policy_loss_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: PolicyLossKind = "ppo_clip",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    cispo_eps_high: float = 0.28,
    cispo_eps_low: float | None = None,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 1.0,
    aggregation: Aggregation = "token-mean",
    loss_divisor: Divisor | None = None,
    grad_divisor: Divisor | None = None,
    norm_constant: Divisor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss and its metrics as 0-d tensors (no device sync, no data-dependent Python branch: CUDA-
    graph capturable). `policy_loss` is the same with the metrics as floats.

    Shapes: logprobs [B, T] float32 (current policy, differentiable), old_logprobs [B, T] float32 (the policy that
    the advantages were computed for; treated as constant), advantages [B, T] or [B] (broadcast over tokens;
    constant), mask [B, T]. is_weights [B, T] (optional, constant): per-token multipliers of the loss, e.g. the
    rollout-correction weights from `rollout_correction`.

    Every ratio is exp of a log ratio clamped to [-20, 20] (as verl), so one wild token cannot overflow to inf.
    r_t = exp(logprobs_t - old_logprobs_t) below. kind (names as in verl's `policy_loss.loss_mode`; "ppo" is
    accepted for "ppo_clip"):

    "ppo_clip" -- PPO-clip with clip-higher (Schulman et al. 2017; DAPO's eps_high > eps_low),
        loss_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)).
      dual_clip = c > 1 (Ye et al. 2019, as in verl): for A < 0 the loss is additionally capped,
        loss_t = min(loss_t, -c A), so a token whose ratio exploded under a negative advantage cannot push
        arbitrarily hard (its gradient becomes 0 once r_t > c).
    "gspo" -- GSPO (Zheng et al. 2025, arXiv:2507.18071). Sequence ratio s_i = exp(mean over valid tokens of the
      log ratio), used in the paper's per-token stop-gradient form log s_i,t = sg(log s_i) + logprobs_t -
      sg(logprobs_t): the value of s_i,t is s_i, its gradient is s_i * grad(logprobs_t). The PPO-clip surrogate is
      then applied to s_i,t with eps_low/eps_high (GSPO uses ~3e-4/4e-4; set them explicitly). With a [B] advantage
      (constant over each row) the gradient is exactly that of the sequence-level objective -A_i * clip(s_i), under
      every aggregation (all of them weigh a row's tokens equally). With a [B, T] advantage it is the paper's
      GSPO-token variant: each token's clip decision and gradient use its own A_t. dual_clip also applies.
    "cispo" -- CISPO (MiniMax-M1, 2025, arXiv:2506.13585). The ratio is clipped and detached and multiplies a
      REINFORCE term:
        loss_t = -sg(clip(r_t, max=1 + cispo_eps_high, min=1 - cispo_eps_low)) * A * logprobs_t,
      with no lower bound unless cispo_eps_low is given (the paper sets the lower bound out of reach). No token
      ever loses its gradient; clipping only caps its weight. The loss *value* is not a surrogate objective (it
      contains logprobs itself), only its gradient is meaningful. eps_low/eps_high are unused. The default
      cispo_eps_high = 0.28 is DAPO's clip-higher value, a starting point to tune (the paper does not publish its
      own).
    "sapo" -- SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347). The hard clip is
      replaced by a smooth gate, f(r) = (4 / tau) * sigmoid(tau (r - 1)),
        loss_t = -f(r_t) A_t,   tau = sapo_tau_pos where A_t > 0, sapo_tau_neg elsewhere
      (the paper's 1.0 and 1.05: negative advantages are damped faster). At r = 1 the gradient equals the plain
      policy gradient (f'(1) = 1); it decays smoothly as r leaves 1 instead of dropping to 0 at a clip edge.
    "clip_cov" -- Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
      Language Models", arXiv:2505.22617). The PPO-clip loss, except that a few tokens with a large covariance
      term cov_t = (A_t - mean A)(logprobs_t - mean logprobs) (means over this call's valid tokens) lose their
      gradient: among the valid tokens not already clipped with clip_cov_lb < cov_t < clip_cov_ub, k =
      max(1, floor(clip_cov_ratio * valid tokens)) are picked in a pseudo-random order (`_token_hash`) and their
      loss is detached (its value kept). High-covariance tokens are the ones whose update collapses entropy.
    "kl_cov" -- KL-Cov (same paper). The unclipped surrogate -A r_t, plus a KL penalty kl_cov_coef * |log r_t| on
      the k = max(1, floor(kl_cov_ratio * valid tokens)) valid tokens of largest cov_t (exactly the top k; ties
      broken by position).
      Note for both: the means, the count and the choice are over the tokens of this call (a microbatch in the
      trainer), as in verl; these two losses are the only ones whose gradient depends on how a step is cut.
    "gmpo" -- GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673). One ratio per
      sequence, the geometric mean of the token ratios, each clipped pessimistically in log space:
        l_t = sgn(A_i) min(sgn(A_i) log r_t, sgn(A_i) clip(log r_t, -eps_low, eps_high)),
        rho_i = exp(mean over valid tokens of l_t),   loss of row i = -A_i rho_i,
      where A_i is the row's mean advantage over its valid tokens (the paper's sequence-level advantage). eps_low and
      eps_high bound the *log* ratio here (the paper uses 0.4: ratios within [e^-0.4, e^0.4]). The row's loss is
      put on each of its valid tokens, so "seq-mean-token-mean" gives the paper's mean over sequences and the other
      aggregations weigh rows as they do for every loss.

    dual_clip applies to ppo_clip and gspo only (refused for the others).

    aggregation, loss_divisor, norm_constant: see `aggregate`; loss_divisor replaces the aggregation's denominator.
    grad_divisor: the returned loss has the value numerator / loss_divisor but the gradient of
    numerator / grad_divisor (see `_divide`).

    Metrics (over valid tokens; r is the ratio the loss used: r_t, or the sequence ratio on every token of its row
    for gspo and gmpo): pg_loss (the returned value), ratio/mean|min|max, ratio/sum and ratio/sum_sq (to combine
    microbatches exactly), clip_frac = clip_frac/low + clip_frac/high, where clip_frac/low counts tokens with A < 0
    and r < 1 - eps_low and clip_frac/high tokens with A > 0 and r > 1 + eps_high (the tokens whose gradient the
    clip removed; for cispo, tokens whose weight was clipped, regardless of A; for gmpo, tokens whose log ratio was
    clipped; 0 for sapo and kl_cov, which do not clip), dual_clip_frac (A < 0 and the cap -c A was binding),
    cov_select_frac (tokens picked by clip_cov / kl_cov; 0 for the others), kl_new_old (k3 estimate of
    KL(old || new), mean), num_tokens, num_seqs. Empty batch: ratio/min is +inf and ratio/max -inf (identities for
    folding extrema).
    """
    kind = _KIND_ALIASES.get(kind, kind)  # type: ignore[assignment]
    _check_choice("kind", kind, POLICY_LOSS_KINDS)
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_divisor("loss_divisor", loss_divisor)
    _check_divisor("grad_divisor", grad_divisor)
    if not eps_low >= 0:
        raise ValueError(f"eps_low must be >= 0, got {eps_low!r}")
    if not eps_high >= 0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high!r}")
    if dual_clip is not None:
        if kind not in ("ppo_clip", "gspo"):
            raise ValueError(f"dual_clip applies to kind 'ppo_clip' and 'gspo' only, not {kind!r}")
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip!r}")
    if not cispo_eps_high >= 0:
        raise ValueError(f"cispo_eps_high must be >= 0, got {cispo_eps_high!r}")
    if cispo_eps_low is not None and not cispo_eps_low >= 0:
        raise ValueError(f"cispo_eps_low must be >= 0, got {cispo_eps_low!r}")
    for name, value in (("sapo_tau_pos", sapo_tau_pos), ("sapo_tau_neg", sapo_tau_neg)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    for name, value in (("clip_cov_ratio", clip_cov_ratio), ("kl_cov_ratio", kl_cov_ratio)):
        if not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb ({clip_cov_lb!r}) must be < clip_cov_ub ({clip_cov_ub!r})")
    if not kl_cov_coef >= 0:
        raise ValueError(f"kl_cov_coef must be >= 0, got {kl_cov_coef!r}")
    _check_divisor("norm_constant", norm_constant)
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    if is_weights is not None:
        _check_same_shape(logprobs=logprobs, is_weights=is_weights)

    m = mask.bool()
    logp = _zero_masked(logprobs, m)
    old = _zero_masked(old_logprobs.detach().to(logprobs.dtype), m)
    adv = _zero_masked(_token_advantages(advantages, logprobs).to(logprobs.dtype), m)

    zeros = torch.zeros_like(m)
    dual_hit = cov_pick = zeros
    token_log_ratio = (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if kind == "gspo":
        seq_log_ratio = masked_mean((logp - old).detach(), m, dim=-1)  # [B]
        ratio = torch.exp(
            (seq_log_ratio.unsqueeze(-1) + logp - logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        )
    else:
        ratio = torch.exp(token_log_ratio)
    r = ratio.detach()

    if kind == "gmpo":
        row_adv = masked_mean(adv, m, dim=-1)  # [B]: the sequence-level advantage
        sign = torch.sign(row_adv).unsqueeze(-1)
        clipped_lr = token_log_ratio.clamp(-eps_low, eps_high)
        # Pessimistic in the direction of the advantage: for A > 0 the smaller log ratio, for A < 0 the larger.
        pess = sign * torch.minimum(sign * token_log_ratio, sign * clipped_lr)
        seq_ratio = torch.exp(masked_mean(pess, m, dim=-1))  # [B], differentiable
        loss_mat = (-row_adv * seq_ratio).unsqueeze(-1).expand_as(logp)
        r = seq_ratio.detach().unsqueeze(-1).expand_as(logp)
        lr = token_log_ratio.detach()
        clip_high = (sign > 0) & (lr > eps_high)
        clip_low = (sign < 0) & (lr < -eps_low)
    elif kind == "cispo":
        lower = None if cispo_eps_low is None else 1.0 - cispo_eps_low
        upper = 1.0 + cispo_eps_high
        weight = r.clamp(min=lower, max=upper)
        loss_mat = -weight * adv * logp
        clip_high = r > upper
        clip_low = r < lower if lower is not None else zeros
    elif kind == "sapo":
        tau = torch.where(
            adv > 0,
            torch.full((), sapo_tau_pos, dtype=adv.dtype, device=adv.device),
            torch.full((), sapo_tau_neg, dtype=adv.dtype, device=adv.device),
        )
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        loss_mat = -gate * adv
        clip_high = clip_low = zeros
    elif kind == "kl_cov":
        n_valid = masked_count(m).to(adv.dtype)
        k = torch.floor(kl_cov_ratio * n_valid).clamp(min=1)
        cov_pick = _top_k_mask(_covariance(adv, logp, m), m, k)
        penalty = kl_cov_coef * token_log_ratio.abs()
        loss_mat = -adv * ratio + torch.where(cov_pick, penalty, torch.zeros_like(penalty))
        clip_high = clip_low = zeros
    else:  # ppo_clip, gspo, clip_cov
        surr = -adv * ratio
        surr_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        loss_mat = torch.maximum(surr, surr_clipped)
        # Exactly the tokens where the clipped branch wins (and so carries zero gradient).
        clip_high = (adv > 0) & (r > 1.0 + eps_high)
        clip_low = (adv < 0) & (r < 1.0 - eps_low)
        if dual_clip is not None:
            cap = -adv * dual_clip
            negative = adv < 0
            dual_hit = negative & (loss_mat.detach() > cap)
            loss_mat = torch.where(negative, torch.minimum(loss_mat, cap), loss_mat)
        if kind == "clip_cov":
            cov = _covariance(adv, logp, m)
            candidate = m & ~(clip_low | clip_high) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
            k = torch.floor(clip_cov_ratio * masked_count(m).to(adv.dtype)).clamp(min=1)
            cov_pick = _top_k_mask(_token_hash(old_logprobs), candidate, k)
            loss_mat = torch.where(cov_pick, loss_mat.detach(), loss_mat)

    if is_weights is not None:
        loss_mat = loss_mat * _zero_masked(is_weights.detach().to(loss_mat.dtype), m)

    num, den = _aggregate_parts(loss_mat, m, aggregation, norm_constant)
    loss = _divide(num, den, loss_divisor, grad_divisor)

    inf = torch.full((), float("inf"), dtype=r.dtype, device=r.device)
    metrics = {
        "pg_loss": loss.detach(),
        "ratio/mean": masked_mean(r, m),
        "ratio/min": torch.where(m, r, inf).min(),
        "ratio/max": torch.where(m, r, -inf).max(),
        "ratio/sum": masked_sum(r, m),
        "ratio/sum_sq": masked_sum(r * r, m),
        "clip_frac": masked_mean((clip_low | clip_high).to(r.dtype), m),
        "clip_frac/low": masked_mean(clip_low.to(r.dtype), m),
        "clip_frac/high": masked_mean(clip_high.to(r.dtype), m),
        "dual_clip_frac": masked_mean(dual_hit.to(r.dtype), m),
        "cov_select_frac": masked_mean(cov_pick.to(r.dtype), m),
        # Tokens were sampled from the old policy, so k3(old, new) estimates KL(old || new).
        "kl_new_old": masked_mean(kl_estimate(old, logp.detach(), "k3"), m),
        "num_tokens": masked_count(m),
        "num_seqs": (masked_count(m, dim=-1) > 0).sum(),
    }
    return loss, metrics


def decoupled_is_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO's behaviour correction (Hilton et al., "Batch size-invariance for policy optimization"):
    w_t = min(pi_prox(y_t) / pi_behav(y_t), cap), a constant per token.

    Off-policy (algorithm.max_off_policy_steps >= 1) a batch was sampled by an older policy pi_behav. Decoupled
    PPO takes the clipped ratio against a *proximal* policy pi_prox (here the current policy at the start of the
    step: the trust region is around where the update starts, whatever the staleness) and corrects for the
    sampling with this weight, so the objective is
        -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),   r_t = pi_theta / pi_prox,
    i.e. `policy_loss_terms(logprobs, proximal_logprobs, adv, mask, is_weights=w)`. The weight is exact because
    behaviour_logprobs are the engine's recorded logprobs, which equal the trainer's forward of the behaviour
    weights bit for bit (checked by the guard before the update). On-policy tokens (pi_prox = pi_behav bitwise)
    get w = 1 exactly.

    proximal_logprobs, behaviour_logprobs: [B, T] fp32; mask: [B, T] (nonzero = a loss token); cap >= 1.
    Returns (w [B, T] in the logprobs' dtype, 0 at masked positions; metrics "offpolicy/is_weight/mean",
    ".../max", ".../capped_frac" over the masked tokens)."""
    _check_same_shape(proximal_logprobs=proximal_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    if not (math.isfinite(cap) and cap >= 1.0):
        raise ValueError(f"cap must be a finite number >= 1, got {cap!r}")
    m = mask.bool()
    w, capped = decoupled_weights_and_capped(proximal_logprobs, behaviour_logprobs, m, cap)
    metrics = scalars_to_floats(
        {
            "offpolicy/is_weight/mean": masked_mean(w, m),
            "offpolicy/is_weight/max": w.max(),  # w >= 0 and 0 at masked positions
            "offpolicy/is_weight/capped_frac": masked_mean(capped.to(w.dtype), m),
        }
    )
    return w, metrics


def decoupled_weights_and_capped(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decoupled_is_weights` without checks or host reads (the trainer computes it inside its captured
    microbatch graph): (w [B, T], capped [B, T] bool, False at masked positions). mask: bool; cap: a number or a
    0-d tensor on the logprobs' device."""
    log_w = _zero_masked(proximal_logprobs.detach() - behaviour_logprobs.detach(), mask)
    cap_t = torch.full((), cap, dtype=log_w.dtype, device=log_w.device) if not torch.is_tensor(cap) else cap
    cap_t = cap_t.to(log_w.dtype)
    # Compared in log space (the same clamp as the policy ratio), so exp never overflows on a garbage logprob.
    capped = (log_w >= torch.log(cap_t)) & mask
    w = torch.where(capped, cap_t, log_w.clamp(max=_LOG_RATIO_CLAMP).exp())
    return _zero_masked(w, mask), capped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss_terms` (see there for the arguments and metrics) with the metrics as Python floats, read
    back from the device in one copy."""
    loss, metrics = policy_loss_terms(logprobs, old_logprobs, advantages, mask, **kwargs)
    return loss, scalars_to_floats(metrics)


# -------------------------------------------------------------------------------------------------- value loss


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    aggregation: Aggregation = "token-mean",
    loss_divisor: Divisor | None = None,
    grad_divisor: Divisor | None = None,
    norm_constant: Divisor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic regression loss. values [B, T] (differentiable), old_values [B, T] and returns [B, T] (constant),
    mask [B, T].

    loss_t = 0.5 * (v_t - R_t)^2; with clip = c (PPO value clipping), v_clip = old + clamp(v - old, -c, c) and
    loss_t = 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2), i.e. a value that moved more than c from old_values gets
    no credit for moving further towards the return. Aggregation and divisors as in `policy_loss`.

    Metrics: vf_loss (the returned value), vf_clip_frac (tokens where the clipped term was the larger),
    explained_variance = 1 - Var[R - v] / Var[R] over valid tokens (0 when Var[R] = 0, where it is undefined),
    values/mean.
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_divisor("loss_divisor", loss_divisor)
    _check_divisor("grad_divisor", grad_divisor)
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip!r}")
    _check_divisor("norm_constant", norm_constant)
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)

    m = mask.bool()
    v = _zero_masked(values, m)
    old = _zero_masked(old_values.detach().to(values.dtype), m)
    ret = _zero_masked(returns.detach().to(values.dtype), m)

    err = (v - ret).square()
    if clip is None:
        loss_mat = 0.5 * err
        clipped = torch.zeros_like(m)
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - ret).square()
        loss_mat = 0.5 * torch.maximum(err, err_clip)
        clipped = err_clip.detach() > err.detach()

    num, den = _aggregate_parts(loss_mat, m, aggregation, norm_constant)
    loss = _divide(num, den, loss_divisor, grad_divisor)

    vd = v.detach()
    # Biased variances: the Bessel factor cancels in the ratio, and the biased form is defined for one token.
    var_ret = masked_var(ret, m, unbiased=False)
    var_res = masked_var(ret - vd, m, unbiased=False)
    ev = torch.where(var_ret > 0, 1.0 - var_res / var_ret.clamp(min=torch.finfo(var_ret.dtype).tiny), 0.0)
    metrics = scalars_to_floats(
        {
            "vf_loss": loss.detach(),
            "vf_clip_frac": masked_mean(clipped.to(vd.dtype), m),
            "explained_variance": ev,
            "values/mean": masked_mean(vd, m),
        }
    )
    return loss, metrics
