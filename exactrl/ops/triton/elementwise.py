"""Elementwise ops: SiLU-mul and RoPE, fp32 math, one rounding back to the input dtype.

Elementwise kernels are batch-invariant by construction (an output element reads only its own inputs); they
exist so that the trainer and the engine run the same compiled arithmetic on the GPU (rule 1 of DESIGN.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import next_pow2, pdl, pdl_wait

_SILU_BLOCK = 1024


@triton.jit
def _silu_mul_fwd_kernel(
    g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    # Same rounding points as `F.silu(gate) * up`: silu rounded to the dtype, then the product rounded once.
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_bwd_kernel(
    gy_ptr,
    g_ptr,
    u_ptr,
    gg_ptr,
    gu_ptr,
    stride_gy,
    stride_g,
    stride_u,
    n_cols,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gy = tl.load(gy_ptr + row * stride_gy + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = (g * sig).to(gu_ptr.dtype.element_ty).to(tl.float32)
    gg = gy * u * (sig * (1.0 + g * (1.0 - sig)))
    tl.store(gg_ptr + row * n_cols + cols, gg.to(gg_ptr.dtype.element_ty), mask=ok)
    tl.store(gu_ptr + row * n_cols + cols, (gy * silu).to(gu_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def silu_mul_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = _rows(gate), _rows(up)
    R, C = g.shape
    out = torch.empty((R, C), dtype=gate.dtype, device=gate.device)
    if R and C:
        grid = (R, triton.cdiv(C, _SILU_BLOCK))
        _silu_mul_fwd_kernel[grid](
            g, u, out, g.stride(0), u.stride(0), out.stride(0), C, BLOCK=_SILU_BLOCK, **pdl(g.device)
        )
    return out.reshape(gate.shape)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return silu_mul_fwd(gate, up)

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        g, u, gy2 = _rows(gate), _rows(up), _rows(gy)
        R, C = g.shape
        gg = torch.empty((R, C), dtype=gate.dtype, device=gate.device)
        gu = torch.empty((R, C), dtype=up.dtype, device=up.device)
        if R and C:
            grid = (R, triton.cdiv(C, _SILU_BLOCK))
            _silu_mul_bwd_kernel[grid](
                gy2,
                g,
                u,
                gg,
                gu,
                gy2.stride(0),
                g.stride(0),
                u.stride(0),
                C,
                BLOCK=_SILU_BLOCK,
                **pdl(gy2.device),
            )
        return gg.reshape(gate.shape), gu.reshape(up.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., I] -> silu(gate) * up; differentiable."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul needs gate and up of one shape and dtype, got {gate.shape}/{gate.dtype}, "
                         f"{up.shape}/{up.dtype}")  # fmt: skip
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return silu_mul_fwd(gate, up)


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, cs_ptr, out_ptr, stride_xt, stride_xh, stride_cs, stride_ot, stride_oh, n_heads, half,
    INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    ok = (h[:, None] < n_heads) & (d[None, :] < half)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d < half, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + half + d, mask=d < half, other=0.0)[None, :]
    if INVERSE:
        sin = -sin  # the gradient rotates back: the transpose of a rotation is the rotation by -angle
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=ok, other=0.0).to(tl.float32)
    # Explicit FMAs, as rms_norm_rope writes them: left to the compiler, a * b - c * d contracts one way or another.
    o1 = tl.fma(x1, cos, -(x2 * sin))
    o2 = tl.fma(x2, cos, x1 * sin)
    obase = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(obase, o1.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(obase + half, o2.to(out_ptr.dtype.element_ty), mask=ok)


def _rope_launch(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool
) -> torch.Tensor:
    T, H, Dh = x.shape
    if Dh % 2 or cos_sin.shape[-1] != Dh:
        raise ValueError(
            f"rope needs an even head dim equal to cos_sin's width, got {Dh} and {cos_sin.shape[-1]}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos_sin = cos_sin.contiguous()
    positions = positions.contiguous()
    out = torch.empty((T, H, Dh), dtype=x.dtype, device=x.device)
    if T and H:
        half = Dh // 2
        _rope_kernel[(T,)](
            x, positions, cos_sin, out, x.stride(0), x.stride(1), cos_sin.stride(0), out.stride(0), out.stride(1),
            H, half, INVERSE=inverse, BLOCK_H=next_pow2(H), BLOCK_HALF=next_pow2(half),
            **pdl(x.device),
        )  # fmt: skip
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, cos_sin):  # type: ignore[override]
        ctx.save_for_backward(positions, cos_sin)
        return _rope_launch(x, positions, cos_sin, inverse=False)

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        positions, cos_sin = ctx.saved_tensors
        return _rope_launch(gy, positions, cos_sin, inverse=True), None, None


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, Dh], positions: [T] int64, cos_sin: [P, Dh] fp32 (cos | sin) -> rotated x; differentiable in x."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, positions, cos_sin)
    return _rope_launch(x, positions, cos_sin, inverse=False)
