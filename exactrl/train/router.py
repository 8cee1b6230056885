"""Mixture-of-experts router terms of the training step: the auxiliary losses and the load metrics, computed from
the router outputs the training forward itself used (`exactrl.model.moe.collect_router_outputs`).

Pure functions over lists of per-layer tensors (one entry per sparse layer, in layer order), with a token mask
[T] (1.0 at a real token, 0.0 at microbatch padding). Every sum is in fp32 whatever the model dtype.

- `load_balancing_loss`: the Switch Transformer loss as transformers computes it for Qwen2/Qwen3-MoE
  (`load_balancing_loss_func`, which the models scale by `router_aux_loss_coef`): the router probabilities and the
  top-k choices of every layer pooled, E * sum over ranks r and experts e of (the fraction of tokens whose rank-r
  choice is e) * (the mean probability of e). It is k at an even load, about E when one expert holds every token's probability.
  Only the probabilities carry gradient (the choices are integers).
- `router_z_loss_sum`: ST-MoE's z-loss, logsumexp(router logits)^2 per token and layer, summed (the caller
  divides by the step's count, so it is a mean that does not depend on how the tokens were split).
- `router_stats` / `router_metrics`: tokens per expert and router entropy per layer, summed over microbatches and
  ranks before the ratios are taken (a global view, not a mean of per-rank ratios).
"""

from __future__ import annotations

import torch


def _masked(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask as fp32 [T, 1], its sum clamped to >= 1: an all-padding microbatch gives zeros, never 0 / 0)."""
    m = mask.float()
    return m[:, None], m.sum().clamp(min=1.0)


def load_balancing_loss(
    logits: list[torch.Tensor], ids: list[torch.Tensor], mask: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """logits: per layer [T, E]; ids: per layer [T, k] int64; mask: [T] -> scalar fp32 (see the module docstring)."""
    if not logits:
        raise ValueError("load_balancing_loss needs the router outputs of at least one sparse layer")
    m, n = _masked(mask)
    k = ids[0].shape[1]
    chosen = torch.zeros(k * num_experts, dtype=torch.float32, device=mask.device)  # [k, E], flat
    prob = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
    rank = torch.arange(k, device=mask.device)[None, :] * num_experts
    for lg, ix in zip(logits, ids):
        # Count (rank, expert) choices of the real tokens. index_add, not one_hot: one_hot checks its ids on the
        # host (a device sync, which a CUDA graph capture refuses).
        chosen = chosen.index_add(0, (rank + ix).reshape(-1), m[:, 0].repeat_interleave(k))
        prob = prob + (torch.softmax(lg.float(), dim=-1) * m).sum(0)
    pooled = n * len(logits)  # tokens x layers: transformers concatenates the layers' router logits
    return num_experts * ((chosen.view(k, num_experts) / pooled) * (prob / pooled)[None, :]).sum()


def router_z_loss_sum(logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """logits: per layer [T, E]; mask: [T] -> scalar fp32: sum over layers and real tokens of logsumexp^2."""
    m = mask.float()
    total = torch.zeros((), dtype=torch.float32, device=mask.device)
    for lg in logits:
        total = total + (torch.logsumexp(lg.float(), dim=-1).square() * m).sum()
    return total


def router_stats(
    logits: list[torch.Tensor], ids: list[torch.Tensor], mask: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """[L, E + 2] float64, no grad: per layer, the tokens routed to each expert (every rank of a token's top k
    counts once), the summed router entropy (nats) and the number of real tokens. Sums: add them over
    microbatches and ranks, then `router_metrics`."""
    m = mask.detach().float()
    rows = []
    for lg, ix in zip(logits, ids):
        counts = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
        counts.index_add_(0, ix.reshape(-1), m.repeat_interleave(ix.shape[1]))
        logp = torch.log_softmax(lg.detach().float(), dim=-1)
        entropy = (-(logp.exp() * logp).sum(-1) * m).sum()
        rows.append(torch.cat([counts, entropy[None], m.sum()[None]]))
    return torch.stack(rows).to(torch.float64)


def router_metrics(stats: torch.Tensor, layers: list[int] | None = None) -> dict[str, float]:
    """The `moe/*` metrics of summed `router_stats` ([L, E + 2]):

    moe/load_max_over_mean: the busiest expert's tokens over the mean per expert, averaged over the sparse layers
      (1.0 = an even load; E = every token of a layer on one expert);
    moe/load_max_over_mean_worst: the same ratio in the most unbalanced layer; moe/load_worst_layer: which layer;
    moe/idle_experts: (layer, expert) pairs that received no token;
    moe/router_entropy: the router's softmax entropy in nats, mean over tokens and layers (log E = uniform)."""
    stats = stats.detach().double().cpu()
    counts, entropy, tokens = stats[:, :-2], stats[:, -2], stats[:, -1]
    num_experts = counts.shape[1]
    mean = counts.sum(1) / num_experts
    ratio = torch.where(mean > 0, counts.max(1).values / mean.clamp(min=1e-30), torch.ones_like(mean))
    worst = int(ratio.argmax())
    return {
        "moe/load_max_over_mean": float(ratio.mean()),
        "moe/load_max_over_mean_worst": float(ratio[worst]),
        "moe/load_worst_layer": float(layers[worst] if layers is not None else worst),
        "moe/idle_experts": float((counts == 0).sum()),
        "moe/router_entropy": float(entropy.sum() / tokens.sum().clamp(min=1.0)),
    }
