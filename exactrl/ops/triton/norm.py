"""RMSNorm with HF semantics, one program per row.

The row's sum of squares is one `tl.sum` over a fixed BLOCK_D (the next power of two of D, decided by D alone)
in one program, so its reduction tree never depends on how many rows the call has. Cast order as HF and
`rms_norm_torch`: normalise in fp32, round to x.dtype, multiply by the weight in the promoted dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import next_pow2


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, stride_x, stride_o, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    rstd = tl.math.rsqrt(var + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty)  # HF: cast back to the input dtype before the weight
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    # A product of two <=16-bit floats is exact in fp32, so one rounding to the output dtype matches torch.
    y = normed.to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    gy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    gx_ptr,
    gw_part_ptr,
    stride_gy,
    stride_x,
    stride_gx,
    D,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + row * stride_gy + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    n = x * rstd
    gn = gy * w
    # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (gn - n * mean(gn * n)); the cast to x.dtype passes gradients.
    gx = rstd * (gn - n * (tl.sum(gn * n, axis=0) / D))
    tl.store(gx_ptr + row * stride_gx + offs, gx.to(gx_ptr.dtype.element_ty), mask=ok)
    n_cast = n.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(gw_part_ptr + row * D + offs, gy * n_cast, mask=ok)


def _warps(block_d: int) -> int:
    return 8 if block_d >= 4096 else 4 if block_d >= 1024 else 2 if block_d >= 512 else 1


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, D] (last dim contiguous) -> (y [R, D] in promote(x, weight) dtype, rstd [R] fp32)."""
    R, D = x.shape
    out = torch.empty((R, D), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        block = next_pow2(D)
        _rms_norm_fwd_kernel[(R,)](
            x,
            weight,
            out,
            rstd,
            x.stride(0),
            out.stride(0),
            D,
            float(eps),
            BLOCK_D=block,
            num_warps=_warps(block),
        )
    return out, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        y, rstd = rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        gy = gy.contiguous()
        R, D = x.shape
        gx = torch.empty_like(x)
        gw_part = torch.empty((R, D), dtype=torch.float32, device=x.device)
        if R:
            block = next_pow2(D)
            _rms_norm_bwd_kernel[(R,)](
                gy, x, weight, rstd, gx, gw_part, gy.stride(0), x.stride(0), gx.stride(0), D,
                BLOCK_D=block, num_warps=_warps(block),
            )  # fmt: skip
        gw = gw_part.sum(0).to(weight.dtype)  # deterministic column sum (no atomics)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] -> [..., D]; differentiable."""
    shape = x.shape
    weight = weight.contiguous()
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _RMSNorm.apply(x2, weight, float(eps))
    else:
        y = rms_norm_fwd(x2, weight, eps)[0]
    return y.reshape(shape)
