"""The trainer's fp8 backward on the Triton backend: a projection's gradients are those of the exact bf16 `linear`
backward with the model-dtype weight (exactrl/ops/triton/matmul.py `linear_backward`), and the grouped fp8
experts' (exactrl/ops/triton/fp8_moe.py) those of the exact bf16 experts' backward (exactrl/ops/triton/moe.py
`_MoEExperts.backward`) fed the fp8 forward's saved gate/up rows and expert outputs, torch.equal; the forward
with gradients has the bits of the forward without (the engine's). Without CUDA in Triton's interpreter at small
shapes (the fp8 projections' forward then the CPU emulation, their backward the Triton kernels); on a GPU
(`gpu`) at qwen3-30b-a3b's expert shapes through `Fp8Ops.moe_experts`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fp8_backward_check import check_backward_is_the_wrapped_backends
from triton_mode import triton_device

DEVICE = triton_device()

from exactrl.ops.fp8 import Fp8Ops, dequantize_weight, quantize_weight  # noqa: E402
from exactrl.ops.triton import moe as moe_mod  # noqa: E402
from exactrl.ops.triton.fp8_moe import _fp8_experts_fwd, fp8_moe_experts  # noqa: E402
from exactrl.ops.triton.fp8_quant import quantize_activations_triton  # noqa: E402
from exactrl.ops.triton.moe import MoETileConfig, _MoEExperts, moe_experts  # noqa: E402
from exactrl.ops.triton_ops import TritonOps  # noqa: E402

# ------------------------------------------------------------------------------------------------------------
# projections
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_backward_is_tritons(dtype):
    """Fp8Ops(TritonOps) projections: dX, dW, dB torch.equal TritonOps.linear's (and packed_linear's) for the same
    grad_out, 13 rows; negative control: the old dX through the dequantized fp8 weight."""
    _check_triton_backward(dtype, 13, 200, [40, 16, 16])


@pytest.mark.gpu
def test_fp8_linear_backward_is_tritons_gpu():
    """The same on the GPU at a projection's size (the TMA GEMMs of the backward): 300 rows, 1,024 -> 1,536."""
    if DEVICE != "cuda":
        pytest.skip("needs a GPU")
    _check_triton_backward(torch.bfloat16, 300, 1024, [1024, 256, 256])


def _check_triton_backward(dtype, rows: int, k: int, sizes: list[int]) -> None:
    g0 = torch.Generator().manual_seed(0)
    n = sum(sizes)
    cols = torch.logspace(-1, 1, k)[torch.randperm(k, generator=g0)]
    x = torch.randn(rows, k, generator=g0).to(dtype).to(DEVICE)
    w = torch.nn.Parameter((0.05 * torch.randn(n, k, generator=g0) * cols).to(dtype).to(DEVICE))
    b = torch.nn.Parameter(torch.randn(n, generator=g0).to(dtype).to(DEVICE))
    g = torch.randn(rows, n, generator=g0).to(dtype).to(DEVICE)
    check_backward_is_the_wrapped_backends(TritonOps(), x, w, b, g, sizes)


# ------------------------------------------------------------------------------------------------------------
# routed experts
# ------------------------------------------------------------------------------------------------------------


