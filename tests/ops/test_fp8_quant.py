"""The one-launch fp8 activation quantizer (exactrl/ops/triton/fp8_quant.py) gives the torch formula's bits
(`quantize_activations_torch`): torch.equal on the fp8 values and the scales. Without CUDA in Triton's interpreter
at small shapes; on a GPU compiled (`gpu`), where `quantize_activations` dispatches to it."""

from __future__ import annotations

import pytest
import torch
from triton_mode import triton_device

DEVICE = triton_device()

from exactrl.ops.fp8 import FP8_MAX, quantize_activations, quantize_activations_torch  # noqa: E402
from exactrl.ops.triton.fp8_quant import quantize_activations_triton  # noqa: E402


def _activations(t: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows like a model's activations (groups of very different magnitudes, a few outlier channels), plus the
    cases the rounding meets: an all-zero group, a group whose values sit on e4m3 rounding midpoints (amax 448, so
    the scale is 1 and x / scale is exact: the cast alone decides, ties to even), subnormal midpoints, and a group
    whose amax is a value whose division by 448 is inexact."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-3, 2, k)[torch.randperm(k, generator=g)]
    x[:, torch.randint(0, k, (3,), generator=g)] *= 40.0  # outlier channels
    x = x * torch.logspace(-2, 2, t)[:, None]
    x[0, :128] = 0.0  # an all-zero group
    if t > 1:
        mids = torch.tensor(
            [1.0625, 1.1875, 17.0, 19.0, 208.0, 240.0, 2.0**-10, 3 * 2.0**-10, 0.0078125 * 1.0625]
        )
        row = torch.zeros(128)
        row[: mids.numel()] = mids
        row[mids.numel() : 2 * mids.numel()] = -mids
        row[-1] = FP8_MAX
        x[1, :128] = row
    if t > 2:
        x[2, :128] = torch.linspace(-3.0, 3.0, 128) * (1 + 2.0**-7)
    return x.to(dtype)


def _check_equal(x: torch.Tensor) -> None:
    q, s = quantize_activations_triton(x)
    q_ref, s_ref = quantize_activations_torch(x)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s, s_ref), f"scales differ in {(s != s_ref).sum().item()} of {s.numel()} groups"
    same = q.view(torch.uint8) == q_ref.view(torch.uint8)
    assert same.all(), f"fp8 values differ in {(~same).sum().item()} of {q.numel()} places"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k", [(5, 300), (3, 1024 + 128 * 8 + 5)])  # K past one program's 8 groups, uneven
def test_quantizer_equals_torch_formula(dtype, t, k):
    _check_equal(_activations(t, k, dtype).to(DEVICE))


def test_quantizer_midpoints_round_to_even():
    """The midpoint row quantizes to the even neighbour (1.0625 -> 1, 1.1875 -> 1.25, 17 -> 16, 19 -> 20, ...):
    checked against the values themselves, not only against torch."""
    x = _activations(2, 128, torch.float32).to(DEVICE)
    q, s = quantize_activations_triton(x)
    assert s[1, 0].item() == 1.0
    got = q[1, :9].float().cpu().tolist()
    assert got == [1.0, 1.25, 16.0, 20.0, 208.0, 240.0, 0.0, 2.0**-8, 0.0078125], got


def test_quantizer_strided_input_and_negative_control():
    """A column slice (row stride past K) quantizes like its contiguous copy; a changed value in one row changes
    that row only (the check can fail)."""
    x = _activations(4, 512, torch.bfloat16).to(DEVICE)
    view = x[:, 100:400]
    q, s = quantize_activations_triton(view)
    q2, s2 = quantize_activations_triton(view.contiguous())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    y = view.clone()
    y[3, 7] = 4 * view[3].abs().max()  # a new amax for its group
    q3, s3 = quantize_activations_triton(y)
    assert torch.equal(q3[:3].view(torch.uint8), q[:3].view(torch.uint8)) and torch.equal(s3[:3], s[:3])
    assert not torch.equal(s3[3], s[3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k", [(1, 1024), (7, 1000), (300, 3072), (4096, 2048), (64, 12288)])
def test_quantizer_equals_torch_formula_gpu(dtype, t, k):
    if DEVICE != "cuda":
        pytest.skip("needs a GPU")
    x = _activations(t, k, dtype, seed=t + k).to(DEVICE)
    _check_equal(x)
    q, s = quantize_activations(x)  # the dispatch on CUDA is the kernel
    assert torch.equal(q.view(torch.uint8), quantize_activations_triton(x)[0].view(torch.uint8))
