"""The block-scaled fp8 GEMM on CUDA (`exactrl.ops.fp8`'s recipe): out[m, n] = sum over K-blocks in order of
dot(a_q[m, kb], w_q[n, kb]) * a_scale[m, kb] * w_scale[n, kb], accumulated in fp32.

Why a row's result cannot depend on M or on the other rows of the call (the project's batch-invariance rule):
- Every output element is the same chain whatever tile computes it: for kb = 0, 1, ... one tensor-core dot over
  the block's 128 values into a fresh fp32 accumulator (K step fixed at 128, the recipe's block), scaled by the
  row's and then the column's block scale, added to the running fp32 sum; the bias after the loop; one rounding.
- The tile is picked per call from a family (`fp8_tile`), as the bf16 GEMM picks its tiles
  (exactrl/ops/triton/matmul.py): 64-row tiles of 128, 64, 32 or 16 columns, the widest that still gives most SMs a
  tile (a one-row decode GEMM would otherwise stream the weight through N / 64 programs); and for up to 32 rows a
  swapped tile (`_fp8_gemm_swap_kernel`: 64 weight rows on the MMA's 64-row side, the activation rows on its narrow
  side). Every one of them runs the block's dot as Hopper's fp8 wgmma (k = 32, four of them per block, in order),
  each element the same 128 products: the same bits from every tile. That is a property of the hardware, checked
  rather than assumed: benchmarks/probe_fp8_gemm.py compares the 64-row tiles torch.equal with the reference tile
  (`FP8_REF_TILE`) at 1..512 rows on qwen3-0.6b / 8b shapes, benchmarks/probe_fp8_swap.py the swapped tiles at 13 row
  counts of 1..64, and tests/ops/test_fp8_triton.py's GPU row sweep crosses every switch of the rule and forces
  every tile the rule can pick at 1, 31..33, 64, 65 and 640 rows.
- No split-K, no atomics; M is not specialised (`do_not_specialize`); rows past M are masked (zeros, never stored);
  columns past N read column 0 and are never stored.
- K is padded to whole 128-blocks with zeros by the quantizers (zeros add exactly 0 to a dot).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import num_programs_cap, pdl, pdl_wait

BLOCK_K = 128


@dataclass(frozen=True)
class Fp8Tile:
    """block_m rows of the activations by block_n rows of the weight (output columns). swap_ab: the weight's rows
    are the MMA's 64-row side and the activations' rows its narrow side (`_fp8_gemm_swap_kernel`: few rows)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False


FP8_REF_TILE = Fp8Tile(
    64, 64, 4, 4
)  # the one tile of the first kernel: the reference the family is checked against
# The tiles, widest first. H200, 2026-11-29, benchmarks/probe_fp8_gemm.py on qwen3-0.6b / 8b shapes at 1..512 rows:
# every one of these and 8 more (128 x 128 and 128 x 64 tiles, two to four 128-blocks a K step, other warp counts
# and stage depths) gave the reference tile's bits; the 128-row tiles were slower than 64 x 128 at every shape
# and row count (8b down at 512 rows: 113 us against 97), several blocks a K step slower or within 6%.
FP8_FAMILY = (Fp8Tile(64, 128, 4, 3), Fp8Tile(64, 64, 4, 4), Fp8Tile(64, 32, 4, 5), Fp8Tile(64, 16, 4, 6))
_MIN_SM_SHARE = 0.7  # a tile is picked when it gives at least this share of the SMs a tile to compute
# ... and up to 64 rows (one row of tiles) when it gives the SMs 3 tiles each: a program's K loop waits on each
# block's dot, so more programs a SM hide it. H200, 2026-11-29, benchmarks/probe_fp8_decode_tiles.py, qwen3-8b decode
# step at 64 sequences: 6.57 ms against 8.03 with 0.7 (bf16 6.18); at 256 sequences 3 a SM is slower (16.2 against
# 13.4 ms), at one sequence the same.
_ONE_TILE_SM_SHARE = 3.0
# Few rows: the weight's rows on the MMA's 64-row side, up to 32 activation rows on its narrow side. H200,
# 2026-11-29, benchmarks/probe_fp8_swap.py (every call streaming its weight from HBM): equal to the reference tile
# at 13 row counts of 1..64 (three row offsets each) on qwen3-0.6b / 8b shapes, like 7 other swapped tiles; at 1 row
# qwen3-8b's gate/up 31.3 us against 39.3 for the 64-row tile, qkv 13.6 against 16.3; slower where N / 64 leaves
# most SMs idle (qwen3-0.6b's o and down, N = 1024) and past 32 rows.
FP8_SWAP_TILE = Fp8Tile(32, 64, 4, 4, swap_ab=True)
_SWAP_MIN_SM_SHARE = 0.45  # the swapped tile is picked when its N / 64 programs give this share of SMs a tile


