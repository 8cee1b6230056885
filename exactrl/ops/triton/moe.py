"""Mixture-of-experts ops in Triton: top-k routing and the routed expert MLPs, forward and backward.

`moe_route(logits, top_k, norm_topk_prob)` -> (weights [T, k] fp32, ids [T, k] int64): one program per token,
softmax in fp32 over the row, then k rounds of "largest probability, lowest expert id among equals". Row-local
by construction, so a token picks the same experts and weights in any batch.

`moe_experts(x, gate_up, down, weights, ids)` -> [T, D]: every token's k (token, rank) pairs are sorted by
expert, stably (within an expert by token index), on the device (`route_plan`); the expert MLPs run as grouped
GEMMs over that order (the gate/up GEMM with silu_mul in its epilogue, storing gate/up only when the backward
needs them); a combine kernel sums each token's k outputs in rank order, in fp32.

Why a token's bits cannot depend on the batch (the dense rule of exactrl/ops/triton/matmul.py, per expert):
- A grouped GEMM program computes a BLOCK_M-row tile of ONE expert's rows: the tile table says which expert
  and which rows (expert e's rows are cut into tiles from its own first row; the last tile is masked at the
  group's end). Its K loop is the dense kernel's: K in order, BLOCK_K at a time, into one fp32 accumulator
  per element, no split-K, no atomics. An element's value is a fixed chain of MMAs over its own row of the
  input and column of the weight; rows of a tile never mix. So the number of rows an expert received, and
  where a row sits in its group, only decide which tile computes the row and which rows are masked, never how.
- The tile geometry (`moe_tile_config`) depends on the dtype and on the call's routed row count, never on a
  group's size, and the K step (BLOCK_K) is one per dtype: members of the family differ in BLOCK_N only, which
  does not touch an element's arithmetic (column tiles are separate elements).
- Dense bits: both tiles are members of the dense kernel's tile family (64-row tiles, pointer loads, the same
  K step and MMA: wgmma m64nXk16 on Hopper), so a routed row should carry the bits of the dense
  `linear(x_t, W_e)` and the whole op those of the dense MLP composed expert by expert and combined in rank
  order. The interpreter tests show it at the same K step; tests/ops/test_moe_triton_gpu.py checks it end to
  end on the GPU (test_experts_equal_dense_composition).
- Routed row counts never reach the kernels as arguments: group bounds and the tile table live in device
  tensors, and grids and buffers are sized for the worst case (T*k routed rows, cdiv(T*k, BLOCK_M) + min(E, T*k)
  row tiles), from T, k and E alone. No host synchronisation, no data-dependent shape: a decode step runs in a
  CUDA graph and replays with any routing (tiles past the last expert's run no K step and store nothing).
- The combine sums a token's k weighted outputs in rank order (r = 0 .. k-1) in fp32, mul then add, each
  rounded (no FMA contraction): `sum_r weights[t, r] * o_r.float()`, then one cast to the model dtype.

Backward (deterministic; only the forward needs batch invariance, but every reduction here is also in a fixed
order): d(weights) and d(o) per token from the combine; d(h) through the down weights transposed (grouped GEMM,
with silu_mul's backward fused into its epilogue); dX per routed row through gate_up transposed, then summed
over the token's k rows in rank order; d(gate_up) and d(down) per expert as one program per output tile, reducing
over the expert's rows in sorted order (token order) in chunks that start at the group's first row, so an expert's
gradient depends only on its own rows, in token order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from exactrl.ops.moe_torch import check_experts_args
from exactrl.ops.triton.common import kernel_dtype_ok, mma, next_pow2, pdl, pdl_wait
from exactrl.ops.triton.elementwise import silu_mul_fwd

# ------------------------------------------------------------------------------------------------------------
# Tile configurations
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoETileConfig:
    """One grouped-GEMM tile: BLOCK_M routed rows of one expert x BLOCK_N output columns, K in BLOCK_K steps."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The K step per dtype is the dense training tile's (exactrl/ops/triton/matmul.py MATMUL_CONFIGS: 64 for 16-bit,
