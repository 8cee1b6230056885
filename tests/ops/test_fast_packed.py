"""Fast mode's packed projection (q/k/v, gate/up in one weight) and its backward without a concatenated copy of
the parts' gradients: the gradients of the packed op equal those of separate projections (float64 on the CPU,
where both are exact up to the order of a few additions)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from exactrl.ops.fast_cuda import _CublasPackedLinear  # noqa: E402


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("unused", [None, 1])
def test_packed_backward_matches_separate_projections(with_bias, unused):
    g = torch.Generator().manual_seed(0)
    sizes = [24, 8, 8]  # q, k, v of a GQA layer
    x = torch.randn(37, 16, generator=g, dtype=torch.float64)
    w = torch.randn(sum(sizes), 16, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(sum(sizes), generator=g, dtype=torch.float64) if with_bias else None
    upstream = [torch.randn(37, n, generator=g, dtype=torch.float64) for n in sizes]

    def loss(outs):  # part `unused` takes no part in the loss: its gradient arrives as None
        return sum((o * u).sum() for i, (o, u) in enumerate(zip(outs, upstream)) if i != unused)

    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ba = b.clone().requires_grad_(True) if b is not None else None
    outs = _CublasPackedLinear.apply(xa, wa, ba, sizes)
    loss(outs).backward()

    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    br = b.clone().requires_grad_(True) if b is not None else None
    ref, start = [], 0
    for n in sizes:
        ref.append(F.linear(xr, wr[start : start + n], None if br is None else br[start : start + n]))
        start += n
    loss(ref).backward()
    for a, r in zip(outs, ref):
        assert torch.allclose(a, r, rtol=0, atol=1e-12)
    assert torch.allclose(xa.grad, xr.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(wa.grad, wr.grad, rtol=1e-12, atol=1e-12)
    if b is not None:
        assert torch.allclose(ba.grad, br.grad, rtol=1e-12, atol=1e-12)
