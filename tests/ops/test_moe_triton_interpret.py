"""The MoE Triton kernels (exactrl/ops/triton/moe.py) on small shapes: against float64 references, and for
exact invariance of a token's bits to the rest of the batch and to how it is routed.

Runs everywhere: without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the kernels
are first imported), with CUDA compiled. The model-shape checks and CUDA-graph replay live in
test_moe_triton_gpu.py. The interpreter rounds fp32 to bf16 toward zero (the GPU rounds to nearest), which
roughly doubles each bf16 rounding error: hence the looser bf16 tolerance here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_mode import triton_device

DEVICE = triton_device()

from exactrl.ops.fast_cuda import FastCudaOps  # noqa: E402
from exactrl.ops.triton import common  # noqa: E402
from exactrl.ops.triton import moe as moe_mod  # noqa: E402
from exactrl.ops.triton.elementwise import silu_mul  # noqa: E402
from exactrl.ops.triton.matmul import MatmulConfig, linear, matmul  # noqa: E402
from exactrl.ops.triton.moe import (  # noqa: E402
    MoETileConfig,
    grouped_gate_up_silu,
    grouped_linear,
    moe_tile_config,
    route_plan,
)
from exactrl.ops.triton_ops import TritonOps  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2 if common.INTERPRET else 1e-2}
ops = TritonOps()
T, D, INTER, E, K = 70, 40, 24, 6, 2  # D, INTER: K of the two GEMMs not a multiple of the K step
HOT, COLD = 1, 3  # expert HOT gets every token (two row tiles), expert COLD none


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def uneven_routing(tokens: int, seed: int = 0, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k]) with distinct experts per token: HOT in every token, at rank t % k; COLD
    never; the other ranks random among the rest (uneven loads)."""
    g = torch.Generator().manual_seed(seed)
    others = torch.tensor([e for e in range(E) if e not in (HOT, COLD)])
    ids = torch.empty(tokens, k, dtype=torch.int64)
    for t in range(tokens):
        rest = others[torch.randperm(len(others), generator=g)[: k - 1]].tolist()
        ids[t] = torch.tensor(rest[: t % k] + [HOT] + rest[t % k :])
    w = torch.rand(tokens, k, generator=g) + 0.1
    return (w / w.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def expert_weights(dtype, d=D, i=INTER, seed=1):
    return randn(E, 2 * i, d, dtype=dtype, scale=d**-0.5, seed=seed), randn(
        E, d, i, dtype=dtype, scale=i**-0.5, seed=seed + 1
    )


def experts_reference(x, gate_up, down, weights, ids):
    """The interface's formula in float64, pair by pair."""
    x, gate_up, down, weights = (t.double() for t in (x, gate_up, down, weights))
    i = down.shape[2]
    gu = torch.einsum("td,tknd->tkn", x, gate_up[ids])
    h = F.silu(gu[..., :i]) * gu[..., i:]
    o = torch.einsum("tki,tkdi->tkd", h, down[ids])
    return (weights[..., None] * o).sum(1)


# ------------------------------------------------------------------------------------------------------------
# routing
# ------------------------------------------------------------------------------------------------------------


def route_expected(logits: torch.Tensor, k: int) -> torch.Tensor:
    """ids: the k largest logits (softmax is monotonic), ties to the lowest expert id."""
    rows = logits.float().cpu().tolist()
    return torch.tensor([sorted(range(len(r)), key=lambda e: (-r[e], e))[:k] for r in rows]).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_route_reference_ties_and_rows(dtype, norm):
    """qwen3-30b-a3b's router shape (E = 128, k = 8): ids by the tie rule, weights against float64, a row's
    result the same bits in any call."""
    n_exp, k = 128, 8
    logits = randn(37, n_exp, dtype=dtype, seed=3)
    logits[0] = 0.5  # a row of equal logits: experts 0..k-1
    logits[1, 9] = logits[1, 4] = logits[1].max() + 1  # a tie at the top: 4 before 9
    logits[2, 100:] = logits[2, :28]  # many tied pairs
    w, ids = ops.moe_route(logits, k, norm)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, route_expected(logits, k))
    assert ids[0].tolist() == list(range(k)) and ids[1, :2].tolist() == [4, 9]
    probs = torch.softmax(logits.double(), -1).gather(1, ids)
    ref = probs / probs.sum(-1, keepdim=True) if norm else probs
    assert rel_err(w, ref) < 1e-6
    for m in (1, 2, 5, 17):
        wm, im = ops.moe_route(logits[m:][:m], k, norm)
        assert torch.equal(wm, w[m:][:m]) and torch.equal(im, ids[m:][:m]), f"rows of an {m}-row call differ"