# 32 for fp32), so that a routed row runs the dense kernel's chain of MMAs. 64-row tiles: Hopper's smallest
# wgmma M, and the least padding per expert (an expert's last tile is on average half empty: E * 32 wasted rows).
# 16-bit, few routed rows (decode): 64-column tiles put twice the programs on the weights, which is all a
# decode step reads; many rows: 128 columns, fewer re-reads of the gathered rows. Not yet measured: the choice
# is a starting point for `benchmarks/probe_moe.py --sweep`, which times the alternatives and checks their bits.
_MOE_DECODE_ROWS = 1024
_MOE_CONFIGS: dict[torch.dtype, tuple[MoETileConfig, MoETileConfig]] = {
    torch.bfloat16: (MoETileConfig(64, 64, 64, 4, 4), MoETileConfig(64, 128, 64, 4, 4)),
    torch.float16: (MoETileConfig(64, 64, 64, 4, 4), MoETileConfig(64, 128, 64, 4, 4)),
    torch.float32: (MoETileConfig(64, 64, 32, 4, 3), MoETileConfig(64, 64, 32, 4, 3)),
}


@dataclass(frozen=True)
class WgradTileConfig:
    """One weight-gradient tile: a block_n x block_m tile of one expert's [N, M] gradient, block_r routed rows
    reduced per step. The reduction order (the group's rows in chunks from its first row) is fixed; the tile
    only splits the output."""

    block_n: int
    block_m: int
    block_r: int
    num_warps: int
    num_stages: int


_WGRAD_CONFIGS: dict[torch.dtype, WgradTileConfig] = {
    torch.bfloat16: WgradTileConfig(128, 128, 64, 8, 3),
    torch.float16: WgradTileConfig(128, 128, 64, 8, 3),
    torch.float32: WgradTileConfig(64, 64, 32, 4, 3),
}
_COMBINE_BLOCK = 1024


def moe_tile_config(routed_rows: int, dtype: torch.dtype) -> MoETileConfig:
    """The grouped-GEMM tile for a call of `routed_rows` = T * k rows. The choice depends on the call, never on
    how its rows are spread over the experts, and every member has the dtype's one K step (see the module
    docstring): a row's bits are the same whichever member computes it."""
    decode, train = _MOE_CONFIGS[dtype]
    return decode if routed_rows <= _MOE_DECODE_ROWS else train


# ------------------------------------------------------------------------------------------------------------
# Routing: softmax + top-k with the lowest-id tie rule
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _route_fwd_kernel(
    logits_ptr, probs_ptr, w_ptr, ids_ptr, E, stride_l,
    TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    ex = tl.exp(x - tl.max(x, axis=0))  # masked lanes: exp(-inf) = 0
    p = ex / tl.sum(ex, axis=0)
    tl.store(probs_ptr + row * E + offs, p, mask=ok)
    # Probabilities are >= 0, so -1 marks "taken or out of range".
    cand = tl.where(ok, p, -1.0)
    ranks = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    total = 0.0
    for r in tl.static_range(TOP_K):
        best = tl.max(cand, axis=0)
        # The lowest expert id among the maximal probabilities: the documented tie rule, on every device.
        pick = tl.min(tl.where(cand == best, offs, BLOCK_E), axis=0)
        w = tl.where(ranks == r, best, w)
        ids = tl.where(ranks == r, pick.to(tl.int64), ids)
        total = total + best  # fp32, rank order: ((w0 + w1) + w2) + ...
        cand = tl.where(offs == pick, -1.0, cand)
    if NORM:
        w = w / total
    tl.store(w_ptr + row * TOP_K + ranks, w, mask=ranks < TOP_K)
    tl.store(ids_ptr + row * TOP_K + ranks, ids, mask=ranks < TOP_K)


@triton.jit
def _route_bwd_kernel(
    probs_ptr, ids_ptr, gw_ptr, glogits_ptr, E, stride_g,
    TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # weights = sel / s (NORM) with sel = probs[ids], s = sum(sel): d sel = (gw - sum(gw * weights)) / s. Then
    # the softmax backward over the row: d logits = p * (g - sum(g * p)), g zero except at the k picked ids.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    ranks = tl.arange(0, BLOCK_K)
    rk = ranks < TOP_K
    p = tl.load(probs_ptr + row * E + offs, mask=ok, other=0.0)
    ids = tl.load(ids_ptr + row * TOP_K + ranks, mask=rk, other=0)
    gw = tl.load(gw_ptr + row * TOP_K + ranks, mask=rk, other=0.0)
    sel = tl.load(probs_ptr + row * E + ids, mask=rk, other=0.0)
    if NORM:
        s = tl.sum(sel, axis=0)
        gsel = (gw - tl.sum(gw * (sel / s), axis=0)) / s
    else:
        gsel = gw
    g = tl.zeros([BLOCK_E], tl.float32)
    for r in tl.static_range(TOP_K):
        g_r = tl.sum(tl.where(ranks == r, gsel, 0.0), axis=0)
        id_r = tl.sum(tl.where(ranks == r, ids, 0), axis=0)
        g = tl.where(offs == id_r, g_r, g)
    gl = p * (g - tl.sum(g * p, axis=0))
    tl.store(glogits_ptr + row * stride_g + offs, gl.to(glogits_ptr.dtype.element_ty), mask=ok)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, norm):  # type: ignore[override]
        probs, weights, ids = _route_fwd(logits, top_k, norm)
        ctx.save_for_backward(probs, ids)
        ctx.top_k, ctx.norm, ctx.dtype = top_k, norm, logits.dtype
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights, _grad_ids):  # type: ignore[override]
        probs, ids = ctx.saved_tensors
        T, E = probs.shape
        glogits = torch.empty((T, E), dtype=ctx.dtype, device=probs.device)
        if T:
            _route_bwd_kernel[(T,)](
                probs, ids, grad_weights.float().contiguous(), glogits, E, glogits.stride(0),
                TOP_K=ctx.top_k, NORM=ctx.norm, BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(ctx.top_k),
                **pdl(probs.device),
            )  # fmt: skip
        return glogits, None, None


