"""Mixture-of-experts ops in plain PyTorch: the router's top-k (`route_topk`, shared by every backend that wants
the lowest-id tie rule) and the routed experts, exact (`experts_exact`) and fast (`experts_fast`).

Why a token's output cannot depend on the other tokens of the call (the exact backends' promise):
- Routing is row-local: the router logits come from the invariant `linear`; softmax is a row-wise fp32 reduction
  over the last dimension (equal bits for a row whatever the row count: tests/ops guard it); the top-k is an
  iterated argmax over the row's probabilities, and `argmax` returns the first maximal index, so equal
  probabilities pick the lowest expert id on every device (`torch.topk` makes no promise about ties). With
  `norm_topk_prob` the k weights are divided by their sum, added in rank order in fp32 (one fixed order, so a
  Triton kernel that adds them one by one in a loop gets the same bits).
- Each expert's GEMMs run on the rows routed to it, so the row count of an expert's call changes with every
  batch and a row's place in it with every composition. The exact backend computes them with the backend's own
  invariant `linear` (rows padded to a multiple of 16 on the CPU), whose per-row bits are independent of the row
  count and of the row's position: the dense rule, applied per expert.
- Combine: a token's k expert outputs are weighted and added in fp32 in rank order (rank 0 first), then rounded
  once to the model dtype. Rank order is a property of the token alone (its own sorted probabilities), never of
  which expert received how many tokens or in which order the experts were visited; fp32 keeps the sum's rounding
  away from the model dtype's. Expert-id order would be just as invariant; rank order is the one fixed here, for
  every exact backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] (model dtype) -> (weights [T, k] fp32, ids [T, k] int64): the k largest softmax probabilities
    in descending order, ties to the lowest expert id, renormalised in rank order with norm_topk_prob.

    Differentiable w.r.t. logits through the weights (the ids are integers)."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, num_experts], got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
    probs = torch.softmax(logits.float(), dim=-1)
    masked = probs.detach().clone()
    ids = []
    for _ in range(top_k):
        # argmax returns the first maximal index: the lowest expert id among equal probabilities.
        idx = masked.argmax(dim=-1, keepdim=True)
        masked.scatter_(1, idx, float("-inf"))
        ids.append(idx)
    top_ids = torch.cat(ids, dim=1)
    weights = probs.gather(1, top_ids)
    if norm_topk_prob:
        total = weights[:, 0]
        for r in range(1, top_k):  # rank order, one add at a time: the order every exact backend uses
            total = total + weights[:, r]
        weights = weights / total[:, None]
    return weights, top_ids


def check_experts_args(x, gate_up, down, weights, ids) -> None:
    """The shapes and dtypes `moe_experts` takes (every backend checks them the same way), refused by name."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"moe_experts wants x [T, D], gate_up [E, 2I, D], down [E, D, I]; got {tuple(x.shape)}, "
            f"{tuple(gate_up.shape)}, {tuple(down.shape)}"
        )
    num_experts, two_i, d = gate_up.shape
    if two_i % 2 or d != x.shape[1] or tuple(down.shape) != (num_experts, d, two_i // 2):
        raise ValueError(
            f"moe_experts shapes disagree: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
            f"down {tuple(down.shape)} (want gate_up [E, 2I, D], down [E, D, I])"
        )
    if weights.shape != ids.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [T, k] "
            f"with T = {x.shape[0]}"
        )
    if ids.dtype != torch.int64 or weights.dtype != torch.float32:
        raise TypeError(f"moe_experts needs ids int64 and weights fp32, got {ids.dtype} and {weights.dtype}")
    if x.dtype != gate_up.dtype or x.dtype != down.dtype:
        raise TypeError(
            f"moe_experts: x, gate_up and down must share the model dtype, got {x.dtype}, "
            f"{gate_up.dtype}, {down.dtype}"
        )


def _groups(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(the flat (token, rank) slots sorted by expert, stable; the number of slots of each expert)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def combine_rank_order(outs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """outs: [T, k, D] (model dtype), weights: [T, k] fp32 -> [T, D] in dtype: sum over r = 0..k-1 of
    weights[:, r] * outs[:, r] in fp32, added in rank order, rounded once."""
    acc = weights[:, 0, None] * outs[:, 0].float()
    for r in range(1, outs.shape[1]):
        acc = acc + weights[:, r, None] * outs[:, r].float()
    return acc.to(dtype)


def experts_exact(linear, silu_mul, x, gate_up, down, weights, ids) -> torch.Tensor:
    """The exact backends' reference: per expert, gather its rows, `linear` (the backend's invariant GEMM) to
    gate|up, `silu_mul`, `linear` to the output, scatter back to the (token, rank) slots; combine in rank order
    in fp32. x: [T, D]; gate_up: [E, 2I, D]; down: [E, D, I]; weights: [T, k] fp32; ids: [T, k] -> [T, D]."""
    check_experts_args(x, gate_up, down, weights, ids)
    T, k = ids.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    order, counts = _groups(ids, num_experts)
    pieces = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        xe = x[slots // k]  # the tokens of expert e, in (token, rank) order
        gu = linear(xe, gate_up[e])
        h = silu_mul(gu[:, :inter], gu[:, inter:])
        pieces.append(linear(h, down[e]))
    sorted_out = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[1])
    # Slot s of the sorted list holds (token, rank) order[s]; put every output back at its own slot.
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    outs = sorted_out[inverse].view(T, k, x.shape[1])
    return combine_rank_order(outs, weights, x.dtype)


def experts_fast(x, gate_up, down, weights, ids) -> torch.Tensor:
    """PyTorch's defaults, as transformers' eager experts compute: F.linear per expert on its rows (no padding:
    MKL's blocking then depends on the row count), the routing weight applied and the outputs accumulated with
    index_add in the model dtype, expert by expert."""
    check_experts_args(x, gate_up, down, weights, ids)
    num_experts = gate_up.shape[0]
    w = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(num_experts):
        token, rank = torch.where(ids == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        o = F.linear(F.silu(gate) * up, down[e]) * w[token, rank, None]
        out = out.index_add(0, token, o)
    return out
