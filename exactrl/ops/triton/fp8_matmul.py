"""The block-scaled fp8 linear on CUDA (`exactrl.ops.fp8`'s recipe), one launch: out[m, n] = sum over K-blocks in
order of dot(a_q[m, kb], w_q[n, kb]) * a_scale[m, kb] * w_scale[n, kb], accumulated in fp32, where the activation's
fp8 values and scales are made inside the kernel from the model-dtype x: each program loads a row's 128-channel
group, takes its amax (exact in any order), scale = amax / 448 (1 for an all-zero group) and rounds x / scale to
e4m3 (saturating). A decode step would otherwise spend more launches quantizing than multiplying.

Why a row's result cannot depend on M or on the other rows of the call (the project's batch-invariance rule):
- ONE tile configuration for every call (`FP8_TILE`), so no shape ever picks another MMA shape or K step. Every
  output element is the same chain: for kb = 0, 1, ... one tensor-core dot over the block's 128 values into a
  fresh fp32 accumulator, scaled by the row's and the column's block scales, added to the running fp32 sum.
- No split-K, no atomics; M is not specialised (`do_not_specialize`); rows past M are masked and never stored.
- A row's activation scales and fp8 values come from that row's own group alone, the same instructions in every
  program: the same bits whatever else the tile holds. Channels past K load as zeros (adding exactly 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
BLOCK_K = 128


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    KB,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(KB):
        k = kb * BLOCK_K + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0
        ).to(tl.float32)
        # the row's group: scale from its own amax, values rounded to e4m3 (IEEE division, clamp, nearest-even)
        amax = tl.max(tl.abs(x), axis=1)
        sa = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        a = tl.clamp(tl.math.div_rn(x, sa[:, None]), -448.0, 448.0).to(tl.float8e4nv)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None], other=0.0)
        d = tl.dot(a, tl.trans(w), out_dtype=tl.float32)  # one block's dot, its own fp32 accumulator
        sw = tl.load(ws_ptr + offs_n * stride_wsn + kb, mask=n_ok, other=0.0)
        acc = acc + (d * sa[:, None]) * sw[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [M, K] model dtype, w: [N, KB * 128] e4m3 (`quantize_weight`), w_scale: [N, KB] fp32 -> [M, N] in
    x.dtype: x quantized per row and 128-channel group inside the kernel."""
    m, k = x.shape
    n = w.shape[0]
    kb = w_scale.shape[1]
    if w.shape[1] != kb * BLOCK_K or -(-k // BLOCK_K) != kb or w_scale.shape != (n, kb):
        raise ValueError(
            f"fp8 linear shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, w_scale {tuple(w_scale.shape)} "
            f"(the weight's K padded to whole {BLOCK_K}-blocks)"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8 linear: the weight and its scales need a contiguous last dimension")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tile = FP8_TILE
    grid = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(n, tile["BLOCK_N"]))
    _fp8_linear_kernel[grid](
        x,
        w,
        w_scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        kb,
        x.stride(0),
        w.stride(0),
        w_scale.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=tile["BLOCK_M"],
        BLOCK_N=tile["BLOCK_N"],
        BLOCK_K=BLOCK_K,
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )
    return out