@functools.lru_cache(maxsize=4096)  # asked on every launch
def fp8_tile(m: int, n: int, programs: int, swap: bool = True) -> Fp8Tile:
    """The tile of an [m, K] x [n, K]^T fp8 call on a GPU with `programs` SMs. Up to 32 rows (and `swap`: the
    grouped expert GEMM takes 64-row tiles only), the swapped tile where N / 64 gives at least 45% of the SMs a
    tile; else the widest 64-row tile of the family that gives at least 70% of the SMs a tile (up to 64 rows: 3
    tiles a SM), else the narrowest (most tiles). A one-row decode GEMM of qwen3-8b's gate/up (N = 24,576) takes
    the swapped tile: 31 us against 39 for 64 x 128; qwen3-0.6b's down (N = 1,024) takes 64 x 16."""
    t = FP8_SWAP_TILE
    if swap and m <= t.block_m and triton.cdiv(n, t.block_n) >= programs * _SWAP_MIN_SM_SHARE:
        return t
    need = programs * (_ONE_TILE_SM_SHARE if m <= FP8_FAMILY[0].block_m else _MIN_SM_SHARE)
    return next(
        (t for t in FP8_FAMILY if triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n) >= need),
        FP8_FAMILY[-1],
    )


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
    # Columns past N read column 0 (never stored): the weight's loads need no mask.
    offs_wn = tl.where(n_ok, offs_n, 0)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_wn.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    ws_ptrs = ws_ptr + offs_wn.to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _kb in range(KB):  # in order: no split-K
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs)
        d = tl.dot(a, tl.trans(w), out_dtype=tl.float32)  # one block's dot, its own fp32 accumulator
        sa = tl.load(as_ptrs, mask=m_ok, other=0.0)
        sw = tl.load(ws_ptrs)
        acc = acc + (d * sa[:, None]) * sw[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        as_ptrs += 1
        ws_ptrs += 1
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_wn).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_swap_kernel(
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
    """`_fp8_gemm_kernel` with the operands' roles swapped: the tile is [BLOCK_N weight rows, BLOCK_M activation
    rows], the weight the MMA's 64-row side. Each element's chain is the same: per K-block one dot of the same 128
    products into a fresh fp32 accumulator, times the row's scale, times the column's, added in order."""
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_wn = tl.where(n_ok, offs_n, 0)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_wn.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    ws_ptrs = ws_ptr + offs_wn.to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _kb in range(KB):
        w = tl.load(w_ptrs)
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        d = tl.dot(w, tl.trans(a), out_dtype=tl.float32)  # [BLOCK_N, BLOCK_M]: one block's dot, fresh
        sa = tl.load(as_ptrs, mask=m_ok, other=0.0)
        sw = tl.load(ws_ptrs)
        acc = acc + (d * sa[None, :]) * sw[:, None]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        as_ptrs += 1
        ws_ptrs += 1
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_wn).to(tl.float32)[:, None]
    out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


def fp8_gemm_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tile: Fp8Tile | None = None,
) -> torch.Tensor:
    """a: [M, KB * 128] e4m3, a_scale: [M, KB] fp32, w: [N, KB * 128] e4m3, w_scale: [N, KB] fp32 -> [M, N].
    tile: the tile to use (the probe and the tests); default `fp8_tile`'s pick for the call."""
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
    if tile is None:
        tile = fp8_tile(m, n, num_programs_cap(a.device))
    if tile.swap_ab:
        kernel, grid = _fp8_gemm_swap_kernel, (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m))
    else:
        kernel, grid = _fp8_gemm_kernel, (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))
    kernel[grid](
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
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=BLOCK_K,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl(a.device),
    )
    return out