@pytest.mark.parametrize("norm", [True, False])
def test_route_grad(norm):
    n_exp, k = 10, 3  # E and k not powers of two: masked lanes
    logits = randn(23, n_exp, seed=4).requires_grad_(True)
    w, ids = ops.moe_route(logits, k, norm)
    gw = randn(23, k, seed=5)
    w.backward(gw)
    ref_logits = logits.detach().double().requires_grad_(True)
    p = torch.softmax(ref_logits, -1).gather(1, ids)
    (p / p.sum(-1, keepdim=True) if norm else p).backward(gw.double())
    assert rel_err(logits.grad, ref_logits.grad) < 1e-5


# ------------------------------------------------------------------------------------------------------------
# routing bookkeeping
# ------------------------------------------------------------------------------------------------------------


def test_route_plan_bookkeeping():
    """Sorted by expert, stable in token order; the inverse map; group bounds and row tiles per expert, with
    empty experts; the worst-case tile count covers the tiles."""
    _, ids = uneven_routing(T, seed=6)
    plan = route_plan(ids, E, 16)
    flat = ids.reshape(-1).cpu()
    order = sorted(range(T * K), key=lambda p: (flat[p].item(), p))  # stable: pair index, hence token order
    assert plan.tok.cpu().tolist() == [p // K for p in order]
    assert plan.pos.cpu()[torch.tensor(order)].tolist() == list(range(T * K))
    counts = torch.bincount(flat, minlength=E)
    assert counts[COLD] == 0 and counts[HOT] == T
    assert plan.bounds.cpu().tolist() == [0] + torch.cumsum(counts, 0).tolist()
    tiles = (counts + 15) // 16
    assert plan.tile_begin.cpu().tolist() == [0] + torch.cumsum(tiles, 0).tolist()
    assert plan.max_tiles >= plan.tile_begin[-1].item()


# ------------------------------------------------------------------------------------------------------------
# experts: values, invariance, the dense composition
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [D, 64])  # K of the first GEMM uneven / a multiple of the K step
def test_experts_reference(dtype, d):
    x = randn(T, d, dtype=dtype, seed=7)
    gate_up, down = expert_weights(dtype, d=d)
    w, ids = uneven_routing(T, seed=8)
    out = ops.moe_experts(x, gate_up, down, w, ids)
    assert out.dtype == dtype and out.shape == (T, d)
    assert rel_err(out, experts_reference(x, gate_up, down, w, ids)) < TOL[dtype]


def experts_row_failures(fn, x, gate_up, down, w, ids, prefixes=(1, 2, 5, 17, 64), others=True) -> list[str]:
    """Which ways of calling with other batches change a token's bits: prefixes of m tokens, the tokens
    permuted (rows land elsewhere in their groups), and the other tokens rerouted (every group changes size)."""
    full = fn(x, gate_up, down, w, ids)
    bad = []
    for m in prefixes:
        if not torch.equal(fn(x[:m], gate_up, down, w[:m], ids[:m]), full[:m]):
            bad.append(f"prefix {m}")
    if not others:
        return bad
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    if not torch.equal(fn(x[perm], gate_up, down, w[perm], ids[perm]), full[perm]):
        bad.append("permuted")
    keep = torch.arange(len(x), device=DEVICE) % 3 == 0
    rerouted = torch.where(keep[:, None], ids, torch.tensor([COLD, 0], device=DEVICE))
    if not torch.equal(fn(x, gate_up, down, w, rerouted)[keep], full[keep]):
        bad.append("others rerouted")
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_rows_invariant(dtype):
    """D = 136: three K steps or more in the first GEMM (a split of K, or a K step, that depended on the
    group or the call would show)."""
    d = 136
    x = randn(T, d, dtype=dtype, seed=10)
    gate_up, down = expert_weights(dtype, d=d)
    w, ids = uneven_routing(T, seed=11)
    assert experts_row_failures(ops.moe_experts, x, gate_up, down, w, ids) == []


