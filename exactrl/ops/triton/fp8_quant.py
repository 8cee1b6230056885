"""The fp8 activation quantizer on CUDA in one launch (`exactrl.ops.fp8.quantize_activations`'s recipe).

x [T, K] -> q [T, KB * 128] e4m3 (zero past K), scale [T, KB] fp32: each row's 128-channel group is scaled by its
own amax / 448 (1 for an all-zero group) and its values are x / scale, clamped to +-448, rounded to the nearest
e4m3 (ties to even). A program quantizes `GROUPS` groups of one row: nothing it computes reads another row or
another group, so the bits cannot depend on the batch or on how the groups are spread over programs.

The same bits as the torch formula (tests/ops/test_fp8_quant.py): amax is exact in any order; both divisions are
IEEE (`tl.math.div_rn`: Triton's plain `/` on fp32 is an approximate division on the GPU, not correctly rounded);
the cast rounds to nearest even on both sides, and the clamp keeps it away from the format's edge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import pdl, pdl_wait

FP8_MAX = 448.0  # the largest finite e4m3fn value (exactrl.ops.fp8.FP8_MAX)
GROUP = 128  # channels per scale (exactrl.ops.fp8.BLOCK)
GROUPS = 8  # groups a program quantizes: a [8, 128] tile, 1024 values, a few per thread


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _round_to_e4m3(y):
    """fp32 y (|y| <= 448) -> the nearest e4m3 value (ties to even), still fp32, so the cast after it is exact.
    Why by hand: Triton's interpreter (the CPU tests) converts fp32 to fp8 wrongly (a round-up that carries into the
    exponent, ties, subnormal results); the GPU's cast (cvt.rn) rounds the same way as this, so both run one code.
    The quantum of |y| is 2^(max(e, -6) - 3) (3 mantissa bits; below 2^-6 the subnormals' 2^-9): adding
    2^(quantum + 23) leaves that quantum as the sum's ulp, so the fp32 add rounds |y| to it, ties to even, and
    subtracting it back is exact. The sign is put back bitwise (-0 stays -0, as torch's cast keeps it)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23).to(tl.int32) - 127
    quantum = tl.maximum(e, -6) - 3
    big = ((quantum + 150) << 23).to(tl.float32, bitcast=True)  # 2^(quantum + 23)
    r = (mag.to(tl.float32, bitcast=True) + big) - big
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["T"])
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    T,
    K,
    KB,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS] group indices of this row
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP] channel indices
    x = tl.load(x_ptr + row * stride_xm + cols * stride_xk, mask=cols < K, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(x), 1, _max_nan)  # exact in any order; NaN as torch's amax
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    q = _round_to_e4m3(y).to(tl.float8e4nv, fp_downcast_rounding="rtne")  # an exact cast of e4m3 values
    g_ok = groups < KB
    tl.store(q_ptr + row * stride_qm + cols, q, mask=g_ok[:, None])
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=g_ok)


def quantize_activations_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] (bf16, fp16 or fp32) -> (q [T, KB * 128] e4m3, scale [T, KB] fp32), KB = ceil(K / 128)."""
    t, k = x.shape
    kb = triton.cdiv(k, GROUP)
    q = torch.empty(t, kb * GROUP, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, kb, dtype=torch.float32, device=x.device)
    if t == 0 or kb == 0:
        return q, scale
    _quantize_kernel[(t, triton.cdiv(kb, GROUPS))](
        x,
        q,
        scale,
        t,
        k,
        kb,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        scale.stride(0),
        GROUPS=GROUPS,
        GROUP=GROUP,
        FP8_MAX=FP8_MAX,
        num_warps=4,
        **pdl(x.device),
    )
    return q, scale
