"""The fp8 GEMM kernel (exactrl/ops/triton/fp8_matmul.py): batch invariance (torch.equal) and agreement with the
float64 formula. Without CUDA it runs in Triton's interpreter at a small shape (the interpreter does take fp8
dots); on a GPU compiled, with the row sweep at model shapes across every tile of the family (`gpu`)."""

from __future__ import annotations

import pytest
import torch
from triton_mode import triton_device

DEVICE = triton_device()

from exactrl.ops.fp8 import BLOCK, fp8_gemm_cpu, quantize_activations, quantize_weight  # noqa: E402
from exactrl.ops.triton.common import num_programs_cap  # noqa: E402
from exactrl.ops.triton.fp8_matmul import (  # noqa: E402
    FP8_FAMILY,
    FP8_REF_TILE,
    FP8_SWAP_TILE,
    fp8_gemm_triton,
    fp8_tile,
)


def _operands(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]
    w = 0.05 * torch.randn(n, k, generator=g)
    qx, sx = quantize_activations(x.to(DEVICE))
    qw, sw = quantize_weight(w.to(DEVICE))
    return qx, sx, qw, sw, torch.randn(n, generator=g).to(DEVICE)


def _ref64(qx, sx, qw, sw, bias):
    m, kb = sx.shape
    a = qx.double().cpu().view(m, kb, BLOCK) * sx.double().cpu()[..., None]
    w = qw.double().cpu().view(-1, kb, BLOCK) * sw.double().cpu()[..., None]
    return torch.einsum("mkc,nkc->mn", a, w) + bias.double().cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernel_rows_independent_and_close(dtype):
    qx, sx, qw, sw, bias = _operands(70, 72, 200)
    full = fp8_gemm_triton(qx, sx, qw, sw, bias, dtype)
    for rows in ([0], [69], [5, 6], list(range(0, 70, 9))):
        assert torch.equal(fp8_gemm_triton(qx[rows], sx[rows], qw, sw, bias, dtype), full[rows]), rows
    for rows in (
        [0],
        [3, 4, 5],
        list(range(0, 70, 3)),
    ):  # the swapped tile (few rows): its indexing and masks
        swapped = fp8_gemm_triton(qx[rows], sx[rows], qw, sw, bias, dtype, tile=FP8_SWAP_TILE)
        assert torch.equal(swapped, full[rows]), rows
    ref = _ref64(qx, sx, qw, sw, bias)
    # On the GPU the tensor core's fp8 dot does not keep fp32's bits inside a block (H200, 2026-11-29: 4e-5 of
    # the largest output off at fp32, where the interpreter's numpy dot is within 1e-6): 1e-3 there.
    tol = (1e-3 if DEVICE == "cuda" else 1e-5) if dtype == torch.float32 else 1e-2
    assert torch.allclose(full.double().cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    if DEVICE == "cpu":  # the interpreter's dot is numpy's fp32 one: close to the CPU emulation, not its bits
        cpu = fp8_gemm_cpu(qx, sx, qw, sw, bias, dtype)
        assert torch.allclose(full.double(), cpu.double(), rtol=tol, atol=tol * ref.abs().max().item())


def _switch_rows(n: int, programs: int, top: int) -> list[int]:
    """Row counts on both sides of every change of `fp8_tile`'s pick for an output of n columns, up to `top`."""
    rows, prev = [], None
    for m in range(1, top + 1):
        tile = fp8_tile(m, n, programs)
        if prev is not None and tile != prev:
            rows += [m - 1, m]
        prev = tile
    return rows


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,k",
    [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (24576, 4096), (4096, 12288), (2048, 2900)],
)
def test_fp8_kernel_row_sweep_gpu(n, k):
    """Every row count 1..69, around 128 and 256, and on both sides of every switch of the tile rule (so every tile
    of the family the rule picks at this shape) gives each row the bits it has in a 640-row call of the reference
    tile; and every tile of the family and the swapped tile, forced, does too at 1, 31..33, 64, 65 and 640 rows. Shapes: qwen3-0.6b's four
    projections, qwen3-8b's gate/up and down, and an odd block count (23)."""
    if DEVICE != "cuda":
        pytest.skip("needs a GPU")
    top = 640
    qx, sx, qw, sw, bias = _operands(top, n, k, seed=n + k)
    ref = fp8_gemm_triton(qx, sx, qw, sw, bias, torch.bfloat16, tile=FP8_REF_TILE)
    programs = num_programs_cap(qx.device)
    sweep = sorted(
        set(list(range(1, 70)) + [127, 128, 129, 255, 256, 257, top] + _switch_rows(n, programs, top))
    )
    picked = {fp8_tile(m, n, programs) for m in sweep}
    bad = []
    for m in sweep:
        part = fp8_gemm_triton(qx[-m:], sx[-m:], qw, sw, bias, torch.bfloat16)
        if not torch.equal(part, ref[-m:]):
            bad.append((m, fp8_tile(m, n, programs)))
    for tile in FP8_FAMILY + (FP8_SWAP_TILE,):
        for m in (1, 31, 32, 33, 64, 65, top):
            if not torch.equal(
                fp8_gemm_triton(qx[-m:], sx[-m:], qw, sw, bias, torch.bfloat16, tile=tile), ref[-m:]
            ):
                bad.append((m, tile))
    assert not bad, f"(rows, tile) whose rows differ from the reference tile: {bad}"
    # Every shape here crosses a switch today (the swapped tile up to 32 rows at N >= 3,800 on 132 SMs, 3 tiles a
    # SM up to 64 rows); a shape whose widest tile fills the SMs at every row count would have none.
    widest_fills = fp8_tile(1, n, programs) == FP8_FAMILY[0]
    assert len(picked) >= 2 or widest_fills, f"the rule picked only {picked} at this shape: no switch crossed"
