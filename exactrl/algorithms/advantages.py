"""Advantage estimators: sequence-level ones for outcome rewards, and GAE for a critic.

Sequence-level estimators take one scalar reward per response, `rewards: [N] float`, where the `group_size`
responses to one prompt are contiguous (`rewards.view(-1, group_size)`), and return one advantage per response,
`[N]`; the loss broadcasts it over the response's tokens. Some also need the response lengths (`lengths: [N]`,
valid tokens per response: OPO's baseline and the batch normalisation of REINFORCE++ weigh responses by their
tokens) or a baseline reward per prompt (ReMax). `compute_advantages` is the one entry point the RL loop calls:
it dispatches on the `algorithm.advantage` name.

The menu (names as in verl's `adv_estimator`):

| name | baseline | scale |
|---|---|---|
| grpo | group mean | group std (or batch std, or none: `adv_scale`) |
| dr_grpo | group mean | none |
| rloo | mean of the other group members | none |
| reinforce_plus_plus | none | batch whitening over tokens |
| reinforce_plus_plus_baseline | group mean | batch whitening over tokens |
| remax | reward of the greedy response to the same prompt | none |
| gpg | group mean | B / (B - M), M = responses in all-equal groups |
| opo | length-weighted group mean | none |
| gae | learned critic (token level; `gae`, not `compute_advantages`) | batch whitening (`whiten_advantages`) |

Where a group's rewards are all equal, every group-relative estimator gives exactly 0 (see `grpo_advantages`).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from exactrl.algorithms.metrics import masked_whiten
from exactrl.config import AdvantageName

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "SEQUENCE_ESTIMATORS",
    "compute_advantages",
    "gae",
    "gae_advantages",
    "gpg_advantages",
    "grpo_advantages",
    "opo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "weighted_whiten",
]

# Every estimator `algorithm.advantage` can name (the config's list, one definition); all but "gae" work on one
# reward per response.
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageName)
SEQUENCE_ESTIMATORS: tuple[str, ...] = tuple(a for a in ADVANTAGE_ESTIMATORS if a != "gae")
# Whitening eps, as in `masked_whiten` (and verl's): (x - mean) * rsqrt(var + eps).
_WHITEN_EPS = 1e-8

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


# ------------------------------------------------------------------------------------ the estimators verl adds


def _flat(g: torch.Tensor) -> torch.Tensor:
    """[P, G] -> [P, G] bool: True for every member of a group whose rewards are all equal."""
    return (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)).expand_as(g)


def _lengths(lengths: torch.Tensor | None, rewards: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Validate response lengths [N] (valid tokens per response) and return them as `like`'s dtype; None = all 1."""
    if lengths is None:
        return torch.ones_like(like)
    if lengths.shape != rewards.shape:
        raise ValueError(f"lengths must be [N] = {tuple(rewards.shape)}, got shape {tuple(lengths.shape)}")
    if bool((lengths < 0).any()):
        raise ValueError("lengths must be >= 0 (valid tokens per response)")
    return lengths.detach().to(device=like.device, dtype=like.dtype)