def k_step_by_call_size(x, gate_up, down, w, ids):
    """A plausible, wrong MoE: calls of few routed rows (decode) take a shallower K step, as a kernel tuned per
    call size might. The negative control of the invariance check."""
    plan = route_plan(ids, E, 64)
    cfg = MoETileConfig(64, 64, 16 if ids.numel() <= 16 else 32, 4, 2)
    gu = grouped_linear(x, gate_up, plan, gather=True, config=cfg)
    o = grouped_linear(silu_mul(gu[:, :INTER], gu[:, INTER:]), down, plan, gather=False, config=cfg)
    return moe_mod.combine(o, plan, w, x.shape[0])


def test_experts_row_check_negative_control():
    """The same check finds the rows of an MoE whose K step depends on the call size, and (on the CPU) of the
    fast path: torch._grouped_mm runs a GEMM per group there, and fp32 rows of small GEMMs differ (DESIGN.md's
    measured fact)."""
    x = randn(T, D, seed=10)
    gate_up, down = expert_weights(torch.float32)
    w, ids = uneven_routing(T, seed=11)
    assert "prefix 1" in experts_row_failures(k_step_by_call_size, x, gate_up, down, w, ids, (1,), False)
    if DEVICE == "cpu":
        x, gate_up, down = randn(T, 48, seed=10), *expert_weights(torch.float32, d=48, i=32)
        assert experts_row_failures(FastCudaOps().moe_experts, x, gate_up, down, w, ids, (1, 2, 3, 5), False)


