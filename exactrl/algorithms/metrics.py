"""Masked reductions and the scalar metrics the trainer logs.

Conventions shared by the whole `exactrl.algorithms` package:

* Token tensors are padded `[B, T]`; `mask` is `[B, T]` and any nonzero entry marks a response token that counts.
  Masks are read as booleans (never as weights), so a float mask of 0/1 and a bool mask behave identically.
* Values at masked positions are never read: they go through `torch.where`, not a multiply, so padding that holds
  `-inf` or NaN (common for log-probabilities of pad tokens) cannot leak into a sum or a gradient.
* Every metric is a plain Python float. Where a trainer must combine microbatches exactly, a sum and a count are
  reported next to the mean.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = [
    "masked_sum",
    "masked_count",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "advantage_metrics",
    "reward_metrics",
    "response_length_metrics",
    "scalars_to_floats",
]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over positions where `mask` is nonzero. x, mask: same (broadcastable) shape.

    dim=None reduces everything to a 0-d tensor; an int reduces that dimension only.
    """
    # where (not x * mask): 0 * inf is NaN, and padding log-probs are often -inf.
    z = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of valid positions (int64), over everything or along `dim`."""
    m = mask.bool()
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over valid positions; 0 where there are none (an empty mean is reported as 0, not NaN, so one
    empty row or microbatch cannot poison a logged average)."""
    total = masked_sum(x, mask, dim)
    count = masked_count(mask.expand_as(x) if mask.shape != x.shape else mask, dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, *, unbiased: bool = True
) -> torch.Tensor:
    """Variance of `x` over valid positions, Bessel-corrected by default (as verl's `masked_var`).

    Returns 0 where there are fewer than 2 valid positions (unbiased) or none (biased): a single sample has no spread.
    """
    m = mask.bool().expand_as(x)
    mean = masked_mean(x, m, dim)
    centred = x - (mean if dim is None else mean.unsqueeze(dim))
    sq = masked_sum(centred * centred, m, dim)
    count = masked_count(m, dim).to(sq.dtype)
    denom = count - 1 if unbiased else count
    return torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise `x` to zero mean and unit variance over all valid positions: (x - mean) / sqrt(var + eps).

    With shift_mean=False the mean is added back (only the scale changes). The variance is Bessel-corrected, as in
    verl. Masked positions come out as 0, so the result can be fed to a loss without re-masking.
    """
    m = mask.bool().expand_as(x)
    mean = masked_mean(x, m)
    var = masked_var(x, m)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def scalars_to_floats(scalars: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Turn a dict of 0-d tensors into Python floats with a single device-to-host copy.

    One `.tolist()` on a stacked tensor instead of one `.item()` per metric: on a GPU each `.item()` is a separate
    synchronisation, and a loss reports a dozen metrics per microbatch.
    """
    keys = [k for k, v in scalars.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in scalars.items() if not isinstance(v, torch.Tensor)}
    if keys:
        first = scalars[keys[0]]
        assert isinstance(first, torch.Tensor)
        stacked = torch.stack(
            [scalars[k].detach().reshape(()).to(device=first.device, dtype=torch.float64) for k in keys]  # type: ignore[union-attr]
        )
        out.update(zip(keys, stacked.tolist()))
    return {k: out[k] for k in scalars}


def _masked_min_max(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max over valid positions; +inf / -inf when there are none (the identity elements of min and max, so
    a trainer folding microbatch extrema with min()/max() gets the exact answer)."""
    inf = torch.full((), float("inf"), dtype=x.dtype, device=x.device)
    return torch.where(m, x, inf).min(), torch.where(m, x, -inf).max()


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """advantages: [B, T] (or [B], broadcast over tokens), mask: [B, T] -> `advantages/mean|std|min|max`.

    Statistics are over valid tokens (a long response weighs more, as it does in a token-mean loss); std is
    Bessel-corrected. With no valid token: mean = std = 0, min = +inf, max = -inf.
    """
    adv = advantages.detach()
    m = mask.bool()
    if adv.dim() == 1 and m.dim() == 2:
        adv = adv.unsqueeze(-1).expand_as(m)
    a = adv.to(torch.float64)
    lo, hi = _masked_min_max(a, m)
    return scalars_to_floats(
        {
            "advantages/mean": masked_mean(a, m),
            "advantages/std": masked_var(a, m).sqrt(),
            "advantages/min": lo,
            "advantages/max": hi,
        }
    )


def _group_std_is_zero(values: torch.Tensor, group_size: int) -> torch.Tensor:
    # max == min rather than std == 0: the computed std of identical float32 values can be a rounding residue.
    g = values.view(-1, group_size)
    return g.amax(dim=1) == g.amin(dim=1)


def reward_metrics(
    rewards: torch.Tensor, group_size: int, per_function: dict[str, torch.Tensor] | None = None
) -> dict[str, float]:
    """rewards: [N] (groups of `group_size` contiguous samples) -> `reward/mean`, `reward/std`,
    `reward/<name>/mean|std` for each per-function reward [N], and `groups/zero_std_frac`.

    std is Bessel-corrected (0 for a single sample). `groups/zero_std_frac` is the fraction of groups whose rewards
    are all equal, i.e. the groups whose group-relative advantage is 0 and so give no learning signal; a group of
    size 1 always counts as zero-std for that reason.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_size={group_size} must divide the number of rewards N={rewards.numel()}")
    scalars: dict[str, torch.Tensor | float] = {}

    def _mean_std(prefix: str, r: torch.Tensor) -> None:
        r64 = r.detach().to(torch.float64)
        ones = torch.ones_like(r64, dtype=torch.bool)
        scalars[f"{prefix}/mean"] = masked_mean(r64, ones)
        scalars[f"{prefix}/std"] = masked_var(r64, ones).sqrt()

    _mean_std("reward", rewards)
    for name, r in (per_function or {}).items():
        if r.shape != rewards.shape:
            raise ValueError(
                f"per_function[{name!r}] has shape {tuple(r.shape)}, expected {tuple(rewards.shape)}"
            )
        _mean_std(f"reward/{name}", r)
    if rewards.numel() == 0:
        scalars["groups/zero_std_frac"] = 0.0
    else:
        scalars["groups/zero_std_frac"] = _group_std_is_zero(rewards.detach(), group_size).double().mean()
    return scalars_to_floats(scalars)


def response_length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """lengths: [N] int, truncated: [N] bool (hit the length limit without an end token) ->
    `response_length/mean|min|max` and `response_length/truncated_frac`. All zeros for N = 0."""
    if lengths.shape != truncated.shape or lengths.dim() != 1:
        raise ValueError(
            f"lengths and truncated must both be [N], got {tuple(lengths.shape)} and {tuple(truncated.shape)}"
        )
    if lengths.numel() == 0:
        return {f"response_length/{k}": 0.0 for k in ("mean", "min", "max", "truncated_frac")}
    n = lengths.detach().to(torch.float64)
    return scalars_to_floats(
        {
            "response_length/mean": n.mean(),
            "response_length/min": n.min(),
            "response_length/max": n.max(),
            "response_length/truncated_frac": truncated.detach().bool().double().mean(),
        }
    )
