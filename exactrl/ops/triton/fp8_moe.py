"""The routed experts in fp8 on CUDA, grouped: each expert's GEMMs over the slots routed to it only.

`fp8_experts_grouped` computes what every expert over every token, each keeping its routed slots, would compute
(the composition of `Fp8Ops`'s per-expert fp8 projections), with the FLOPs of the routed slots alone, bit for bit:
- the routed (token, rank) slots are sorted by expert on the device (`exactrl.ops.triton.moe.route_plan`, the bf16
  exact path's layout: no host synchronisation, grids sized for the worst case, so CUDA graphs capture it);
- x is quantized once (`quantize_activations` is row-local: a row's fp8 bits are the same in any call);
- the grouped fp8 GEMM gives each routed row the bits the dense fp8 GEMM gives it (`_fp8_grouped_kernel`: a 64-row
  tile of one expert's rows runs exactly `exactrl/ops/triton/fp8_matmul.py`'s per-element chain, one fresh fp32
  dot per 128-block, scaled, added in order; tiles of the family give the same bits: checked there);
- silu_mul, the quantizer of h and the rank-order combine are the same ops the per-expert composition calls, on
  the same rows (silu_mul and the quantizer are row-local).

With gradients (the trainer's forward, `fp8_moe_experts`) the forward is the same function, so the engine and the
trainer get the same bits; the backward is the exact bf16 experts' (`exactrl.ops.triton.moe.experts_backward`)
with the model-dtype expert weights, fed the forward's gate/up rows and expert outputs: the quantizers taken as the
identity, as in the fp8 projections' backward (exactrl/ops/fp8.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import next_pow2, num_programs_cap, pdl, pdl_wait
from exactrl.ops.triton.fp8_matmul import BLOCK_K, FP8_FAMILY, fp8_tile
from exactrl.ops.triton.moe import _MOE_DECODE_ROWS as _DECODE_ROWS
from exactrl.ops.triton.moe import RoutePlan, _tile_expert, experts_backward, moe_tile_config, route_plan


@triton.jit
def _fp8_grouped_kernel(
    a_ptr, as_ptr, tok_ptr, w_ptr, ws_ptr, out_ptr, bounds_ptr, tile_begin_ptr,
    N, KB, E,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    GATHER: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One (row tile of one expert, column tile) per program. GATHER: sorted row j reads a[tok[j]], else a[j]."""
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    j = pid // num_pid_n
    pid_n = pid % num_pid_n
    e = _tile_expert(tile_begin_ptr, j, E, BLOCK_E)
    live = e < E  # tiles past the last expert's (worst-case grid) run no K step and store nothing
    e = tl.minimum(e, E - 1)
    first = tl.load(bounds_ptr + e)
    end = tl.where(live, tl.load(bounds_ptr + e + 1), first)
    rows = first + (j - tl.load(tile_begin_ptr + e)) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    if GATHER:
        src = tl.load(tok_ptr + rows, mask=row_ok, other=0)
    else:
        src = rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    offs_wn = tl.where(n_ok, offs_n, 0)  # columns past N read column 0, never stored
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + src.to(tl.int64) * stride_asm
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_wn.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    ws_ptrs = ws_ptr + e.to(tl.int64) * stride_wse + offs_wn.to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _kb in range(tl.where(live, KB, 0)):  # the dense fp8 kernel's chain, in order
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs)
        d = tl.dot(a, tl.trans(w), out_dtype=tl.float32)  # one block's dot, its own fp32 accumulator
        sa = tl.load(as_ptrs, mask=row_ok, other=0.0)
        sw = tl.load(ws_ptrs)
        acc = acc + (d * sa[:, None]) * sw[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        as_ptrs += 1
        ws_ptrs += 1
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    plan: RoutePlan,
    gather: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a: [T or S, KB * 128] e4m3, a_scale: [T or S, KB] fp32 (gather: sorted row j reads row plan.tok[j]);
    w: [E, N, KB * 128] e4m3, w_scale: [E, N, KB] fp32 -> [S, N] out_dtype, sorted row j through its expert."""
    E, N, kp = w.shape
    kb = a_scale.shape[1]
    if a.shape[1] != kp or kp != kb * BLOCK_K or tuple(w_scale.shape) != (E, N, kb) or E != plan.num_experts:
        raise ValueError(
            f"fp8 grouped GEMM shapes disagree: a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)}, "
            f"w {tuple(w.shape)}, w_scale {tuple(w_scale.shape)}, {plan.num_experts} experts in the plan"
        )
    S = plan.tok.shape[0]
    out = torch.empty(S, N, dtype=out_dtype, device=a.device)
    if S == 0 or N == 0:
        return out
    # The tile from the call's routed row count (never a group's size); 64-row tiles, the route plan's. Any tile of
    # the family gives a row the same bits. Few rows (decode): 64 x 64, the bf16 grouped kernel's decode tile (the
    # dense rule's narrow tiles would multiply the worst-case grid's programs by E); many rows: the dense rule's.
    tile = FP8_FAMILY[1] if S <= _DECODE_ROWS else fp8_tile(S, N, num_programs_cap(a.device), swap=False)
    if tile.block_m != plan.block_m:
        raise ValueError(
            f"fp8 grouped GEMM: tile rows {tile.block_m} differ from the route plan's {plan.block_m}"
        )
    grid = (plan.max_tiles * triton.cdiv(N, tile.block_n),)
    _fp8_grouped_kernel[grid](
        a, a_scale, plan.tok, w, w_scale, out, plan.bounds, plan.tile_begin,
        N, kb, E,
        a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0),
        GATHER=gather, BLOCK_E=next_pow2(E), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=BLOCK_K,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl(a.device),
    )  # fmt: skip
    return out


def _fp8_experts_fwd(x, gate_up, down, weights, ids, silu_mul, quantize):
    """`fp8_experts_grouped`'s steps -> (out [T, D], gu [S, 2I] and o [S, D] in sorted order, the route plan)."""
    from exactrl.ops.moe_torch import combine_rank_order

    t, k = ids.shape
    E = gate_up[0].shape[0]
    inter = gate_up[0].shape[1] // 2
    plan = route_plan(ids, E, FP8_FAMILY[0].block_m)
    q_x, s_x = quantize(x)
    gu = fp8_grouped_gemm(q_x, s_x, gate_up[0], gate_up[1], plan, True, x.dtype)  # [S, 2I], sorted
    h = silu_mul(gu[:, :inter], gu[:, inter:])
    q_h, s_h = quantize(h)
    o = fp8_grouped_gemm(q_h, s_h, down[0], down[1], plan, False, x.dtype)  # [S, D], sorted
    return combine_rank_order(o[plan.pos].view(t, k, -1), weights, x.dtype), gu, o, plan


def fp8_experts_grouped(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    ids: torch.Tensor,
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """x: [T, D]; gate_up: (q [E, 2I, KB * 128] e4m3, scale [E, 2I, KB]); down: (q [E, D, KBI * 128], scale);
    weights: [T, k] fp32; ids: [T, k] -> [T, D] in x.dtype: each expert's fp8 GEMMs over its routed slots, the bits
    of every expert over every token keeping its slots (module docstring). No gradients (the engine's).
    silu_mul and quantize: the wrapped backend's silu_mul, the fp8 quantizer."""
    return _fp8_experts_fwd(x, gate_up, down, weights, ids, silu_mul, quantize)[0]


class _Fp8MoEExperts(torch.autograd.Function):
    """Forward: `fp8_experts_grouped`'s steps (the same bits), keeping gu, o and the route plan. Backward: the
    exact bf16 experts' backward (`exactrl.ops.triton.moe.experts_backward`) with the model-dtype expert weights:
    the quantizers of x, of h and of the weights taken as the identity, as the fp8 projections' backward."""

    @staticmethod
    def forward(ctx, x, gate_up, down, weights, ids, gate_up_fp8, down_fp8, silu_mul, quantize):  # type: ignore[override]
        out, gu, o, plan = _fp8_experts_fwd(x, gate_up_fp8, down_fp8, weights, ids, silu_mul, quantize)
        ctx.save_for_backward(
            x, gate_up, down, weights, ids, gu, o, plan.tok, plan.pos, plan.bounds, plan.tile_begin
        )
        ctx.plan_meta = (plan.num_experts, plan.top_k, plan.block_m, plan.max_tiles)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, gate_up, down, weights, ids, gu, o, tok, pos, bounds, tile_begin = ctx.saved_tensors
        plan = RoutePlan(tok, pos, bounds, tile_begin, *ctx.plan_meta)
        rows = moe_tile_config(tok.shape[0], x.dtype).block_m
        if rows != plan.block_m:
            # The bf16 kernels' row tiles differ from the fp8 ones (today both are 64 rows): their plan. The sorted
            # order (tok, pos, bounds) is the same stable sort, so gu and o are in its order too.
            plan = route_plan(ids, plan.num_experts, rows)
        grads = experts_backward(grad_out, x, gate_up, down, weights, gu, o, plan, ctx.needs_input_grad[:4])
        return (*grads, None, None, None, None, None)


def fp8_moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_fp8: tuple[torch.Tensor, torch.Tensor],
    down_fp8: tuple[torch.Tensor, torch.Tensor],
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The routed experts in fp8, grouped: `fp8_experts_grouped` (gate_up_fp8, down_fp8: the model-dtype stacks
    gate_up [E, 2I, D] and down [E, D, I] quantized), differentiable w.r.t. x, gate_up, down and weights when
    gradients are on (`_Fp8MoEExperts`: the same forward bits, the exact bf16 experts' backward)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate_up, down, weights)):
        return _Fp8MoEExperts.apply(x, gate_up, down, weights, ids, gate_up_fp8, down_fp8, silu_mul, quantize)
    return fp8_experts_grouped(x, gate_up_fp8, down_fp8, weights, ids, silu_mul, quantize)