def dense_composition(x, gate_up, down, w, ids, config):
    """The dense path, expert by expert: each expert's tokens through the dense GEMM kernel (`linear`'s kernel
    at the grouped kernel's K step), silu_mul, the dense GEMM; then the combine in rank order in fp32 with
    torch. Returns (o [T, K, D] per pair, out [T, D])."""
    i = down.shape[2]
    o = torch.empty(*ids.shape, x.shape[1], dtype=x.dtype, device=DEVICE)
    for e in range(gate_up.shape[0]):
        t, r = torch.nonzero(ids == e, as_tuple=True)
        if len(t):
            gu = matmul(x[t], gate_up[e], config=config)
            o[t, r] = matmul(silu_mul(gu[:, :i], gu[:, i:]), down[e], config=config)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=DEVICE)
    for r in range(ids.shape[1]):
        acc = acc + w[:, r : r + 1] * o[:, r].float()
    return o, acc.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_equal_dense_composition(dtype):
    """A routed row has the dense kernel's bits for its expert's weights (same K step, same MMA chain), and the
    combine is rank order in fp32. fp32 compares end to end, and against `linear` itself (one fp32 tile); bf16
    compares the expert outputs (the interpreter's bf16 cast truncates, torch's rounds: the final cast differs
    here, not on the GPU, where test_moe_triton_gpu.py compares end to end). k = 4: with two terms the order
    of a sum cannot show."""
    k = 4
    x = randn(T, D, dtype=dtype, seed=12)
    gate_up, down = expert_weights(dtype)
    w, ids = uneven_routing(T, seed=13, k=k)
    cfg = moe_tile_config(T * k, dtype)
    dense_cfg = MatmulConfig(64, 64, cfg.block_k, 8, 4, 2)
    o_ref, out_ref = dense_composition(x, gate_up, down, w, ids, dense_cfg)
    plan = route_plan(ids, E, cfg.block_m)
    gu = grouped_linear(x, gate_up, plan, gather=True)
    o = grouped_linear(silu_mul(gu[:, :INTER], gu[:, INTER:]), down, plan, gather=False)
    assert torch.equal(o[plan.pos].view(T, k, D), o_ref)
    if dtype == torch.float32:
        assert torch.equal(matmul(x, gate_up[HOT], config=dense_cfg), linear(x, gate_up[HOT]))
        out = ops.moe_experts(x, gate_up, down, w, ids)
        assert torch.equal(out, out_ref)
        # The check can fail: the same sum in expert-id order (for tokens whose experts are not ascending by rank)
        # gives other bits.
        by_id = ids.argsort(1)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=DEVICE)
        for r in range(k):
            j = by_id[:, r : r + 1]
            acc = acc + w.gather(1, j) * o_ref.gather(1, j[..., None].expand(-1, -1, D))[:, 0].float()
        assert not torch.equal(acc, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_silu_epilogue_same_bits(dtype):
    """The gate/up GEMM with silu_mul in its epilogue (half-width column tiles, two accumulators) gives the bits
    of the plain grouped GEMM followed by the silu_mul kernel, and stores the same gate/up rows."""
    x = randn(T, D, dtype=dtype, seed=26)
    gate_up, _ = expert_weights(dtype)
    _, ids = uneven_routing(T, seed=27)
    plan = route_plan(ids, E, moe_tile_config(T * K, dtype).block_m)
    gu = grouped_linear(x, gate_up, plan, gather=True)
    h, kept = grouped_gate_up_silu(x, gate_up, plan, keep_gu=True)
    assert torch.equal(kept, gu)
    assert torch.equal(h, silu_mul(gu[:, :INTER], gu[:, INTER:]))
    assert torch.equal(grouped_gate_up_silu(x, gate_up, plan, keep_gu=False)[0], h)


def test_tile_family_same_bits():
    """The decode and training tiles (different BLOCK_N, one K step) give every routed row the same bits."""
    x = randn(T, D, dtype=torch.bfloat16, seed=14)
    gate_up, _ = expert_weights(torch.bfloat16)
    _, ids = uneven_routing(T, seed=15)
    decode, train = moe_mod._MOE_CONFIGS[torch.bfloat16]
    assert decode.block_n != train.block_n and decode.block_k == train.block_k
    plan = route_plan(ids, E, decode.block_m)
    a = grouped_linear(x, gate_up, plan, gather=True, config=decode)
    assert torch.equal(a, grouped_linear(x, gate_up, plan, gather=True, config=train))


def test_experts_decode_shapes():
    """One token, k = 1 and an expert count that is not a power of two; a call of no tokens."""
    gate_up, down = expert_weights(torch.float32)
    x = randn(5, D, seed=16)
    ids = torch.tensor([[4], [4], [0], [5], [4]], device=DEVICE)
    w = torch.ones(5, 1, device=DEVICE)
    full = ops.moe_experts(x, gate_up, down, w, ids)
    assert rel_err(full, experts_reference(x, gate_up, down, w, ids)) < TOL[torch.float32]
    assert torch.equal(ops.moe_experts(x[3:4], gate_up, down, w[3:4], ids[3:4]), full[3:4])
    empty = ops.moe_experts(x[:0], gate_up, down, w[:0], ids[:0])
    assert empty.shape == (0, D)


def test_experts_errors_name_the_problem():
    gate_up, down = expert_weights(torch.float32)
    x, (w, ids) = randn(4, D), uneven_routing(4)
    with pytest.raises(ValueError, match="gate_up"):
        ops.moe_experts(x, gate_up[:, :, :-1], down, w, ids)
    with pytest.raises(TypeError, match="int64"):
        ops.moe_experts(x, gate_up, down, w, ids.int())
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route(randn(4, E), E + 1, True)


# ------------------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------------------


def experts_grads(x, gate_up, down, w, ids, gy, fn=ops.moe_experts):
    leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    fn(*leaves, ids).backward(gy)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_grad_reference_and_deterministic(dtype):
    x = randn(T, D, dtype=dtype, seed=17)
    gate_up, down = expert_weights(dtype)
    w, ids = uneven_routing(T, seed=18)
    gy = randn(T, D, dtype=dtype, seed=19)
    grads = experts_grads(x, gate_up, down, w, ids, gy)
    refs = [t.double().requires_grad_(True) for t in (x, gate_up, down, w)]
    experts_reference(*refs, ids).backward(gy.double())
    for name, got, ref in zip(("x", "gate_up", "down", "weights"), grads, refs):
        assert got.shape == ref.shape and got.dtype == (torch.float32 if name == "weights" else dtype)
        assert rel_err(got, ref.grad) < TOL[dtype], f"d{name}"
    assert not grads[1][COLD].any() and not grads[2][COLD].any(), "an expert without tokens has zero gradient"
    again = experts_grads(x, gate_up, down, w, ids, gy)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "the backward is not deterministic"


def test_experts_grad_rows_and_expert_order():
    """dX and d(weights) of a token are its own business (a prefix call gives its rows the same bits), and an
    expert's weight gradient reduces over its own tokens in token order: the call of only the tokens routed to
    expert 4 gives expert 4 the same gradient bits, though every group's size and place changed."""
    dtype = torch.float32  # fp32 gradients: a changed reduction order shows in their bits
    x = randn(T, D, dtype=dtype, seed=20)
    gate_up, down = expert_weights(dtype)
    w, ids = uneven_routing(T, seed=21)
    gy = randn(T, D, dtype=dtype, seed=22)
    full = experts_grads(x, gate_up, down, w, ids, gy)
    m = 17
    part = experts_grads(x[:m], gate_up, down, w[:m], ids[:m], gy[:m])
    assert torch.equal(part[0], full[0][:m]) and torch.equal(part[3], full[3][:m])
    e = 4  # a group in the middle: its first sorted row moves between the two calls
    mine = (ids == e).any(1)
    assert 8 < mine.sum() < T
    sub = experts_grads(x[mine], gate_up, down, w[mine], ids[mine], gy[mine])
    assert torch.equal(sub[1][e], full[1][e]) and torch.equal(sub[2][e], full[2][e])


# ------------------------------------------------------------------------------------------------------------
# the fast path (torch._grouped_mm; the CPU build runs it too)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_path_close_to_exact(dtype):
    d, i = 48, 32  # _grouped_mm wants 16-byte rows
    fast = FastCudaOps()
    x = randn(T, d, dtype=dtype, seed=23)
    gate_up, down = expert_weights(dtype, d=d, i=i)
    w, ids = uneven_routing(T, seed=24)
    ref = experts_reference(x, gate_up, down, w, ids)
    assert rel_err(fast.moe_experts(x, gate_up, down, w, ids), ref) < TOL[dtype]
    gy = randn(T, d, dtype=dtype, seed=25)
    grads = experts_grads(x, gate_up, down, w, ids, gy, fn=fast.moe_experts)
    exact = experts_grads(x, gate_up, down, w, ids, gy)
    for got, want in zip(grads, exact):
        assert rel_err(got, want) < 2 * TOL[dtype]


def test_experts_grad_frozen_experts():
    """Frozen expert weights (a frozen base): only dX and d(weights) are computed, with the bits they have when
    every input takes a gradient."""
    x = randn(T, D, seed=28)
    gate_up, down = expert_weights(torch.float32)
    w, ids = uneven_routing(T, seed=29)
    gy = randn(T, D, seed=30)
    full = experts_grads(x, gate_up, down, w, ids, gy)
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ops.moe_experts(xl, gate_up, down, wl, ids).backward(gy)
    assert torch.equal(xl.grad, full[0]) and torch.equal(wl.grad, full[3])
