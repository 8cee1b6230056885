"""RMSNorm with HF semantics, and the fused residual add + RMSNorm; a fixed tile of rows per program.

Why a row's bits cannot depend on the batch (how many rows R the call has, or where the row sits in it):
- A program normalises a [ROWS, BLOCK_D] tile: BLOCK_D is the next power of two of D, and ROWS and num_warps are
  chosen from D alone (`norm_config`), never from R. Every call with a given D and dtype runs the same compiled
  kernel with the same register layout; R decides only how many programs run and which rows are masked.
- R is excluded from Triton's integer specialisation (`do_not_specialize`), so R = 1 or R % 16 == 0 cannot
  select a differently compiled kernel. The kernels read contiguous rows (row stride D) at a 16-byte-aligned
  address, copying a view that is not (`_rows`), so the pointer and stride specialisations that decide the
  vector width of the loads, and with it the layout, are a function of D and the dtype too.
- A row's sum of squares is one `tl.sum` along axis 1 of the tile. It combines only that row's elements, and the
  layout spreads every row's columns over registers and lanes in the same pattern, so every row of every tile is
  reduced by the same tree. Masked rows (past R) load zeros and are never stored; masked columns (past D) load
  zeros, which add exactly 0.
Cast order as HF and `rms_norm_torch`: normalise in fp32, round to x.dtype, multiply by the weight in the promoted
dtype (one rounding).

Fused add (`add_rms_norm`): the same kernel with HAS_RESIDUAL loads x and the residual, rounds their fp32 sum once
to x.dtype (torch's `x + residual`), stores it, and normalises that rounded value with the code `rms_norm` runs:
`normed` has the bits of `rms_norm(summed)`, and the residual stream is read once instead of twice.

Fused RoPE (`rms_norm_rope`, Qwen3's per-head q/k norm): the same kernel with ROPE normalises each row (one head
of one token) as above, rounds it as `rms_norm` stores it, and rotates it with `rope`'s fp32 expressions, the
partner column d +- D/2 normalised again from a second load of the same row: the bits of the two ops in turn, in
one pass. Its backward rotates the incoming gradient back in fp32 before the norm's backward.

q and k in one launch (`qk_norm_rope`, the decode step's fusion): one grid whose first programs run the tiles
`rms_norm_rope` runs for q and whose other programs run its tiles for k, through the one @triton.jit row code
(`_norm_rope_rows`) with norm_config(Dh)'s tile and warps; a tile never mixes q and k. Against the paged cache the
k programs also store their finished K rows and the token's V rows at its slot: the bytes of `write_kv_cache`.
So a Qwen3 layer's q/k norm, RoPE and K/V write are one launch instead of three, with the three's bits.

Backward (training only: deterministic, not batch-invariant): a program walks a fixed run of consecutive tiles,
writes dx, and accumulates its rows' weight-gradient terms in an fp32 register tile; it stores one partial row of
a [programs, D] fp32 buffer, summed in a fixed order by torch. The number of programs depends on R and the SM
count only, so the same inputs on the same device give the same bits. No atomics.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import next_pow2, num_programs_cap, pdl, pdl_wait
from exactrl.ops.triton.kv_write import write_kv_cache

# The forward's tile: 4096 elements, 32 per thread. The backward keeps x, dy, dx and the weight-gradient
# accumulator live at once, so it takes a smaller tile over more warps (8 elements per thread): at D = 128 and
# 1024, ptxas (sm_90) gave it 150-220 registers with the forward's tile, 55-72 with this one; no spills.
NORM_TILE, NORM_ELEMS_PER_THREAD = 4096, 32
NORM_BWD_TILE, NORM_BWD_ELEMS_PER_THREAD = 2048, 8
NORM_BWD_PROGRAMS_PER_SM = 4  # the backward's grid: this many programs per SM, each walking a run of tiles


def norm_config(D: int, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) for rows of width D: a function of D alone, never of the number of rows."""
    tile, per_thread = (
        (NORM_BWD_TILE, NORM_BWD_ELEMS_PER_THREAD) if backward else (NORM_TILE, NORM_ELEMS_PER_THREAD)
    )
    block_d = next_pow2(D)
    rows = max(1, tile // block_d)
    return block_d, rows, min(16, max(4, block_d * rows // (32 * per_thread)))


@triton.jit
def _rope_tile(pos_ptr, cs_ptr, stride_cs, n_heads, rows, cols, D, row_ok, ok):
    # For a tile of [token, head] rows: whether a column is in the first half, its rotation partner (d +- D/2),
    # and the cos and sin of its frequency at the row's token position.
    half = D // 2
    lo = cols < half
    partner = tl.where(lo, cols + half, cols - half)
    pos = tl.load(pos_ptr + rows // n_heads, mask=row_ok, other=0)
    cs_row = cs_ptr + pos[:, None] * stride_cs + tl.where(lo, cols, cols - half)[None, :]
    return lo, partner, tl.load(cs_row, mask=ok, other=0.0), tl.load(cs_row + half, mask=ok, other=0.0)


@triton.jit
def _norm_rows(x, w_ptr, cols, D, eps):
    # HF's RMSNorm of a loaded [ROWS, BLOCK_D] tile -> (normed * weight in fp32, not yet rounded; rstd [ROWS]).
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)  # one reduction per row, along the tile's axis 1
    # HF: cast back to the input dtype before the weight.
    normed = (xf * rstd[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    # A product of two <=16-bit floats is exact in fp32, so one rounding to the output dtype matches torch.
    return normed.to(tl.float32) * w[None, :], rstd


@triton.jit
def _norm_rope_rows(
    x_ptr,
    w_ptr,
    out_ptr,
    rstd_ptr,
    pos_ptr,
    cs_ptr,
    stride_cs,
    n_heads,
    stride_xt,
    tile,
    R,
    D,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_RSTD: tl.constexpr,
):
    # Tile `tile` of the [T * n_heads, D] rows of x ([T, n_heads, D], heads contiguous, token stride stride_xt):
    # rope(rms_norm(row)) into out ([R, D] contiguous) and rstd. The one copy of this arithmetic: `rms_norm_rope`
    # and `qk_norm_rope` both run it, so a row has the same bits whichever launch computes it. Returns the rows,
    # their mask and the stored tile (in the output dtype) for a caller that stores it elsewhere too.
    rows = tile * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    ok = row_ok[:, None] & (cols < D)[None, :]
    x_row = (rows // n_heads) * stride_xt + (rows % n_heads) * D
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=ok, other=0.0)
    y, rstd = _norm_rows(x, w_ptr, cols, D, eps)
    # rope(rms_norm(x)) with the bits of the two ops run one after the other: y is rounded to the output dtype
    # as `rms_norm` stores it, then rotated with `rope`'s fp32 expressions. A row is one head of one token; the
    # partner of column d is d +- D/2 in the same row (same rstd), normalised again from a second load.
    lo, partner, cos, sin = _rope_tile(pos_ptr, cs_ptr, stride_cs, n_heads, rows, cols, D, row_ok, ok)
    xp = tl.load(x_ptr + x_row[:, None] + partner[None, :], mask=ok, other=0.0)
    wp = tl.load(w_ptr + partner, mask=cols < D, other=0.0).to(tl.float32)
    yp = (xp.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * wp[None, :]
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    yp = yp.to(out_ptr.dtype.element_ty).to(tl.float32)
    # rope: first half x1 * cos - x2 * sin, second half x2 * cos + x1 * sin (x1, x2: the row's two halves), in
    # the explicit FMAs of the rope kernel: fma(y, cos, -(yp * sin)) and fma(y, cos, yp * sin).
    ys = yp * sin
    out = tl.fma(y, cos, tl.where(lo[None, :], -ys, ys)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], out, mask=ok)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    return rows, row_ok, ok, out


@triton.jit(do_not_specialize=["R"])
def _rms_norm_fwd_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    rstd_ptr,
    pos_ptr,
    cs_ptr,
    stride_cs,
    n_heads,
    stride_xt,
    R,
    D,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROPE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    tile = tl.program_id(0).to(tl.int64)
    if ROPE:
        # x: [T, n_heads, D] with heads contiguous and a token stride of its own (a view of the packed qkv)
        _norm_rope_rows(
            x_ptr, w_ptr, out_ptr, rstd_ptr, pos_ptr, cs_ptr, stride_cs, n_heads, stride_xt, tile, R, D, eps,
            ROWS, BLOCK_D, True,
        )  # fmt: skip
    else:
        rows = tile * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < R
        ok = row_ok[:, None] & (cols < D)[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            # torch's `x + residual`: the sum in fp32, rounded once to x.dtype; then normalised like any input.
            res = tl.load(res_ptr + offs, mask=ok, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + offs, x, mask=ok)
        y, rstd = _norm_rows(x, w_ptr, cols, D, eps)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit(do_not_specialize=["Rq", "Rk", "q_tiles"])
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    q_out_ptr,
    k_out_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    pos_ptr,
    cs_ptr,
    stride_cs,
    n_q_heads,
    n_kv_heads,
    stride_qt,
    stride_kt,
    stride_vt,
    Rq,
    Rk,
    q_tiles,
    D,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_KV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    # Programs [0, q_tiles) take the q rows, the rest the k rows: a tile never mixes the two, and each is the
    # tile `rms_norm_rope` would give that program for q or k alone (same rows, same code, same constexprs).
    if pid < q_tiles:
        _norm_rope_rows(
            q_ptr, qw_ptr, q_out_ptr, q_out_ptr, pos_ptr, cs_ptr, stride_cs, n_q_heads, stride_qt,
            pid.to(tl.int64), Rq, D, eps, ROWS, BLOCK_D, False,
        )  # fmt: skip
    else:
        rows, row_ok, ok, k = _norm_rope_rows(
            k_ptr, kw_ptr, k_out_ptr, k_out_ptr, pos_ptr, cs_ptr, stride_cs, n_kv_heads, stride_kt,
            (pid - q_tiles).to(tl.int64), Rk, D, eps, ROWS, BLOCK_D, False,
        )  # fmt: skip
        if WRITE_KV:
            # The paged-cache write of exactrl/ops/triton/kv_write.py for these rows: the finished (normalised,
            # rotated, rounded) K row and the token's V row of the same head, at the token's slot. A copy of bytes.
            cols = tl.arange(0, BLOCK_D)
            token, head = rows // n_kv_heads, rows % n_kv_heads
            slot = tl.load(slots_ptr + token, mask=row_ok, other=0).to(tl.int64)
            dst = (slot * n_kv_heads + head) * D
            tl.store(kc_ptr + dst[:, None] + cols[None, :], k, mask=ok)
            v = tl.load(v_ptr + (token * stride_vt + head * D)[:, None] + cols[None, :], mask=ok)
            tl.store(vc_ptr + dst[:, None] + cols[None, :], v, mask=ok)


@triton.jit(do_not_specialize=["R", "tiles_per_program"])
def _rms_norm_bwd_kernel(
    gy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    gs_ptr,
    gx_ptr,
    gw_part_ptr,
    pos_ptr,
    cs_ptr,
    stride_cs,
    n_heads,
    stride_xt,
    R,
    D,
    tiles_per_program,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GRAD_SUM: tl.constexpr,
    ROPE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    gw_acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    first_tile = pid.to(tl.int64) * tiles_per_program
    for t in range(tiles_per_program):
        rows = (first_tile + t) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < R
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * D + cols[None, :]
        if ROPE:
            x_row = (rows // n_heads) * stride_xt + (rows % n_heads) * D
            x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        gy = tl.load(gy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if ROPE:
            # Through the rotation first (its transpose: the rotation by -angle), kept in fp32.
            lo, partner, cos, sin = _rope_tile(pos_ptr, cs_ptr, stride_cs, n_heads, rows, cols, D, row_ok, ok)
            gyp = tl.load(gy_ptr + rows[:, None] * D + partner[None, :], mask=ok, other=0.0).to(tl.float32)
            gs = gyp * sin
            gy = tl.fma(gy, cos, tl.where(lo[None, :], gs, -gs))
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]  # masked rows: all terms are 0
        n = x * rstd
        gn = gy * w[None, :]
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (gn - n * mean(gn * n)); the cast to x.dtype passes gradients.
        gx = rstd * (gn - n * (tl.sum(gn * n, axis=1) / D)[:, None])
        if HAS_GRAD_SUM:
            # add_rms_norm: the gradient of `summed` joins the one through the norm before the one rounding.
            gx += tl.load(gs_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=ok)
        gw_acc += gy * n.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(gw_part_ptr + pid * D + cols, tl.sum(gw_acc, axis=0), mask=col_ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [R, D] contiguous rows at a 16-byte-aligned address (a copy only for a view that is not), so every
    call with a given D and dtype compiles to the same specialisation (see the module docstring)."""
    t2 = t.reshape(-1, t.shape[-1])
    if not t2.is_contiguous() or t2.data_ptr() % 16:
        t2 = t2.clone(memory_format=torch.contiguous_format)
    return t2


class RopeArgs(NamedTuple):
    """RoPE applied after the norm, rows being [token, head] pairs: positions [T] int64, the fp32 cos | sin table
    [P, D], the number of heads per token (row r is token r // n_heads) and the input's token stride (its heads
    are contiguous: a [T, H, D] view of the packed q/k/v projection)."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    n_heads: int
    stride_xt: int


def _rope_launch_args(rope: RopeArgs | None, x: torch.Tensor) -> tuple:
    if rope is None:
        return x, x, 0, 1, 0
    return rope.positions, rope.cos_sin, rope.cos_sin.stride(0), rope.n_heads, rope.stride_xt


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    rope: RopeArgs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x (and residual): [R, D] from `_rows` -> (y [R, D] in promote(x, weight) dtype, summed [R, D] in x.dtype
    (None without a residual), rstd [R] fp32). With a residual, y normalises summed = x + residual; with `rope`,
    y is then rotated (RoPE) as `rope` would rotate the stored norm output. Not both: the kernel's RoPE rows read
    no residual."""
    if residual is not None and rope is not None:
        raise ValueError(
            "rms_norm_fwd: a residual and rope together are not supported (the RoPE rows read no residual)"
        )
    R, D = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1), x.shape[-1]
    out = torch.empty((R, D), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        block_d, rows, num_warps = norm_config(D)
        _rms_norm_fwd_kernel[(triton.cdiv(R, rows),)](
            x,
            x if residual is None else residual,
            weight,
            out,
            out if summed is None else summed,
            rstd,
            *_rope_launch_args(rope, x),
            R,
            D,
            float(eps),
            ROWS=rows,
            BLOCK_D=block_d,
            HAS_RESIDUAL=residual is not None,
            ROPE=rope is not None,
            num_warps=num_warps,
            **pdl(x.device),
        )
    return out, summed, rstd


def rms_norm_bwd(
    gy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    grad_sum: torch.Tensor | None = None,
    rope: RopeArgs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gy, x (and grad_sum): [R, D] from `_rows`, rstd: [R] -> (dx [R, D] in x.dtype, dweight [D] in
    weight.dtype). grad_sum, if given, is added to dx in fp32 before its one rounding; with `rope`, gy is the
    gradient of the rotated output and is rotated back in fp32 first. Deterministic."""
    R, D = gy.shape
    gx = torch.empty((R, D), dtype=x.dtype, device=x.device)
    block_d, rows, num_warps = norm_config(D, backward=True)
    tiles = triton.cdiv(R, rows)
    programs = min(tiles, NORM_BWD_PROGRAMS_PER_SM * num_programs_cap(x.device))
    per_program = triton.cdiv(tiles, programs) if tiles else 0
    programs = triton.cdiv(tiles, per_program) if tiles else 0  # no program without a tile of its own
    gw_part = torch.empty((programs, D), dtype=torch.float32, device=x.device)
    if programs:
        _rms_norm_bwd_kernel[(programs,)](
            gy,
            x,
            weight,
            rstd,
            gy if grad_sum is None else grad_sum,
            gx,
            gw_part,
            *_rope_launch_args(rope, x),
            R,
            D,
            per_program,
            ROWS=rows,
            BLOCK_D=block_d,
            HAS_GRAD_SUM=grad_sum is not None,
            ROPE=rope is not None,
            num_warps=num_warps,
            **pdl(gy.device),
        )
    return gx, gw_part.sum(0).to(weight.dtype)  # a few hundred partial rows, summed in a fixed order


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        y, _, rstd = rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        gx, gw = rms_norm_bwd(_rows(gy), x, weight, rstd)
        return gx, gw, None


class _RMSNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, positions, cos_sin):  # type: ignore[override]
        rope = RopeArgs(positions, cos_sin, x.shape[1], x.stride(0))
        y, _, rstd = rms_norm_fwd(x, weight, eps, rope=rope)
        ctx.save_for_backward(x, weight, rstd, positions, cos_sin)
        return y

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, weight, rstd, positions, cos_sin = ctx.saved_tensors
        rope = RopeArgs(positions, cos_sin, x.shape[1], x.stride(0))
        gx, gw = rms_norm_bwd(_rows(gy), x, weight, rstd, rope=rope)
        return gx.view(x.shape), gw, None, None, None


class _AddRMSNorm(torch.autograd.Function):
    """(normed, summed) = (rms_norm(x + residual), x + residual); d x = d residual = d summed + d(norm input)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # the last layer's `summed` is not used: its gradient stays None
        y, summed, rstd = rms_norm_fwd(x, weight, eps, residual)
        ctx.save_for_backward(summed, weight, rstd)
        return y, summed

    @staticmethod
    def backward(ctx, gy, gs):  # type: ignore[override]
        summed, weight, rstd = ctx.saved_tensors
        if gy is None:
            return gs, gs, None, None
        gx, gw = rms_norm_bwd(_rows(gy), summed, weight, rstd, None if gs is None else _rows(gs))
        return gx, gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] -> [..., D]; normalise in fp32, round to x.dtype, multiply by weight. Differentiable."""
    shape = x.shape
    weight = weight.contiguous()
    x2 = _rows(x)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _RMSNorm.apply(x2, weight, float(eps))
    else:
        y = rms_norm_fwd(x2, weight, eps)[0]
    return y.reshape(shape)


def _check_rope_rows(op: str, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    T, _, D = x.shape
    if D % 2 or cos_sin.shape[-1] != D or positions.shape != (T,):
        raise ValueError(
            f"{op} needs x [T, H, Dh] with an even Dh equal to cos_sin's width and positions [T], got x "
            f"{tuple(x.shape)}, cos_sin {tuple(cos_sin.shape)}, positions {tuple(positions.shape)}"
        )


def _heads_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, Dh] as the norm + RoPE kernels read it: in place when the heads of a token are contiguous and
    16-byte aligned (the packed qkv's q and k views), else a contiguous copy. Either way the loads see the same
    alignment, so every call with a given Dh and dtype runs the same compiled layout."""
    D, esize = x.shape[2], x.element_size()
    if not (
        x.stride(2) == 1 and x.stride(1) == D and (x.stride(0) * esize) % 16 == 0 and x.data_ptr() % 16 == 0
    ):
        x = x.contiguous() if x.data_ptr() % 16 == 0 else x.clone(memory_format=torch.contiguous_format)
    return x


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, cos_sin: torch.Tensor
) -> torch.Tensor:
    """x: [T, H, Dh] -> rope(rms_norm(x, weight, eps), positions, cos_sin) in one pass (Qwen3's q/k norm), with
    the bits of the two ops run one after the other. Differentiable in x and weight."""
    _check_rope_rows("rms_norm_rope", x, positions, cos_sin)
    T, H, D = x.shape
    weight, cos_sin, positions = weight.contiguous(), cos_sin.contiguous(), positions.contiguous()
    x = _heads_rows(x)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _RMSNormRope.apply(x, weight, float(eps), positions, cos_sin)
    else:
        y = rms_norm_fwd(x, weight, eps, rope=RopeArgs(positions, cos_sin, H, x.stride(0)))[0]
    return y.view(T, H, D)


def _fused_kv_write_ok(
    k_out: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    T: int,
    hkv: int,
    dh: int,
) -> bool:
    """Whether the fused launch can write the cache as a plain copy: the finished K rows, V and both caches of
    one dtype, shapes that match (else `write_kv_cache` converts or complains, as it always has)."""
    k_cache, v_cache = kv_cache
    same = k_out.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    shapes = k_cache.shape[-2:] == v_cache.shape[-2:] == (hkv, dh) and v.shape == (T, hkv, dh)
    return same and shapes and k_cache.is_contiguous() and v_cache.is_contiguous()


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, Dh], k, v: [T, Hkv, Dh] -> (rms_norm_rope(q, q_weight, ...), rms_norm_rope(k, k_weight, ...)) in
    one launch, with those bits; with kv_cache (each [num_blocks, block_size, Hkv, Dh]) the same launch also writes
    the finished K rows and the V rows at slot_mapping [T], the bytes `write_kv_cache` writes.

    Why the bits are those of the two calls: the grid's first programs run `rms_norm_rope`'s tiles of q, the rest
    its tiles of k, through the one @triton.jit row code (`_norm_rope_rows`) with norm_config(Dh)'s tile and
    warps, the inputs read in place under the same alignment rule (`_heads_rows`). Where autograd is recording,
    the two calls themselves run (their backward is `_RMSNormRope`'s); a cache write that would convert a dtype
    goes through `write_kv_cache`."""
    _check_rope_rows("qk_norm_rope", q, positions, cos_sin)
    _check_rope_rows("qk_norm_rope", k, positions, cos_sin)
    if kv_cache is not None and (slot_mapping is None or slot_mapping.shape != (q.shape[0],)):
        raise ValueError(
            f"qk_norm_rope with a KV cache needs slot_mapping [T] (T = {q.shape[0]}), got "
            f"{None if slot_mapping is None else tuple(slot_mapping.shape)}"
        )
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_weight, k_weight))
    if grad:
        q_out = rms_norm_rope(q, q_weight, eps, positions, cos_sin)
        k_out = rms_norm_rope(k, k_weight, eps, positions, cos_sin)
        if kv_cache is not None:
            write_kv_cache(k_out, v, kv_cache, cast(torch.Tensor, slot_mapping))  # checked above
        return q_out, k_out
    (T, hq, D), hkv = q.shape, k.shape[1]
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    cos_sin, positions = cos_sin.contiguous(), positions.contiguous()
    q, k = _heads_rows(q), _heads_rows(k)
    q_out = torch.empty((T * hq, D), dtype=torch.promote_types(q.dtype, q_weight.dtype), device=q.device)
    k_out = torch.empty((T * hkv, D), dtype=torch.promote_types(k.dtype, k_weight.dtype), device=k.device)
    fused_write = kv_cache is not None and _fused_kv_write_ok(k_out, v, kv_cache, T, hkv, D)
    if fused_write and not (v.stride(2) == 1 and v.stride(1) == D):
        v = v.contiguous()  # the kernel reads a token's V heads as one run of Hkv * Dh elements
    if T:
        block_d, rows, num_warps = norm_config(D)
        q_tiles = triton.cdiv(T * hq, rows)
        # (fused_write implies a cache and its slots, checked above: casts for the type checker only)
        k_cache, v_cache = cast(tuple, kv_cache) if fused_write else (k_out, k_out)
        slots = cast(torch.Tensor, slot_mapping).contiguous() if fused_write else positions
        _qk_norm_rope_kernel[(q_tiles + triton.cdiv(T * hkv, rows),)](
            q, k, v if fused_write else k, q_weight, k_weight, q_out, k_out, k_cache, v_cache,
            slots, positions, cos_sin, cos_sin.stride(0),
            hq, hkv, q.stride(0), k.stride(0), v.stride(0) if fused_write else 0, T * hq, T * hkv, q_tiles, D,
            float(eps),
            ROWS=rows, BLOCK_D=block_d, WRITE_KV=fused_write, num_warps=num_warps,
            **pdl(q.device),
        )  # fmt: skip
    q_out, k_out = q_out.view(T, hq, D), k_out.view(T, hkv, D)
    if kv_cache is not None and not fused_write:
        write_kv_cache(k_out, v, kv_cache, cast(torch.Tensor, slot_mapping))  # checked above
    return q_out, k_out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D] of one dtype -> (rms_norm(summed, weight, eps), summed) with summed = x + residual
    rounded once to x.dtype. Both outputs have the bits of the unfused `x + residual` then `rms_norm`.
    Differentiable."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm needs x and residual of one shape and dtype, got {tuple(x.shape)} {x.dtype} and "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    shape = x.shape
    weight = weight.contiguous()
    x2, r2 = _rows(x), _rows(residual)
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        y, summed = _AddRMSNorm.apply(x2, r2, weight, float(eps))
    else:
        y, summed, _ = rms_norm_fwd(x2, weight, eps, r2)
    return y.reshape(shape), summed.reshape(shape)
