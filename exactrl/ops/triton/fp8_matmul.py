"""The block-scaled fp8 GEMM on CUDA (`exactrl.ops.fp8`'s recipe): out[m, n] = sum over K-blocks in order of
dot(a_q[m, kb], w_q[n, kb]) * a_scale[m, kb] * w_scale[n, kb], accumulated in fp32.

Why a row's result cannot depend on M or on the other rows of the call (the project's batch-invariance rule):
- ONE tile configuration for every call (`FP8_TILE`), so no shape ever picks another MMA shape or K step. Every
  output element is the same chain: for kb = 0, 1, ... one tensor-core dot over the block's 128 values into a
  fresh fp32 accumulator, scaled by the row's and the column's block scales, added to the running fp32 sum.
- No split-K, no atomics; M is not specialised (`do_not_specialize`); rows past M are masked and never stored.
- K is padded to whole 128-blocks with zeros by the quantizers (zeros add exactly 0 to a dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import pdl, pdl_wait

FP8_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
BLOCK_K = 128


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    KB,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # a dependent launch (engine decode steps) waits here for its predecessor's writes
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
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None], other=0.0)
        d = tl.dot(a, tl.trans(w), out_dtype=tl.float32)  # one block's dot, its own fp32 accumulator
        sa = tl.load(as_ptr + offs_m * stride_asm + kb, mask=m_ok, other=0.0)
        sw = tl.load(ws_ptr + offs_n * stride_wsn + kb, mask=n_ok, other=0.0)
        acc = acc + (d * sa[:, None]) * sw[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a: [M, KB * 128] e4m3, a_scale: [M, KB] fp32, w: [N, KB * 128] e4m3, w_scale: [N, KB] fp32 -> [M, N]."""
    m, kp = a.shape
    n = w.shape[0]
    kb = a_scale.shape[1]
    if w.shape[1] != kp or kp != kb * BLOCK_K or w_scale.shape != (n, kb):
        raise ValueError(
            f"fp8 GEMM shapes disagree: a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)}, w {tuple(w.shape)}, "
            f"w_scale {tuple(w_scale.shape)} (K padded to whole {BLOCK_K}-blocks)"
        )
    if a.stride(1) != 1 or w.stride(1) != 1 or a_scale.stride(1) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8 GEMM operands need a contiguous last dimension")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    tile = FP8_TILE
    grid = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(n, tile["BLOCK_N"]))
    _fp8_gemm_kernel[grid](
        a,
        a_scale,
        w,
        w_scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        kb,
        a.stride(0),
        a_scale.stride(0),
        w.stride(0),
        w_scale.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=tile["BLOCK_M"],
        BLOCK_N=tile["BLOCK_N"],
        BLOCK_K=BLOCK_K,
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
        **pdl(a.device),
    )
    return out