def weighted_whiten(
    x: torch.Tensor, weights: torch.Tensor | None = None, eps: float = _WHITEN_EPS
) -> torch.Tensor:
    """Whiten one value per response as if each were repeated over its tokens. x: [N] float, weights: [N] (valid
    tokens per response; None = 1 each) -> [N].

    Equal to `masked_whiten` of the [N, T] tensor that holds x_i on the weights_i valid tokens of row i:
        mean = sum_i w_i x_i / W,  var = sum_i w_i (x_i - mean)^2 / (W - 1)  (Bessel over tokens, W = sum_i w_i),
        out_i = (x_i - mean) / sqrt(var + eps),
    which is what verl's token-level whitening of a sequence-level advantage computes, without building [N, T].
    Responses of weight 0 come out as 0. If every weighted value is equal the result is exactly 0 (the centred
    values would otherwise be rounding residues scaled by 1 / sqrt(eps) = 1e4).
    """
    if x.dim() != 1:
        raise ValueError(f"x must be 1-D [N], got shape {tuple(x.shape)}")
    w = _lengths(weights, x, x)
    valid = w > 0
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if not bool(valid.any()):
        return torch.zeros_like(x)
    total = w.sum()
    mean = (w * x).sum() / total
    var = (w * (x - mean).square()).sum() / (total - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    xv = x[valid]
    if bool(xv.amax() == xv.amin()):
        return torch.zeros_like(x)
    return torch.where(valid, out, zero)


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++ advantages (Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization", arXiv:2501.03262). rewards: [N] float, lengths: [N] -> [N].

    No baseline inside the group: the return of every token of response i is its outcome reward r_i (outcome
    reward, discount 1), and the advantages are normalised over the whole batch's tokens:
        A_i = (r_i - mean) / sqrt(var + 1e-8), mean and var over all valid tokens (`weighted_whiten`).
    Without lengths each response counts once. A batch whose rewards are all equal gets exactly 0.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    return weighted_whiten(r, lengths)


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, group_size: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline advantages (Hu et al. 2025, arXiv:2501.03262, the variant with a group baseline).
    rewards: [N] float, lengths: [N] -> [N].

    The group mean is subtracted first (the baseline that removes the prompt's difficulty), then the centred values
    are normalised over the batch's tokens as in `reinforce_plus_plus_advantages`:
        c_i = r_i - mean(group of i),   A_i = (c_i - mean_tok(c)) / sqrt(var_tok(c) + 1e-8).
    Groups whose rewards are all equal get exactly 0, also after the normalisation (the batch mean would otherwise
    give them -mean / std: a push on responses that carry no signal about their prompt).
    """
    g = _grouped(rewards, group_size)
    flat = _flat(g)
    centred = torch.where(flat, torch.zeros_like(g), g - g.mean(dim=1, keepdim=True)).reshape(-1)
    out = weighted_whiten(centred, lengths)
    return torch.where(flat.reshape(-1), torch.zeros_like(out), out)


def remax_advantages(rewards: torch.Tensor, baseline_rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """ReMax advantages (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models", arXiv:2310.10505). rewards: [N] float, baseline_rewards: [N // group_size]
    (one per prompt) -> [N].

    The baseline is the reward of the greedy (temperature 0) response to the same prompt, generated by the same
    policy: A_i = r_i - b(prompt of i). Sampled responses that score like the greedy one get 0; better ones a
    positive, worse ones a negative advantage. No scaling.
    """
    g = _grouped(rewards, group_size)
    if baseline_rewards.dim() != 1 or baseline_rewards.shape[0] != g.shape[0]:
        raise ValueError(
            f"baseline_rewards must be [N // group_size] = [{g.shape[0]}] (one greedy reward per prompt), got "
            f"shape {tuple(baseline_rewards.shape)}"
        )
    b = baseline_rewards.detach().to(device=g.device, dtype=g.dtype)
    return (g - b[:, None]).reshape(-1)


def gpg_alpha(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GPG's gradient correction B / (B - M) (0-d tensor): B responses, M of them in groups whose rewards are all
    equal (their advantage is 0, so they dilute the batch mean of the gradient). 1 when every group is flat."""
    g = _grouped(rewards, group_size)
    n = g.numel()
    m = int(_flat(g).sum()) if n else 0
    return torch.tensor(n / (n - m) if n > m else 1.0, dtype=g.dtype, device=g.device)


def gpg_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GPG advantages (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546). rewards: [N] float -> [N].

        A_i = alpha * (r_i - mean(group of i)) / F_norm,   alpha = B / (B - M)   (`gpg_alpha`),  F_norm = 1,

    i.e. Dr.GRPO's centred rewards rescaled so that the responses with a signal carry the whole batch's weight
    (the paper's "accurate gradient estimation"). The paper's default F_norm = 1 is used. Flat groups get exactly 0.
    """
    g = _grouped(rewards, group_size)
    flat = _flat(g)
    centred = torch.where(flat, torch.zeros_like(g), g - g.mean(dim=1, keepdim=True))
    return (centred * gpg_alpha(rewards, group_size)).reshape(-1)


def opo_advantages(rewards: torch.Tensor, group_size: int, lengths: torch.Tensor) -> torch.Tensor:
    """OPO advantages (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585).
    rewards: [N] float, lengths: [N] valid tokens per response -> [N].

    The baseline is the length-weighted group mean, the variance-minimising baseline when a response's gradient
    norm grows with its length:  b = sum_j l_j r_j / sum_j l_j over the group,  A_i = r_i - b.
    A group with no tokens at all falls back to the plain mean. Flat groups get exactly 0.
    """
    g = _grouped(rewards, group_size)
    lens = _lengths(lengths, rewards.reshape(-1), g.reshape(-1)).view_as(g)
    tot = lens.sum(dim=1, keepdim=True)
    weighted = (lens * g).sum(dim=1, keepdim=True) / tot.clamp(min=1)
    b = torch.where(tot > 0, weighted, g.mean(dim=1, keepdim=True))
    return torch.where(_flat(g), torch.zeros_like(g), g - b).reshape(-1)


def compute_advantages(
    advantage: str,
    rewards: torch.Tensor,
    group_size: int,
    *,
    lengths: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    adv_scale: GrpoScale = "group",
    whiten: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The sequence-level advantage dispatch the RL loop calls. rewards: [N] float (groups contiguous),
    lengths: [N] (valid tokens per response; needed by "opo", used by the reinforce_plus_plus variants and by
    whiten), baseline_rewards: [N // group_size] (the greedy rewards; needed by "remax") -> (advantages [N],
    metrics).

    advantage: one of SEQUENCE_ESTIMATORS ("gae" is token-level and needs a critic: see `gae_advantages`).
    adv_scale applies to "grpo" only ("dr_grpo" is grpo with scale "none"). whiten=True normalises the result over
    the batch's tokens (`weighted_whiten`); groups with all-equal rewards keep exactly 0. The two reinforce_plus_plus
    estimators are normalised by definition, so whiten changes nothing for them.

    Metrics: `advantages/gpg_alpha` (gpg), `remax/baseline_reward_mean` and `remax/above_baseline_frac` (remax).
    """
    if advantage == "gae":
        raise ValueError(
            "advantage 'gae' is token-level and needs the critic's values: use gae_advantages in the trainer"
        )
    if advantage not in SEQUENCE_ESTIMATORS:
        raise ValueError(f"advantage must be one of {ADVANTAGE_ESTIMATORS}, got {advantage!r}")
    metrics: dict[str, float] = {}
    if advantage == "grpo":
        adv = grpo_advantages(rewards, group_size, scale=adv_scale, eps=eps)
    elif advantage == "dr_grpo":
        adv = grpo_advantages(rewards, group_size, scale="none", eps=eps)
    elif advantage == "rloo":
        adv = rloo_advantages(rewards, group_size)
    elif advantage == "reinforce_plus_plus":
        adv = reinforce_plus_plus_advantages(rewards, lengths)
    elif advantage == "reinforce_plus_plus_baseline":
        adv = reinforce_plus_plus_baseline_advantages(rewards, group_size, lengths)
    elif advantage == "remax":
        if baseline_rewards is None:
            raise ValueError(
                "advantage 'remax' needs baseline_rewards: the rewards of one greedy rollout per prompt"
            )
        adv = remax_advantages(rewards, baseline_rewards, group_size)
        b = baseline_rewards.detach().double()
        metrics["remax/baseline_reward_mean"] = float(b.mean()) if b.numel() else 0.0
        metrics["remax/above_baseline_frac"] = float((adv > 0).double().mean()) if adv.numel() else 0.0
    elif advantage == "gpg":
        adv = gpg_advantages(rewards, group_size)
        metrics["advantages/gpg_alpha"] = float(gpg_alpha(rewards, group_size))
    else:  # opo
        if lengths is None:
            raise ValueError("advantage 'opo' needs lengths: the number of valid tokens of each response")
        adv = opo_advantages(rewards, group_size, lengths)
    if whiten and advantage not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        whitened = weighted_whiten(adv, lengths)
        if advantage == "remax":  # no groups: the baseline is the greedy reward, not the group's rewards
            adv = whitened
        else:
            flat = _flat(_grouped(rewards, group_size)).reshape(-1)
            adv = torch.where(flat, torch.zeros_like(whitened), whitened)
    return adv, metrics


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE as the trainer uses it: `gae`, then (whiten=True, the default for GAE as in verl, OpenRLHF and TRL) the
    advantages whitened over the batch's valid tokens with `masked_whiten`. [B, T] in -> (advantages, returns).

    returns = the unwhitened advantages + values: the critic regresses on the actual returns; only the policy's
    advantages are normalised.
    """
    adv, returns = gae(token_rewards, values, mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns
