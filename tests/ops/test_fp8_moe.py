"""The grouped fp8 experts (exactrl/ops/triton/fp8_moe.py) give the bits of the all-slots composition (every
expert over every token through the dense fp8 kernel, keeping its routed slots): torch.equal. Without CUDA in
Triton's interpreter at small shapes; on a GPU (`gpu`) through `Fp8Ops.moe_experts` at qwen3-30b-a3b-like shapes,
grouped (no gradients) against all slots. Their backward: test_fp8_backward.py."""

from __future__ import annotations

import pytest
import torch
from triton_mode import triton_device

DEVICE = triton_device()

from exactrl.ops.fp8 import Fp8Ops, quantize_weight  # noqa: E402
from exactrl.ops.moe_torch import combine_rank_order  # noqa: E402
from exactrl.ops.torch_ops import ExactTorchOps  # noqa: E402
from exactrl.ops.triton.fp8_matmul import fp8_gemm_triton  # noqa: E402
from exactrl.ops.triton.fp8_moe import fp8_experts_grouped  # noqa: E402
from exactrl.ops.triton.fp8_quant import quantize_activations_triton  # noqa: E402


def _moe(t, d, inter, e, k, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).bfloat16()
    gate_up = (0.05 * torch.randn(e, 2 * inter, d, generator=g)).bfloat16()
    down = (0.05 * torch.randn(e, d, inter, generator=g)).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[: t // 2, 0] = 1  # a hot expert: more than one 64-row tile when t > 128
    ids[: t // 2, 1:] = torch.where(ids[: t // 2, 1:] == 1, 0, ids[: t // 2, 1:])
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    return [v.to(device) for v in (x, gate_up, down, weights, ids)]


def _quantized(w, parts=None):
    qs = [quantize_weight(w[i], parts) for i in range(w.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def _all_slots(x, gu_q, down_q, weights, ids, silu_mul, quantize):
    """Every expert over every token through the dense fp8 kernel, keeping its slots (`torch.where`: no
    arithmetic)."""
    t, k = ids.shape
    inter = gu_q[0].shape[1] // 2
    outs = x.new_zeros(t, k, x.shape[1])
    qx, sx = quantize(x)  # once: row-local, the bits fp8_linear's per-expert quantization gives
    for e in range(gu_q[0].shape[0]):
        gu = fp8_gemm_triton(qx, sx, gu_q[0][e], gu_q[1][e], None, x.dtype)
        h = silu_mul(gu[:, :inter], gu[:, inter:])
        qh, sh = quantize(h)
        o = fp8_gemm_triton(qh, sh, down_q[0][e], down_q[1][e], None, x.dtype)
        outs = torch.where((ids == e)[..., None], o[:, None, :], outs)
    return combine_rank_order(outs, weights, x.dtype)


def test_grouped_equals_all_slots_interpret():
    """Odd K of both GEMMs (136 and 40: a partial 128-block), an empty expert, a token whose ids change
    (its output changes, no other token's does: the check can fail)."""
    if DEVICE == "cuda":
        pytest.skip("the interpreter's test; the GPU runs test_grouped_equals_all_slots_gpu")
    x, gate_up, down, weights, ids = _moe(7, 136, 40, 4, 2)
    ids[ids == 3] = 2  # expert 3 gets no token
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 3, ids[:, 1])
    gu_q, down_q = _quantized(gate_up.float(), [40, 40]), _quantized(down.float())
    silu_mul = ExactTorchOps().silu_mul
    ref = _all_slots(x, gu_q, down_q, weights, ids, silu_mul, quantize_activations_triton)
    got = fp8_experts_grouped(x, gu_q, down_q, weights, ids, silu_mul, quantize_activations_triton)
    assert torch.equal(got, ref)
    ids2 = ids.clone()
    ids2[4] = ids[4].flip(0)  # the same experts in the other rank order: other weights on each
    got2 = fp8_experts_grouped(x, gu_q, down_q, weights, ids2, silu_mul, quantize_activations_triton)
    assert not torch.equal(got2[4], got[4])
    keep = torch.arange(7) != 4
    assert torch.equal(got2[keep], got[keep])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_grouped_equals_all_slots_gpu(t):
    """Fp8Ops.moe_experts on CUDA without gradients (the grouped kernel) equals the all-slots form, torch.equal,
    at qwen3-30b-a3b's expert shapes (D 2048, I 768, 128 experts, 8 a token), and inside a CUDA graph replayed
    with another routing."""
    if DEVICE != "cuda":
        pytest.skip("needs a GPU")
    from exactrl.ops import get_ops

    x, gate_up, down, weights, ids = _moe(t, 2048, 768, 128, 8, seed=t)
    ops = Fp8Ops(get_ops("cuda"))
    ops.register(gate_up, [768, 768])
    ops.register(down)
    e_gu, e_down = ops._entry(gate_up), ops._entry(down)
    fp8 = (e_gu.q, e_gu.scale), (e_down.q, e_down.scale)
    silu_mul = ops.inner.silu_mul
    with torch.no_grad():
        got = ops.moe_experts(x, gate_up, down, weights, ids)
        ref = _all_slots(x, *fp8, weights, ids, silu_mul, quantize_activations_triton)
        assert torch.equal(got, ref)
        # A CUDA graph captured with one routing, replayed with another: the graph's result equals eager.
        ids_b = _moe(t, 2048, 768, 128, 8, seed=t + 1)[4]
        static_ids = ids.clone()
        ops.moe_experts(x, gate_up, down, weights, static_ids)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = ops.moe_experts(x, gate_up, down, weights, static_ids)
        static_ids.copy_(ids_b)
        graph.replay()
        ref_b = _all_slots(x, *fp8, weights, ids_b, silu_mul, quantize_activations_triton)
        assert torch.equal(static_out, ref_b)
        assert t == 1 or not torch.equal(ref_b, ref)
