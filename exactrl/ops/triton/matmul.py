"""Batch-invariant matmul: `linear(x [M, K], w [N, K], bias) -> [M, N]`, a persistent Triton GEMM.

Why a row's result cannot depend on M (the number of rows in the call) or on where the row sits:
- The tile configuration never changes an output element's arithmetic. fp32: ONE configuration. 16-bit: a
  family of tiles (`tile_config`): the training tile (`MATMUL_CONFIGS`, 128 x 128) and 64-row tiles of 16, 32,
  64 or 128 columns, picked per call as the largest that still gives most SMs a tile (a decode step of one row
  would otherwise stream the weight through N / 128 programs); calls of at most 64 rows take K steps of 128 or
  256 (`_DECODE_FAMILY`). Every tile runs the same in-order K loop with the same tensor-core instruction (64-row
  wgmma of k = 16 on Hopper; a K step of 128 is eight of them where a step of 64 is four, in the same order), so
  an element is the same chain of MMAs into one fp32 accumulator with the same epilogue: a row gets the same
  bits from any of them. That equality is a property of the hardware's MMA, checked rather than assumed:
  benchmarks/probe_decode_gemm.py found every tile of the family (and more) equal to the training tile on every
  model shape at 1..512 rows (H100, 2026-11-24; the deeper K steps with --bk, 2026-11-25), and the GPU tests
  (row sweeps over 1..300 rows, test_tile_family_equal_training_tile with odd K and bias) fail on a GPU where
  they differ.
- The reduction over K runs in order, k-tile after k-tile, into one fp32 accumulator per output element:
  no split-K, no stream-K, no atomics. An output element's value is a fixed chain of MMAs over its own row of
  x and column of w; rows of a tile never mix (tensor-core MMAs compute each output element separately).
- M is excluded from Triton's integer specialisation (`do_not_specialize`), so M = 1 or M % 16 == 0 cannot
  select a differently compiled kernel. Out-of-range rows of a tile are masked and never stored;
  out-of-range k (K not a multiple of BLOCK_K) load zeros, which add exactly 0 to every element.
The persistent grid (one program per SM, tiles in grouped order for L2 reuse) only decides *which* program
computes a tile, never how.

Backward: dX = dY @ W runs through the same kernel with W's transposed strides (deterministic, no atomics);
dW = dY^T @ X uses torch.matmul (cuBLAS: deterministic for fixed shapes when CUBLAS_WORKSPACE_CONFIG is set,
and the backward does not need batch invariance).

Packed projections (`packed_linear`: q/k/v, gate/up in one weight): one forward GEMM, split into views. The
backward gets the parts' gradients separately and reduces dX over them as consecutive K segments of one TMA
GEMM (`_segmented_dx`), which has the bits of the GEMM over their concatenation without building it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import mma, num_programs_cap, pdl, pdl_wait


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # Operands through Hopper's tensor memory accelerator (host-side TMA descriptors, zero fill past the edges)
    # instead of pointer loads. Same per-element arithmetic: the loads change, the MMA chain does not.
    tma: bool = False
    # TMA kernel only: let Triton pipeline across the persistent loop's tiles (`tl.range(flatten=True)`), and
    # warp-specialise producer/consumer warps. Scheduling only: the per-element MMA chain is unchanged.
    flatten: bool = False
    warp_specialize: bool = False


# The training tile per dtype (fp32: the only tile; 16-bit: the largest of `tile_config`'s family). 16-bit: Hopper
# wgmma tiles, two warpgroups of 64 rows each;
# 4 stages of 128x64 + 64x128 bf16 tiles = 128 KiB of shared memory, loaded by TMA, the persistent loop
# flattened so the next tile's loads overlap this tile's epilogue (on an H200 the best geometric mean over the
# model's shapes of the variants in benchmarks/bench_kernels.py; all of them gave the same bits). fp32: IEEE
# FMAs (TF32 is off in exact mode), pointer loads, smaller tiles so the accumulator and operands fit in registers.
MATMUL_CONFIGS: dict[torch.dtype, MatmulConfig] = {
    torch.bfloat16: MatmulConfig(128, 128, 64, 8, 8, 4, tma=True, flatten=True),
    torch.float16: MatmulConfig(128, 128, 64, 8, 8, 4, tma=True, flatten=True),
    torch.float32: MatmulConfig(64, 64, 32, 8, 4, 3),
}


# The 16-bit tile family, largest first: (block_m, block_n) of the 64-row tiles after the training tile.
_TILE_FAMILY = ((64, 128), (64, 64), (64, 32), (64, 16))
_MIN_SM_SHARE = 0.7  # a tile is picked when it gives at least this share of the SMs a tile to compute
# Calls of at most _DECODE_ROWS rows (decode steps): (block_m, block_n, block_k, num_stages), largest first, taken
# whatever N (the training tile is never used for so few rows). A program of a one-row GEMM is a chain of
# dependent loads down K, and deeper K steps make it shorter: the same k = 16 MMAs in the same order into the same
# accumulator, so the same bits (benchmarks/probe_decode_gemm.py --bk found every such tile equal to the training
# tile on every qwen3-0.6b/1.7b shape, H100, 2026-11-25, and faster at 1-64 rows: qwen3-1.7b's down 15.1 -> 13.0 us
# at one row; --wide, H200, 2026-11-26: on the wide outputs the 128-column tile runs the LM head at one row in 80 us
# against the training tile's 155 (qwen3-0.6b; cuBLAS 78) and qwen3-1.7b's gate/up in 16.5 us against 32.5).
_DECODE_ROWS = 64
_DECODE_FAMILY = ((64, 128, 128, 3), (64, 64, 128, 4), (64, 32, 128, 4), (64, 16, 256, 3))
# (block_k, num_stages) of a 64-row tile by its columns, for calls of more than _DECODE_ROWS rows that the training
# tile would leave most SMs idle on (a rollout's 65..512 running sequences): K steps of 128 where they were
# measured (the same k = 16 MMAs in order, the same bits: every tile equal to the training tile), else 64. H200,
# 2026-11-26, `benchmarks/probe_decode_gemm.py --mid-bk` against K steps of 64: qwen3-0.6b's o and down at 512 rows
# 12.8 -> 7.7 and 17.9 -> 10.5 us, at 256 rows 6.9 -> 6.5 and 9.5 -> 8.6; qwen3-1.7b's down at 512 rows 38.8 ->
# 30.3; no shape slower by more than 3%.
_MID_K = {16: (64, 5), 32: (128, 4), 64: (128, 3), 128: (128, 3)}


@functools.lru_cache(maxsize=4096)  # asked on every launch; one entry per (rows, N) seen
def tile_config(m: int, n: int, programs: int, dtype: torch.dtype) -> MatmulConfig:
    """The tile of an [m, K] x [n, K]^T call on a GPU with `programs` SMs: at most 64 rows, the largest of the
    deeper-K decode tiles with at least 70% of the SMs busy, else the narrowest (most tiles); more rows, the
    largest of the family (the training tile first) with 70% of the SMs busy, else the narrowest, a 64-row one
    taking `_MID_K`'s K step. On an H100 this rule picked the fastest tile or one within 15% of it for every
    qwen3-0.6b/1.7b projection and row count probed, 1..512 (benchmarks/probe_decode_gemm.py)."""
    base = MATMUL_CONFIGS[dtype]
    if dtype == torch.float32:
        return base
    need = programs * _MIN_SM_SHARE
    if m <= _DECODE_ROWS:
        pick = next(
            (t for t in _DECODE_FAMILY if triton.cdiv(m, t[0]) * triton.cdiv(n, t[1]) >= need),
            _DECODE_FAMILY[-1],
        )
        return MatmulConfig(pick[0], pick[1], pick[2], 8, 4, pick[3])
    if triton.cdiv(m, base.block_m) * triton.cdiv(n, base.block_n) >= need:
        return base
    for bm, bn in _TILE_FAMILY:
        if triton.cdiv(m, bm) * triton.cdiv(n, bn) >= need:
            break
    bk, stages = _MID_K[bn]
    return MatmulConfig(bm, bn, bk, 8, 4, stages)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a persistent program's tile_id in grouped order: GROUP_M row-tiles share
    each column-tile of w while it is in L2. Which program computes a tile never changes how."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in range(start, num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past M are masked (zero-filled without a memory access: a decode step of a few rows reads only
        # its rows); columns past N read column 0. Neither is ever stored, and rows never mix in the MMA.
        row_ok = offs_m < M
        offs_bn = tl.where(offs_n < N, offs_n, 0)
        offs_bn = tl.max_contiguous(tl.multiple_of(offs_bn, BLOCK_N), BLOCK_N)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_bn[None, :] * stride_wn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, k_tiles):
            # K is reduced strictly in order into one fp32 accumulator (no split-K).
            if EVEN_K:
                a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(w_ptrs)
            else:
                k_left = K - kt * BLOCK_K
                a = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = mma(a, b, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk

        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_bn).to(tl.float32)
            acc = acc + bias[None, :]  # in fp32, before the one rounding to the output dtype
        out = acc.to(out_ptr.dtype.element_ty)
        offs_cm = offs_m.to(tl.int64)  # M * N can pass 2**31 (logits)
        out_ptrs = out_ptr + offs_cm[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, out, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _tma_k_loop(acc, x_desc, w_desc, off_m, off_n, k_tiles, w_k0, BLOCK_K: tl.constexpr, W_KN: tl.constexpr):
    # acc += x[off_m rows, k tiles 0 .. k_tiles) @ w[k rows from w_k0, off_n columns], k-tile after k-tile.
    for kt in range(0, k_tiles):
        a = x_desc.load([off_m, kt * BLOCK_K])
        if W_KN:
            b = w_desc.load([w_k0 + kt * BLOCK_K, off_n])
        else:
            b = w_desc.load([off_n, w_k0 + kt * BLOCK_K]).T
        acc = mma(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    x_desc,
    x2_desc,
    x3_desc,
    w_desc,
    bias_ptr,
    out_desc,
    M,
    N,
    K,
    K2,
    K3,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    W_KN: tl.constexpr,
    SEGMENTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The same persistent GEMM with TMA tile loads/stores. Rows past M and k past K arrive as zeros (TMA
    zero fill), which add exactly 0; rows past M are clipped at the store. W_KN: w_desc describes w^T, a
    row-major [K, N] tensor (the backward's dX = dY @ W reads W as it is stored, with no transposed copy).
    SEGMENTS > 1 (the backward of packed projections only): x is the concatenation along K of x_desc [M, K],
    x2_desc [M, K2] (and x3_desc [M, K3]), each a multiple of BLOCK_K, reduced one after the other."""
    pdl_wait(USE_PDL)
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tma_k_loop(acc, x_desc, w_desc, off_m, off_n, k_tiles, 0, BLOCK_K, W_KN)
        if SEGMENTS > 1:
            acc = _tma_k_loop(acc, x2_desc, w_desc, off_m, off_n, K2 // BLOCK_K, K, BLOCK_K, W_KN)
        if SEGMENTS > 2:
            acc = _tma_k_loop(acc, x3_desc, w_desc, off_m, off_n, K3 // BLOCK_K, K + K2, BLOCK_K, W_KN)
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit last stride, 16-byte aligned base and row strides."""
    return all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
        for t in tensors
    )


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """x: [M, K], w: [N, K] (any strides), bias: [N] or None -> x @ w.T + bias, [M, N] in out_dtype (default x.dtype).

    `config` exists for benchmarks and tests only; the exact ops use `tile_config` (one tile for fp32; for 16-bit
    a tile of the family, the same bits per element whichever, see the module docstring).
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"matmul operands must share a dtype, got {x.dtype} and {w.dtype}")
    M, K = x.shape
    N = w.shape[0]
    cfg = config or tile_config(M, N, num_programs_cap(x.device), x.dtype)
    out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    cap = num_programs_cap(x.device)
    if bias is not None:
        bias = bias.contiguous()
    # Launch parameters both kernels share.
    common = dict(
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        NUM_PROGRAMS=cap,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.tma and (K * x.element_size()) % 16 == 0 and (N * out.element_size()) % 16 == 0:
        # Whether TMA is used depends on the weight's shape and dtype only (never on M): any x is made
        # TMA-friendly by a copy, so every call with a given weight runs the same kernel.
        if not _tma_ok(x):
            x = x.clone(memory_format=torch.contiguous_format)
        # A transposed view of a row-major [K, N] tensor (the weight in the backward's dX) is read as stored.
        w_kn = w.stride(0) == 1 and w.stride(1) != 1 and _tma_ok(w.t())
        if not w_kn and not _tma_ok(w):
            w = w.clone(memory_format=torch.contiguous_format)
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
        if w_kn:
            wd = TensorDescriptor.from_tensor(w.t(), [cfg.block_k, cfg.block_n])
        else:
            wd = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
        od = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
        _matmul_tma_kernel[(min(tiles, cap),)](
            xd,
            xd,
            xd,
            wd,
            bias if bias is not None else x,
            od,
            M,
            N,
            K,
            0,
            0,
            FLATTEN=cfg.flatten,
            WARP_SPECIALIZE=cfg.warp_specialize,
            W_KN=w_kn,
            SEGMENTS=1,
            **common,
            **pdl(x.device),
        )
        return out
    _matmul_kernel[(min(tiles, cap),)](
        x,
        w,
        bias if bias is not None else x,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        out.stride(1),
        EVEN_K=K % cfg.block_k == 0,
        **common,
        **pdl(x.device),
    )
    return out


class _Linear(torch.autograd.Function):
    """Forward through the invariant kernel; backward dX through the same kernel (W transposed by strides),
    dW and dBias through deterministic torch reductions."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return matmul(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        return linear_backward(grad_out, x, weight, ctx.has_bias, ctx.needs_input_grad)


def linear_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool, needs: Sequence[bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`linear`'s backward (also the fp8 projections', exactrl/ops/fp8.py): grad_out [M, N], x [M, K] (the forward's
    input, unit last stride), weight [N, K]; needs: which of (x, weight, bias) want a gradient -> (dX [M, K],
    dW [N, K], dBias [N]), None where not needed."""
    grad_out = grad_out.contiguous()
    gx = matmul(grad_out, weight.t()) if needs[0] else None
    gw = torch.matmul(grad_out.t(), x) if needs[1] else None
    gb = grad_out.sum(0) if has_bias and needs[2] else None
    return gx, gw, gb


def _segmented_dx(grads: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor | None:
    """sum_i grads[i] @ weight[rows of part i] as one TMA GEMM over the parts' K segments in order, without
    concatenating the gradients; None where that kernel does not apply (the caller concatenates instead)."""
    cfg = MATMUL_CONFIGS[weight.dtype]
    M, D = grads[0].shape[0], weight.shape[1]
    if not (cfg.tma and weight.is_cuda and len(grads) <= 3 and M > 0):
        return None
    if any(g.shape[1] % cfg.block_k or not _tma_ok(g) or g.dtype != weight.dtype for g in grads):
        return None
    if (D * weight.element_size()) % 16 or not _tma_ok(weight):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = torch.empty((M, D), dtype=weight.dtype, device=weight.device)
    descs = [TensorDescriptor.from_tensor(g, [cfg.block_m, cfg.block_k]) for g in grads]
    ks = [g.shape[1] for g in grads] + [0, 0]
    cap = num_programs_cap(weight.device)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(D, cfg.block_n)
    _matmul_tma_kernel[(min(tiles, cap),)](
        *(descs + [descs[0]] * (3 - len(descs))),
        TensorDescriptor.from_tensor(weight, [cfg.block_k, cfg.block_n]),
        weight,
        TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n]),
        M,
        D,
        ks[0],
        ks[1],
        ks[2],
        HAS_BIAS=False,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        NUM_PROGRAMS=cap,
        FLATTEN=False,  # several K loops per tile: the persistent loop is not flattened
        WARP_SPECIALIZE=False,
        W_KN=True,
        SEGMENTS=len(grads),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl(weight.device),
    )
    return out


class _PackedLinear(torch.autograd.Function):
    """Projections packed into one weight: the forward is one invariant GEMM whose output is split into views
    (a part's columns have the bits of its own GEMM: every output element is its own chain over K). The backward
    takes the parts' gradients as they come: dX in one GEMM over their K segments (no concatenated copy of
    the gradients), dW and dBias part by part into the packed gradient's rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, sizes):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.sizes = bias is not None, sizes
        return matmul(x, weight, bias).split(sizes, dim=-1)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        return (
            *packed_linear_backward(grads, x, weight, ctx.sizes, ctx.has_bias, ctx.needs_input_grad),
            None,
        )


def packed_linear_backward(
    grads: Sequence[torch.Tensor | None],
    x: torch.Tensor,
    weight: torch.Tensor,
    sizes: list[int],
    has_bias: bool,
    needs: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`packed_linear`'s backward (also the fp8 packed projections'): grads, one [M, size] per part (None: zero),
    x [M, K], weight [sum(sizes), K]; needs: which of (x, weight, bias) want a gradient -> (dX, dW, dBias)."""
    parts = [
        torch.zeros((x.shape[0], n), dtype=x.dtype, device=x.device) if g is None else g.contiguous()
        for g, n in zip(grads, sizes)
    ]
    gx = gw = gb = None
    if needs[0]:
        gx = _segmented_dx(parts, weight)
        if gx is None:
            gx = matmul(torch.cat(parts, dim=-1), weight.t())
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    if needs[1]:
        gw = torch.empty_like(weight)
        for g, a, b in zip(parts, starts, starts[1:]):
            torch.matmul(g.t(), x, out=gw[a:b])
    if has_bias and needs[2]:
        gb = torch.cat([g.sum(0) for g in parts])
    return gx, gw, gb


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
) -> tuple[torch.Tensor, ...]:
    """x: [T, K], weight: [sum(sizes), K] -> one [T, size] output per part (views of one GEMM's output), each
    with the bits of `linear(x, weight_part, bias_part)`; differentiable."""
    if x.dim() != 2 or sum(sizes) != weight.shape[0]:
        raise ValueError(f"packed_linear needs x [T, K] and weight [sum(sizes), K], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and sizes {sizes}")  # fmt: skip
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if needs_grad:
        return _PackedLinear.apply(x2, weight, bias, list(sizes))
    return matmul(x2, weight, bias).split(list(sizes), dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K], bias: [N] or None -> [..., N] in x.dtype; differentiable."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    y = _Linear.apply(x2, weight, bias) if needs_grad else matmul(x2, weight, bias)
    return y.reshape(*lead, weight.shape[0])
