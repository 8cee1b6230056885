"""The exact CPU backend's elementwise activations (`sigmoid`, `silu_mul`) give a row the same bits whatever the
call's length, width or thread count, where torch's own kernels do not (the negative control), and the fact they
rest on, `torch.exp` mapping one routine over every element tails included, holds on this machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exactrl.ops.torch_ops import ExactTorchOps, FastOps

MS = [1, 2, 3, 5, 7, 8, 15, 16, 17, 64, 255, 256, 300]
FULL = 300
WIDTHS = [1, 37, 104, 3072]  # the shared-expert gate's [T, 1], ragged widths, a real one
ops, fast = ExactTorchOps(), FastOps()


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _rand(*shape, dtype=torch.float32, seed=0):
    return (4 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _rows_that_differ(fn, x: torch.Tensor, *more: torch.Tensor) -> list[int]:
    full = fn(x, *more)
    return [m for m in MS if not torch.equal(fn(x[:m], *(t[:m] for t in more)), full[:m])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("width", WIDTHS)
def test_sigmoid_and_silu_mul_rows_invariant(threads, width, dtype):
    x, up = _rand(FULL, width, dtype=dtype), _rand(FULL, width, dtype=dtype, seed=1)
    assert _rows_that_differ(ops.sigmoid, x) == []
    assert _rows_that_differ(ops.silu_mul, x, up) == []
    # and a row's bits do not depend on where the call starts (the tail moves with the offset)
    for off in (1, 7, 13):
        assert torch.equal(ops.sigmoid(x[off:]), ops.sigmoid(x)[off:])
        assert torch.equal(ops.silu_mul(x[off:], up[off:]), ops.silu_mul(x, up)[off:])


def test_torch_activations_are_not_invariant_here():
    """Negative control: torch's sigmoid and silu give some row other bits in a shorter call on this machine (the
    bug class the exact ops exist for). If a build ever makes them invariant this control says so, and the sweep
    above loses its teeth: then plant a length-dependent op to check it still can fail."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, up = _rand(FULL, 1), _rand(FULL, 37, seed=1)
        differs = _rows_that_differ(torch.sigmoid, x) + _rows_that_differ(fast.silu_mul, _rand(FULL, 37), up)
    finally:
        torch.set_num_threads(before)
    assert differs, "torch.sigmoid and F.silu were row-invariant here: the control found nothing"


def test_exp_maps_one_routine_over_every_element(threads):
    """The fact the exact activations rest on: torch.exp gives an element the same bits alone, in a short call,
    at any offset, or in a call long enough to be split over threads."""
    x = 10 * torch.randn(200_003, generator=torch.Generator().manual_seed(2))
    ref = torch.exp(x)
    singles = torch.cat([torch.exp(x[i : i + 1]) for i in range(0, 300)])
    assert torch.equal(singles, ref[:300])
    for n in (2, 3, 17, 31, 33, 1000, 32_767, 32_769, 100_001):
        for off in (0, 1, 5):
            assert torch.equal(torch.exp(x[off : off + n]), ref[off : off + n]), (n, off)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_values_and_gradients_match_torch(dtype):
    """Same function as torch's (to a few ulps in fp32), same gradients to the dtype's rounding, deterministic."""
    g = _rand(64, 37, dtype=dtype).requires_grad_()
    u = _rand(64, 37, dtype=dtype, seed=1).requires_grad_()
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ops.sigmoid(g), torch.sigmoid(g), **tol)
    torch.testing.assert_close(ops.silu_mul(g, u), F.silu(g) * u, **tol)
    w = _rand(64, 37, seed=3).to(dtype)
    (ga, ua) = torch.autograd.grad((ops.silu_mul(g, u) * w).sum() + (ops.sigmoid(g) * w).sum(), (g, u))
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = torch.autograd.grad(
        (F.silu(g64) * u64 * w.double()).sum() + (torch.sigmoid(g64) * w.double()).sum(), (g64, u64)
    )
    torch.testing.assert_close(ga.double(), ref[0], rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)
    torch.testing.assert_close(ua.double(), ref[1], rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)
    again = torch.autograd.grad((ops.silu_mul(g, u) * w).sum() + (ops.sigmoid(g) * w).sum(), (g, u))
    assert torch.equal(again[0], ga) and torch.equal(again[1], ua)