def _moe(t, d, inter, e, k, dtype, seed=0):
    """(x, gate_up, down, weights, ids) with uneven loads: expert 1 in every other token, the last expert in none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    cols = torch.logspace(-1, 1, d)[
        torch.randperm(d, generator=g)
    ]  # trained-looking: channels of other scales
    gate_up = (d**-0.5 * torch.randn(e, 2 * inter, d, generator=g) * cols).to(dtype)
    down = (inter**-0.5 * torch.randn(e, d, inter, generator=g)).to(dtype)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])
    for row in range(0, t, 2):  # expert 1 at rank row % k
        others = [i for i in ids[row].tolist() if i != 1][: k - 1]
        ids[row] = torch.tensor(others[: row % k] + [1] + others[row % k :])
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    return [v.to(DEVICE) for v in (x, gate_up, down, weights, ids)]


def _quantized(w, parts=None):
    qs = [quantize_weight(w[i], parts) for i in range(w.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def _bf16_backward(gy, x, gate_up, down, weights, saved, needs=(True, True, True, True)):
    """The exact bf16 experts' backward (`_MoEExperts.backward`) fed the fp8 forward's saved (gu, o, plan)."""
    gu, o, plan = saved
    ctx = SimpleNamespace(
        saved_tensors=(x, gate_up, down, weights, gu, o, plan.tok, plan.pos, plan.bounds, plan.tile_begin),
        plan_meta=(plan.num_experts, plan.top_k, plan.block_m, plan.max_tiles),
        needs_input_grad=(*needs, False),
    )
    return _MoEExperts.backward(ctx, gy)[:4]


def _check_experts(t, d, inter, e, k, dtype, silu_mul, seed=0):
    """Fp8 experts with gradients: the forward's bits are the engine's; the gradients the bf16 backward's."""
    x, gate_up, down, weights, ids = _moe(t, d, inter, e, k, dtype, seed)
    gu_fp8, down_fp8 = _quantized(gate_up.float(), [inter, inter]), _quantized(down.float())
    quantize = quantize_activations_triton
    leaves = [v.clone().requires_grad_(True) for v in (x, gate_up, down, weights)]
    out = fp8_moe_experts(*leaves, ids, gu_fp8, down_fp8, silu_mul, quantize)
    assert out.grad_fn is not None
    # the forward without gradients (the engine's `fp8_experts_grouped` is its first output): the same bits
    ref_out, *saved = _fp8_experts_fwd(x, gu_fp8, down_fp8, weights, ids, silu_mul, quantize)
    assert torch.equal(out, ref_out)
    gy = torch.randn(t, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    grads = torch.autograd.grad(out, leaves, gy)
    ref = _bf16_backward(gy, x, gate_up, down, weights, saved)
    for name, a, r in zip(("x", "gate_up", "down", "weights"), grads, ref):
        assert a.dtype == r.dtype and torch.equal(a, r), name
    # negative control: the same backward through the dequantized fp8 weights (not the model-dtype ones)
    deq = torch.stack([dequantize_weight(gu_fp8[0][i], gu_fp8[1][i], d) for i in range(e)]).to(dtype)
    neg = _bf16_backward(gy, x, deq, down, weights, saved, needs=(True, False, False, False))
    assert not torch.equal(neg[0], grads[0])
    return leaves, ids, gy, grads


def test_fp8_experts_backward_interpret():
    """E 5, top-3, D 136 (a partial 128-block), I 128, 7 tokens, uneven loads and an empty expert; bf16."""
    if DEVICE == "cuda":
        pytest.skip("the interpreter's test; the GPU runs test_fp8_experts_backward_gpu")
    leaves, ids, gy, grads = _check_experts(7, 136, 128, 5, 3, torch.bfloat16, TritonOps().silu_mul)
    # the gradients of the fp8 function are near those of the bf16 one (a sanity bound, not a bit claim)
    bf = torch.autograd.grad(moe_experts(*leaves, ids), leaves, gy)
    for a, r in zip(grads, bf):
        assert ((a.double() - r.double()).norm() / r.double().norm()).item() < 0.25


def test_fp8_experts_backward_replans_for_other_row_tiles(monkeypatch):
    """Where the bf16 kernels' row tiles differ from the fp8 plan's 64 rows, the backward builds its own plan: the
    same gradients (a tile's rows never mix)."""
    if DEVICE == "cuda":
        pytest.skip("the interpreter's test (32-row tiles are not a GPU configuration)")
    silu_mul = TritonOps().silu_mul
    x, gate_up, down, weights, ids = _moe(7, 128, 128, 4, 3, torch.float32, seed=3)
    gu_fp8, down_fp8 = _quantized(gate_up.float(), [128, 128]), _quantized(down.float())
    leaves = [v.clone().requires_grad_(True) for v in (x, gate_up, down, weights)]
    gy = torch.randn(7, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def grads():
        out = fp8_moe_experts(*leaves, ids, gu_fp8, down_fp8, silu_mul, quantize_activations_triton)
        return torch.autograd.grad(out, leaves, gy)

    base = grads()
    small = MoETileConfig(32, 64, 32, 4, 3)
    monkeypatch.setitem(moe_mod._MOE_CONFIGS, torch.float32, (small, small))
    assert all(torch.equal(a, b) for a, b in zip(grads(), base))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [7, 300])
def test_fp8_experts_backward_gpu(t):
    """At qwen3-30b-a3b's expert shapes (D 2048, I 768, 128 experts, 8 a token) through Fp8Ops.moe_experts on
    CUDA: with gradients the bits of without, and the exact bf16 experts' backward fed the saved tensors."""
    if DEVICE != "cuda":
        pytest.skip("needs a GPU")
    from exactrl.ops import get_ops

    x, gate_up, down, weights, ids = _moe(t, 2048, 768, 128, 8, torch.bfloat16, seed=t)
    gate_up, down = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    ops = Fp8Ops(get_ops("cuda"))
    ops.register(gate_up, [768, 768])
    ops.register(down)
    e_gu, e_down = ops._entry(gate_up), ops._entry(down)
    xg, wg = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    out = ops.moe_experts(xg, gate_up, down, wg, ids)
    with torch.no_grad():
        assert torch.equal(out, ops.moe_experts(x, gate_up, down, weights, ids))
    gy = torch.randn(t, 2048, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    grads = torch.autograd.grad(out, (xg, gate_up, down, wg), gy)
    fp8 = (e_gu.q, e_gu.scale), (e_down.q, e_down.scale)
    with torch.no_grad():
        _, *saved = _fp8_experts_fwd(x, *fp8, weights, ids, ops.inner.silu_mul, quantize_activations_triton)
    ref = _bf16_backward(gy, x, gate_up.detach(), down.detach(), weights, saved)
    for name, a, r in zip(("x", "gate_up", "down", "weights"), grads, ref):
        assert torch.equal(a, r), name
    # and the whole check at this shape, with its negative control
    _check_experts(t, 2048, 768, 128, 8, torch.bfloat16, ops.inner.silu_mul, seed=t)