def _route_fwd(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, ...]:
    T, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    probs = torch.empty((T, E), dtype=torch.float32, device=logits.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        _route_fwd_kernel[(T,)](
            logits, probs, weights, ids, E, logits.stride(0),
            TOP_K=top_k, NORM=norm, BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(top_k),
            **pdl(logits.device),
        )  # fmt: skip
    return probs, weights, ids


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] router output (model dtype) -> (weights [T, k] fp32, ids [T, k] int64).

    probs = softmax(logits.float()); the k largest in descending order, ties to the lowest expert id; with
    norm_topk_prob the weights are divided by their fp32 sum taken in rank order. One program per row: a row's
    result never depends on other rows. Differentiable w.r.t. logits through the weights."""
    if logits.dim() != 2:
        raise ValueError(f"moe_route needs logits [T, E], got shape {tuple(logits.shape)}")
    kernel_dtype_ok(logits)
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_route: top_k must be in 1..{logits.shape[1]} (the expert count), got {top_k}")
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Route.apply(logits, top_k, bool(norm_topk_prob))
    _, weights, ids = _route_fwd(logits, top_k, bool(norm_topk_prob))
    return weights, ids


# ------------------------------------------------------------------------------------------------------------
# Routing bookkeeping: the routed rows sorted by expert, on the device
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutePlan:
    """Where each (token, rank) pair goes, for T tokens with k experts each (S = T * k routed rows).

    Sorted order: the pairs ordered by expert, within an expert by token index (a stable sort of the flat ids,
    whose pair index t * k + r grows with the token). Every tensor lives on the device; shapes depend on T, k,
    E and block_m only."""

    tok: torch.Tensor  # [S] int64: the token of the routed row at each sorted position
    pos: torch.Tensor  # [S] int64: pos[t * k + r] = the sorted position of token t's rank-r pair
    bounds: torch.Tensor  # [E + 1] int64: expert e's rows are sorted positions bounds[e] .. bounds[e + 1]
    tile_begin: torch.Tensor  # [E + 1] int64: expert e's row tiles are tile_begin[e] .. tile_begin[e + 1]
    num_experts: int
    top_k: int
    block_m: int
    max_tiles: int  # row tiles launched: enough for any routing of S rows over E experts


@triton.jit(do_not_specialize=["S"])
def _plan_kernel(
    order_ptr, bounds_ptr, tok_ptr, pos_ptr, tile_begin_ptr, S, E,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """The sort's permutation -> each sorted row's token and each pair's sorted position; program 0 also turns
    the group bounds into the row-tile table (one launch instead of a handful of small torch ops)."""
    pdl_wait(USE_PDL)
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < S
    p = tl.load(order_ptr + j, mask=ok, other=0)
    tl.store(tok_ptr + j, p // TOP_K, mask=ok)
    tl.store(pos_ptr + p, j, mask=ok)  # a permutation: every address written once
    if tl.program_id(0) == 0:
        offs_e = tl.arange(0, BLOCK_E)
        e_ok = offs_e < E
        first = tl.load(bounds_ptr + offs_e, mask=e_ok, other=0)
        end = tl.load(bounds_ptr + 1 + offs_e, mask=e_ok, other=0)
        tiles_end = tl.cumsum((end - first + (BLOCK_M - 1)) // BLOCK_M, axis=0)
        tl.store(tile_begin_ptr + 1 + offs_e, tiles_end, mask=e_ok)
        tl.store(tile_begin_ptr, 0)


def route_plan(ids: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    """ids: [T, k] int64 expert ids (each in 0..E-1, distinct within a row) -> the device-side RoutePlan.

    No host synchronisation (capturable in a CUDA graph): a stable sort, a search for the group bounds and a
    cumulative sum of row tiles per expert. Ids outside 0..E-1 are not checked (that needs a sync); such pairs
    fall outside every group and their outputs are undefined."""
    T, k = ids.shape
    S, E, dev = T * k, num_experts, ids.device
    flat = ids.reshape(-1)
    # stable=True is the rule, not a detail: within an expert, rows stay in token order, which fixes the
    # order of the weight gradient's reduction over the expert's tokens.
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=dev, dtype=sorted_ids.dtype))
    tok = torch.empty(S, dtype=torch.int64, device=dev)
    pos = torch.empty(S, dtype=torch.int64, device=dev)
    if S:
        tile_begin = torch.empty(E + 1, dtype=torch.int64, device=dev)
        block = 1024
        _plan_kernel[(triton.cdiv(S, block),)](
            order,
            bounds,
            tok,
            pos,
            tile_begin,
            S,
            E,
            TOP_K=k,
            BLOCK_M=block_m,
            BLOCK=block,
            BLOCK_E=next_pow2(E),
            **pdl(order.device),
        )
    else:
        tile_begin = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    # Each non-empty expert wastes less than one tile: sum_e cdiv(n_e, BM) <= cdiv(S, BM) + min(E, S).
    max_tiles = triton.cdiv(S, block_m) + min(E, S)
    return RoutePlan(tok, pos, bounds, tile_begin, E, k, block_m, max_tiles)


# ------------------------------------------------------------------------------------------------------------
# Grouped GEMM: out[j] = a[row j] @ w[expert of j]^T over the sorted routed rows
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_expert(tile_begin_ptr, j, E, BLOCK_E: tl.constexpr):
    """The expert whose row tiles include tile j (E when j is past the last one): the number of experts whose
    tiles end at or before j. Empty experts end where they begin and are skipped over."""
    offs_e = tl.arange(0, BLOCK_E)
    ends = tl.load(tile_begin_ptr + 1 + offs_e, mask=offs_e < E, other=2**62)
    return tl.sum((ends <= j).to(tl.int32), axis=0)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, tok_ptr, w_ptr, out_ptr, gu_ptr, bounds_ptr, tile_begin_ptr,
    N, K, E,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_gm,
    GATHER: tl.constexpr, SILU: tl.constexpr, STORE_GU: tl.constexpr, DSILU: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """One (row tile, column tile) per program. GATHER: row j's input is a[tok[j]] (x, read in place), else a[j].
    SILU (the forward's gate/up GEMM): w is gate_up [E, 2N, K]; the program computes gate columns n and up
    columns N + n (two accumulators, each its own chain) and stores h = silu_mul(gate, up) [S, N], and with
    STORE_GU the gate/up rows [S, 2N] into gu (kept for the backward).
    DSILU (the backward's d(h) GEMM): out is d(gate_up) [S, 2N]; the epilogue applies silu_mul's backward with
    the forward's gate/up rows from gu, instead of storing d(h)."""
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    j = pid // num_pid_n  # column tiles of one row tile are neighbours: its rows are read from L2
    pid_n = pid % num_pid_n
    e = _tile_expert(tile_begin_ptr, j, E, BLOCK_E)
    # Tiles past the last expert's (the grid is sized for the worst case) run no K step and store nothing. No
    # branch around the body: the K loop stays the kernel's top-level loop, as in the dense kernel.
    live = e < E
    e = tl.minimum(e, E - 1)
    first = tl.load(bounds_ptr + e)
    end = tl.where(live, tl.load(bounds_ptr + e + 1), first)
    rows = first + (j - tl.load(tile_begin_ptr + e)) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    if GATHER:
        src = tl.load(tok_ptr + rows, mask=row_ok, other=0)
    else:
        src = rows
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N read column 0 and rows past the group are masked to zero; neither is stored, and
    # neither enters another element's chain (rows and columns never mix in the MMA).
    if EVEN_N:
        # No column past N: the plain arange keeps its contiguity for the compiler, so a weight read along N
        # (the backward's transposed weights) is vectorised; a `where` hides it (measured: the backward's two
        # GEMMs 13x slower on an H100). The loaded values, and so the bits, are the same either way.
        offs_bn = offs_n
    else:
        offs_bn = tl.where(offs_n < N, offs_n, 0)
    a_ptrs = a_ptr + src[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_bn[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.where(live, tl.cdiv(K, BLOCK_K), 0)):
        # K in order into one fp32 accumulator: the dense kernel's chain (no split-K).
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_ptrs)
            if SILU:
                b_up = tl.load(w_ptrs + N * stride_wn)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if SILU:
                b_up = tl.load(w_ptrs + N * stride_wn, mask=offs_k[:, None] < k_left, other=0.0)
        acc = mma(a, b, acc)
        if SILU:
            acc_up = mma(a, b_up, acc_up)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    rows64 = rows.to(tl.int64)
    ok = row_ok[:, None] & (offs_n[None, :] < N)
    o_ptrs = out_ptr + rows64[:, None] * stride_om + offs_n[None, :]
    if SILU:
        # gate and up round to the model dtype as the GEMM's output would, then silu_mul's arithmetic (that of
        # exactrl/ops/triton/elementwise.py's forward kernel: silu rounded, then the product rounded once).
        g = acc.to(out_ptr.dtype.element_ty)
        u = acc_up.to(out_ptr.dtype.element_ty)
        if STORE_GU:
            gu_ptrs = gu_ptr + rows64[:, None] * stride_gm + offs_n[None, :]
            tl.store(gu_ptrs, g, mask=ok)
            tl.store(gu_ptrs + N, u, mask=ok)
        gf = g.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_ptrs, (silu * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)
    elif DSILU:
        # d(h) rounds to the model dtype as a `linear` backward would, then silu_mul's backward in fp32
        # (the arithmetic of exactrl/ops/triton/elementwise.py's backward kernel).
        dh = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        g_ptrs = gu_ptr + rows64[:, None] * stride_gm + offs_n[None, :]
        g = tl.load(g_ptrs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(g_ptrs + N, mask=ok, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = (g * sig).to(out_ptr.dtype.element_ty).to(tl.float32)
        dg = dh * u * (sig * (1.0 + g * (1.0 - sig)))
        tl.store(o_ptrs, dg.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(o_ptrs + N, (dh * silu).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def grouped_linear(
    a: torch.Tensor,
    w: torch.Tensor,
    plan: RoutePlan,
    gather: bool,
    transposed: bool = False,
    dsilu_gu: torch.Tensor | None = None,
    config: MoETileConfig | None = None,
) -> torch.Tensor:
    """Routed rows through their experts' weights, in sorted order.

    a: [T, K] (gather: sorted row j reads a[plan.tok[j]]) or [S, K] (already in sorted order).
    w: [E, N, K] (row j -> a_j @ w[e]^T) or, transposed, [E, K, N] read in place (row j -> a_j @ w[e]).
    -> [S, N] in a.dtype; with dsilu_gu ([S, 2N], the forward's gate/up rows): [S, 2N] d(gate | up) of
    silu_mul's backward applied to d(h) = the product. `config` is for benchmarks and tests only."""
    if a.dtype != w.dtype:
        raise TypeError(f"grouped_linear: input and weight dtypes differ ({a.dtype} vs {w.dtype})")
    E = w.shape[0]
    N, K = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
    if a.shape[1] != K or E != plan.num_experts:
        raise ValueError(
            f"grouped_linear: input {tuple(a.shape)} and weight {tuple(w.shape)} (transposed={transposed}) "
            f"do not match (K = {K}, {plan.num_experts} experts in the plan)"
        )
    S = plan.tok.shape[0]
    cfg = config or moe_tile_config(S, a.dtype)
    if cfg.block_m != plan.block_m:
        raise ValueError(f"grouped_linear: tile rows {cfg.block_m} differ from the plan's {plan.block_m}")
    if a.stride(-1) != 1:
        a = a.contiguous()
    width = 2 * N if dsilu_gu is not None else N
    out = torch.empty((S, width), dtype=a.dtype, device=a.device)
    if S == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    swn, swk = (w.stride(2), w.stride(1)) if transposed else (w.stride(1), w.stride(2))
    gu = dsilu_gu if dsilu_gu is not None else out
    grid = (plan.max_tiles * triton.cdiv(N, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        a, plan.tok, w, out, gu, plan.bounds, plan.tile_begin,
        N, K, E,
        a.stride(0), a.stride(1), w.stride(0), swn, swk, out.stride(0), gu.stride(0),
        GATHER=gather, SILU=False, STORE_GU=False, DSILU=dsilu_gu is not None, EVEN_K=K % cfg.block_k == 0,
        EVEN_N=N % cfg.block_n == 0,
        BLOCK_E=next_pow2(E), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl(a.device),
    )  # fmt: skip
    return out


def grouped_gate_up_silu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    plan: RoutePlan,
    keep_gu: bool,
    config: MoETileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [T, D], gate_up: [E, 2I, D] -> (h [S, I], gu [S, 2I] or None): the routed rows' gate/up GEMM with
    silu_mul in its epilogue, in sorted order. h has the bits of `silu_mul` on the halves of
    `grouped_linear(x, gate_up, plan, gather=True)` (every element is its own chain; the epilogue is silu_mul's
    arithmetic). Each program covers block_n / 2 columns of each half: the tile's registers and weight bytes
    stay those of the plain GEMM. keep_gu: also store gate/up (the backward needs them)."""
    if x.dtype != gate_up.dtype:
        raise TypeError(f"grouped_gate_up_silu: x and gate_up dtypes differ ({x.dtype} vs {gate_up.dtype})")
    E, I2, K = gate_up.shape
    inter = I2 // 2
    if x.shape[1] != K or E != plan.num_experts or I2 % 2:
        raise ValueError(
            f"grouped_gate_up_silu: x {tuple(x.shape)} and gate_up {tuple(gate_up.shape)} do not match "
            f"({plan.num_experts} experts in the plan)"
        )
    S = plan.tok.shape[0]
    cfg = config or moe_tile_config(S, x.dtype)
    if cfg.block_m != plan.block_m:
        raise ValueError(
            f"grouped_gate_up_silu: tile rows {cfg.block_m} differ from the plan's {plan.block_m}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    h = torch.empty((S, inter), dtype=x.dtype, device=x.device)
    gu = torch.empty((S, I2), dtype=x.dtype, device=x.device) if keep_gu else None
    if S == 0 or inter == 0:
        return h, gu
    if K == 0:  # gate = up = 0: silu(0) * 0
        return h.zero_(), gu.zero_() if gu is not None else None
    half = max(16, cfg.block_n // 2)
    grid = (plan.max_tiles * triton.cdiv(inter, half),)
    gu_arg = gu if gu is not None else h
    _grouped_gemm_kernel[grid](
        x, plan.tok, gate_up, h, gu_arg, plan.bounds, plan.tile_begin,
        inter, K, E,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), h.stride(0),
        gu_arg.stride(0),
        GATHER=True, SILU=True, STORE_GU=gu is not None, DSILU=False, EVEN_K=K % cfg.block_k == 0,
        EVEN_N=inter % half == 0,
        BLOCK_E=next_pow2(E), BLOCK_M=cfg.block_m, BLOCK_N=half, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl(x.device),
    )  # fmt: skip
    return h, gu


# ------------------------------------------------------------------------------------------------------------
# Weight gradients: dW[e] = sum over expert e's rows, in sorted order, of g_j^T a_j
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _grouped_wgrad_kernel(
    g_ptr, a_ptr, tok_ptr, bounds_ptr, dw_ptr,
    N, M, stride_gm, stride_am, stride_de, stride_dn,
    GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    e = pid // (tiles_n * tiles_m)
    rest = pid % (tiles_n * tiles_m)
    offs_n = (rest // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = (rest % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The expert's rows in sorted (token) order, BLOCK_R at a time from its first row: the reduction order
    # depends on the expert's own rows only. An expert without rows stores zeros.
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < end
        if GATHER:
            src = tl.load(tok_ptr + rows, mask=r_ok, other=0)
        else:
            src = rows
        g = tl.load(
            g_ptr + rows[None, :].to(tl.int64) * stride_gm + offs_n[:, None],
            mask=n_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + src[:, None].to(tl.int64) * stride_am + offs_m[None, :],
            mask=r_ok[:, None] & m_ok[None, :],
            other=0.0,
        )
        acc = mma(g, a, acc)
    d_ptrs = dw_ptr + e.to(tl.int64) * stride_de + offs_n[:, None] * stride_dn + offs_m[None, :]
    tl.store(d_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def grouped_weight_grad(
    g: torch.Tensor, a: torch.Tensor, plan: RoutePlan, gather: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """g: [S, N] gradients of the routed rows' outputs (sorted order), a: the rows' inputs ([T, M] with gather,
    else [S, M]) -> [E, N, M]: expert e's sum over its rows j of outer(g_j, a_j), in sorted order."""
    g, a = g.contiguous(), a.contiguous()
    E, (S, N), M = plan.num_experts, g.shape, a.shape[1]
    dw = torch.empty((E, N, M), dtype=out_dtype, device=g.device)
    if E == 0 or N == 0 or M == 0:
        return dw
    if S == 0:
        return dw.zero_()
    cfg = _WGRAD_CONFIGS[g.dtype]
    grid = (E * triton.cdiv(N, cfg.block_n) * triton.cdiv(M, cfg.block_m),)
    _grouped_wgrad_kernel[grid](
        g, a, plan.tok, plan.bounds, dw,
        N, M, g.stride(0), a.stride(0), dw.stride(0), dw.stride(1),
        GATHER=gather, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl(g.device),
    )  # fmt: skip
    return dw


# ------------------------------------------------------------------------------------------------------------
# Combine: a token's k outputs in rank order, and its backward
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    src_ptr, pos_ptr, w_ptr, out_ptr, D, stride_s, stride_o,
    TOP_K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """out[t] = sum over r = 0..k-1, in that order, of w[t, r] * src[pos[t, r]] (fp32), cast once."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for r in tl.static_range(TOP_K):
        j = tl.load(pos_ptr + t * TOP_K + r)
        o = tl.load(src_ptr + j * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            acc = acc + tl.load(w_ptr + t * TOP_K + r) * o  # launched without FMA contraction
        else:
            acc = acc + o
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_bwd_kernel(
    gy_ptr, o_ptr, pos_ptr, w_ptr, do_ptr, gw_ptr, D, stride_gy, stride_o,
    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """For token t and rank r: d(o_r) = (w[t, r] * gy[t]).to(dtype) at o_r's sorted row, and
    d(w[t, r]) = sum over D of gy[t] * o_r in fp32: per lane over the BLOCK_D-column steps in order, then one
    reduction over the lanes."""
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    for r in tl.static_range(TOP_K):
        j = tl.load(pos_ptr + t * TOP_K + r)
        w = tl.load(w_ptr + t * TOP_K + r)
        dot = tl.zeros([BLOCK_D], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = cols < D
            gy = tl.load(gy_ptr + t * stride_gy + cols, mask=ok, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + j * stride_o + cols, mask=ok, other=0.0).to(tl.float32)
            dot += gy * o
            tl.store(do_ptr + j * stride_o + cols, (w * gy).to(do_ptr.dtype.element_ty), mask=ok)
        tl.store(gw_ptr + t * TOP_K + r, tl.sum(dot, axis=0))


def combine(src: torch.Tensor, plan: RoutePlan, weights: torch.Tensor | None, T: int) -> torch.Tensor:
    """src: [S, D] routed rows in sorted order -> [T, D] in src.dtype: token t's sum over its k rows in rank
    order, weighted by weights [T, k] fp32 (or unweighted when None), in fp32."""
    S, D = src.shape
    out = torch.empty((T, D), dtype=src.dtype, device=src.device)
    if T == 0 or D == 0:
        return out
    block = min(_COMBINE_BLOCK, next_pow2(D))
    w = weights.contiguous() if weights is not None else src
    _combine_kernel[(T, triton.cdiv(D, block))](
        src, plan.pos, w, out, D, src.stride(0), out.stride(0),
        TOP_K=plan.top_k, HAS_W=weights is not None, BLOCK_D=block, enable_fp_fusion=False,
        **pdl(src.device),
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------------------
# The routed expert MLPs, forward and backward
# ------------------------------------------------------------------------------------------------------------


def _check_experts(x, gate_up, down, weights, ids) -> None:
    check_experts_args(x, gate_up, down, weights, ids)
    kernel_dtype_ok(x)


def _experts_fwd(x, gate_up, down, weights, plan, keep_gu: bool):
    h, gu = grouped_gate_up_silu(x, gate_up, plan, keep_gu)  # [S, I], and [S, 2I] gate | up for the backward
    o = grouped_linear(h, down, plan, gather=False)  # [S, D]
    return combine(o, plan, weights, x.shape[0]), gu, o


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_up, down, weights, ids):  # type: ignore[override]
        plan = route_plan(ids, gate_up.shape[0], moe_tile_config(ids.numel(), x.dtype).block_m)
        out, gu, o = _experts_fwd(x, gate_up, down, weights, plan, keep_gu=True)
        # h is not kept: the backward recomputes it from gu (one elementwise pass; saves [S, I] per layer).
        ctx.save_for_backward(
            x, gate_up, down, weights, gu, o, plan.tok, plan.pos, plan.bounds, plan.tile_begin
        )
        ctx.plan_meta = (plan.num_experts, plan.top_k, plan.block_m, plan.max_tiles)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, gate_up, down, weights, gu, o, tok, pos, bounds, tile_begin = ctx.saved_tensors
        plan = RoutePlan(tok, pos, bounds, tile_begin, *ctx.plan_meta)
        return (
            *experts_backward(grad_out, x, gate_up, down, weights, gu, o, plan, ctx.needs_input_grad),
            None,
        )


def experts_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    gu: torch.Tensor,
    o: torch.Tensor,
    plan: RoutePlan,
    needs: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The routed experts' backward (`moe_experts`', and the fp8 experts' of exactrl/ops/triton/fp8_moe.py):
    grad_out [T, D]; the forward's x [T, D], gate_up [E, 2I, D], down [E, D, I], weights [T, k] fp32, its gate/up
    rows gu [S, 2I] and expert outputs o [S, D] in the sorted order of `plan` (whose block_m must be the grouped
    kernels' `moe_tile_config` rows); needs: which of (x, gate_up, down, weights) want a gradient ->
    (dX, d(gate_up), d(down), d(weights)), None where not needed."""
    T, inter = x.shape[0], down.shape[2]
    gy = grad_out.contiguous()
    S, D = o.shape
    d_o = torch.empty_like(o)
    d_w = torch.empty((T, plan.top_k), dtype=torch.float32, device=x.device)
    if T and D:
        _combine_bwd_kernel[(T,)](
            gy, o, plan.pos, weights.contiguous(), d_o, d_w, D, gy.stride(0), o.stride(0),
            TOP_K=plan.top_k, BLOCK_D=min(_COMBINE_BLOCK, next_pow2(D)),
            **pdl(gy.device),
        )  # fmt: skip
    elif T:
        d_w.zero_()
    need_x, need_gu, need_down, need_w = needs[:4]
    d_x = d_gate_up = d_down = None
    d_gu = None
    if need_x or need_gu:
        d_gu = grouped_linear(d_o, down, plan, gather=False, transposed=True, dsilu_gu=gu)  # [S, 2I]
    if need_x:
        assert d_gu is not None  # computed above for need_x
        d_xr = grouped_linear(d_gu, gate_up, plan, gather=False, transposed=True)  # [S, D]
        d_x = combine(d_xr, plan, None, T)
    if need_gu:
        assert d_gu is not None  # computed above for need_gu
        d_gate_up = grouped_weight_grad(d_gu, x, plan, gather=True, out_dtype=gate_up.dtype)
    if need_down:
        h = silu_mul_fwd(gu[:, :inter], gu[:, inter:])
        d_down = grouped_weight_grad(d_o, h, plan, gather=False, out_dtype=down.dtype)
    return d_x, d_gate_up, d_down, d_w if need_w else None


def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x: [T, D]; gate_up: [E, 2I, D] (gate rows, then up rows); down: [E, D, I]; weights: [T, k] fp32;
    ids: [T, k] int64 -> [T, D] in x.dtype.

    For token t and rank r (e = ids[t, r]): gate | up = x_t @ gate_up[e]^T, h = silu_mul(gate, up),
    o_r = h @ down[e]^T, out_t = (sum over r in rank order of weights[t, r] * o_r.float()).to(x.dtype).
    Every row's bits are independent of the other rows of the call and of how they are routed (module
    docstring). Differentiable w.r.t. x, gate_up, down and weights; the backward is deterministic."""
    _check_experts(x, gate_up, down, weights, ids)
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = ids.contiguous()
    weights = weights.contiguous()
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate_up, down, weights))
    if needs_grad:
        return _MoEExperts.apply(x, gate_up, down, weights, ids)
    plan = route_plan(ids, gate_up.shape[0], moe_tile_config(ids.numel(), x.dtype).block_m)
    return _experts_fwd(x, gate_up, down, weights, plan, keep_gu=False)[0]
