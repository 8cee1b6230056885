"""Advantage estimators: group-relative (GRPO, Dr.GRPO, RLOO) for outcome rewards, and GAE for a critic.

Group estimators take one scalar reward per response, `rewards: [N] float`, where the `group_size` responses to
one prompt are contiguous (`rewards.view(-1, group_size)`), and return one advantage per response, `[N]`; the
loss broadcasts it over the response's tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["grpo_advantages", "rloo_advantages", "gae"]

GrpoScale = Literal["group", "batch", "none"]
_GRPO_SCALES = ("group", "batch", "none")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Validate and reshape rewards [N] -> [N // group_size, group_size] (float)."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(f"number of rewards N={n} is not divisible by group_size={group_size}")
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    return r.view(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: GrpoScale = "group", eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages. rewards: [N] float -> [N] (same float dtype; int rewards become float32).

    A_i = (r_i - mean(group)) / (std + eps), where std is
      * scale="group": the Bessel-corrected std of the sample's own group (GRPO; what verl and TRL compute),
      * scale="batch": the Bessel-corrected std of all N rewards (one scale for the batch),
      * scale="none": no division at all, A_i = r_i - mean(group) (Dr.GRPO).

    A group of size 1 gets advantage 0 (it has no baseline to compare with). A group whose rewards are all equal
    gets exactly 0 as well: mean() of equal floats can differ from them by a rounding residue, and dividing that
    residue by eps would turn "no signal" into a spurious advantage of order residue / eps.
    """
    if scale not in _GRPO_SCALES:
        raise ValueError(f"scale must be one of {_GRPO_SCALES}, got {scale!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    g = _grouped(rewards, group_size)
    if g.numel() == 0:
        return g.reshape(-1).clone()
    centred = g - g.mean(dim=1, keepdim=True)
    if scale == "group":
        std = g.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
        adv = centred / (std + eps)
    elif scale == "batch":
        std = g.reshape(-1).std() if g.numel() > 1 else torch.zeros((), dtype=g.dtype, device=g.device)
        adv = centred / (std + eps)
    else:
        adv = centred
    flat = (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)).expand_as(g)
    return torch.where(flat, torch.zeros_like(adv), adv).reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages. rewards: [N] float -> [N].

    A_i = r_i - mean of the other group_size - 1 rewards of its group. Groups of size 1 get 0 (no other member to
    form a baseline); groups of equal rewards get exactly 0 (see `grpo_advantages` for why this is forced).
    """
    g = _grouped(rewards, group_size)
    if group_size == 1 or g.numel() == 0:
        return torch.zeros_like(g).reshape(-1)
    others_mean = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    adv = g - others_mean
    flat = (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)).expand_as(g)
    return torch.where(flat, torch.zeros_like(adv), adv).reshape(-1)


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation. rewards, values, mask: [B, T] -> (advantages [B, T], returns [B, T]).

    Runs backward over each row's valid positions only:
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next,
    where "next" is the next *valid* position of the row. Masked positions are skipped entirely: their rewards and
    values are not read, and the recursion carries over them unchanged (so tokens the policy did not generate, e.g.
    tool output between turns, neither break nor feed the recursion; put rewards on valid tokens). After the last
    valid token the episode has ended: V_next = 0 and A_next = 0.

    returns = advantages + values. Both outputs are 0 at masked positions. No whitening is applied (use
    `masked_whiten` if wanted). Runs without autograd: advantages and returns are regression/policy targets.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            "rewards, values and mask must all be [B, T]; got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    m = mask.bool()
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    r = torch.where(m, rewards.to(dtype), zero)
    v = torch.where(m, values.to(dtype), zero)
    bsz, length = r.shape
    next_value = torch.zeros(bsz, dtype=dtype, device=r.device)
    next_adv = torch.zeros(bsz, dtype=dtype, device=r.device)
    adv = torch.zeros_like(r)
    # A loop over T with vectorised rows: the recursion is sequential in t, and T (response length) is small
    # enough that this costs nothing next to a forward pass.
    for t in range(length - 1, -1, -1):
        valid = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(valid, a_t, zero)
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, a_t, next_adv)
    returns = torch.where(m, adv + v, zero)
    return adv, returns
