"""The check both backends' fp8 projection tests make (tests/ops/test_fp8.py: the CPU's exact ops;
tests/ops/test_fp8_backward.py: Triton's): an Fp8Ops projection's dX, dW and dB are torch.equal those of the wrapped
backend's own `linear` (and `packed_linear`, one part's gradient None) for the same grad_out, with the model-dtype
weight; negative control: the old straight-through dX, in fp32 through the dequantized fp8 weight."""

from __future__ import annotations

import torch

from exactrl.ops.fp8 import Fp8Ops, dequantize_weight, quantize_weight


def grads(fn, x, w, b, g):
    """(dX, dW, dB) of fn(x, w, b) for grad_out g (a tensor, or one per output), w and b used as given (the
    parameters an Fp8Ops registered), their gradients taken away after."""
    x = x.detach().clone().requires_grad_(True)
    torch.autograd.backward(fn(x, w, b), g)
    out = x.grad, w.grad, b.grad
    w.grad = b.grad = None
    return out


def check_backward_is_the_wrapped_backends(inner, x, w, b, g, sizes: list[int]) -> Fp8Ops:
    """x [T, K], w [sum(sizes), K] and b: parameters, g [T, sum(sizes)]; -> the Fp8Ops, w registered packed."""
    ops = Fp8Ops(inner)
    ops.register(w)
    got = grads(ops.linear, x, w, b, g)
    for a, r in zip(got, grads(inner.linear, x, w, b, g)):
        assert a.dtype == x.dtype and torch.equal(a, r)
    q, s = quantize_weight(w.detach().float())
    old_dx = (g.float() @ dequantize_weight(q, s, x.shape[1])).to(x.dtype)
    assert not torch.equal(old_dx, got[0])
    ops.clear()
    ops.register(w, sizes)
    gs = list(g.split(sizes, dim=-1))
    got = grads(lambda *a: ops.packed_linear(*a, sizes)[:2], x, w, b, gs[:2])  # the last part unused: None
    ref = grads(lambda *a: inner.packed_linear(*a, sizes)[:2], x, w, b, gs[:2])
    for a, r in zip(got, ref):
        assert torch.equal(a, r)
    return ops
