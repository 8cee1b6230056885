"""Expert parallel's combine in the one-device order, at a top-k where the order shows (issue 55, item 8).

Every tiny MoE preset routes top-2, where w0*o0 + w1*o1 is the same fp32 number in either order (IEEE addition is
commutative), so a combine that adds the experts' outputs in another order than the one-device engine passes every
test at k = 2; the 30B routes 8. Here a sparse layer of 8 experts routes top-4, with trained-looking weights and a
router biased so that the experts' loads are uneven (a few experts take most slots, one may take none). Each rank of
an engine split over E = 2 and 4 ranks (simulated in one process: tests/distributed/_ep_sim.py) must return the
one-device layer's output bit for bit, through both of `ExpertParallelExperts`' paths (by count, and the static
decode step's every-slot path). The negative control: the same slot outputs combined in the reverse order differ,
so the test can see an order bug; and a combine that adds in another order (planted) fails it."""

from __future__ import annotations

import pytest
import torch

from exactrl.model.moe import Experts, static_decode_step
from exactrl.ops import get_ops
from exactrl.ops.moe_torch import combine_rank_order

from ._ep_sim import split_experts

NUM_EXPERTS, TOP_K, D, INTER, T = 8, 4, 64, 32, 48


def _layer(dtype: torch.dtype):
    """Experts with trained-looking weights (std 1/sqrt(fan_in), scales that differ by expert), tokens, and a
    top-4 routing whose loads are uneven (normalised top-k probabilities, fp32)."""
    g = torch.Generator().manual_seed(7)
    ops = get_ops("cpu")
    experts = Experts(NUM_EXPERTS, D, INTER)
    scale = 0.5 + torch.rand(NUM_EXPERTS, 1, 1, generator=g)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(experts.gate_up.shape, generator=g) * scale / D**0.5)
        experts.down.copy_(torch.randn(experts.down.shape, generator=g) * scale / INTER**0.5)
    experts = experts.to(dtype).requires_grad_(False)
    x = torch.randn(T, D, generator=g).to(dtype)
    bias = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    logits = torch.randn(T, NUM_EXPERTS, generator=g) + bias
    weights, ids = ops.moe_route(logits, TOP_K, True)
    return ops, experts, x, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_rank_of_an_expert_parallel_split_combines_in_the_one_device_order(dtype):
    ops, experts, x, weights, ids = _layer(dtype)
    loads = torch.bincount(ids.reshape(-1), minlength=NUM_EXPERTS)
    assert ids.shape == (T, TOP_K) and loads.max() >= 3 * max(1, int(loads.min()))  # uneven loads
    want = experts(ops, x, weights, ids)  # the one-device engine's layer
    for size in (2, 4):
        for rank in range(size):
            calls = []
            split = split_experts(experts, size, rank, calls)
            by_count = split(ops, x, weights, ids)
            with static_decode_step():
                static = split(ops, x, weights, ids)
            assert torch.equal(by_count, want), (size, rank)
            assert torch.equal(static, want), (size, rank)
            # The two paths were the ones asked for: this rank's slots alone, then every slot.
            owned = int(((ids // (NUM_EXPERTS // size)) == rank).sum())
            assert [(c.static, c.rows) for c in calls] == [(False, owned), (True, T * TOP_K)], (size, rank)

    # Negative control: the same slot outputs, combined in reverse order, are other bits (at k = 4 the order shows;
    # at k = 2 it would not: the first two slots combined either way are equal). In fp32: one bf16 layer of this
    # size rounds the order's last fp32 bits away (a whole model's many layers would not), which is why fp32 is here.
    ones = torch.ones(T * TOP_K, 1, dtype=torch.float32)
    rows = x.unsqueeze(1).expand(T, TOP_K, D).reshape(T * TOP_K, D)
    outs = ops.moe_experts(rows, experts.gate_up, experts.down, ones, ids.reshape(-1, 1)).view(T, TOP_K, D)
    assert torch.equal(combine_rank_order(outs, weights, dtype), want)
    reverse = combine_rank_order(outs.flip(1), weights.flip(1), dtype)
    assert dtype == torch.bfloat16 or not torch.equal(reverse, want)
    pair = combine_rank_order(outs[:, :2], weights[:, :2], dtype)
    assert torch.equal(combine_rank_order(outs[:, :2].flip(1), weights[:, :2].flip(1), dtype), pair)
