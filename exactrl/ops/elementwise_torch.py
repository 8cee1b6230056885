"""Elementwise activations in plain PyTorch whose bits do not depend on the tensor's length: the exact CPU backend's
`sigmoid` and `silu_mul`.

Why not `torch.sigmoid` / `F.silu`: on the CPU their kernels run a vectorised routine over the body of each
thread's range and a scalar routine (`std::exp`) over its tail, and the two round differently. Which elements
fall in a tail depends on the element count (and on how the range is split over threads), so a row's bits change
with the number of rows in the call: the Qwen2-MoE shared-expert gate (`[T, 1]`, every element near a tail) broke
fp32 parity exactly that way, and `F.silu` does the same on the rows near a tail (measured: 4 of 13 row counts
of a [300, 37] call differ for sigmoid, 5 for silu; torch 2.13 CPU, AVX512).

What these do instead: IEEE-exact arithmetic (`-`, `+`, `*`, `/`, correctly rounded in scalar and vector code
alike), each its own kernel so nothing is contracted into an FMA, and `torch.exp`, whose CPU kernel maps one
vectorised routine over every element, tails included (a partial vector load, not a scalar loop). That last fact
is a property of the build, not of IEEE: `tests/ops/test_elementwise_invariance.py` sweeps lengths, offsets and
thread counts on every machine the suite runs on, as the DESIGN's measured facts ask.

Both compute in fp32 and round once to the input dtype, as torch does for bf16/fp16 inputs (its opmath type).
"""

from __future__ import annotations

import torch


def sigmoid_fp32(xf: torch.Tensor) -> torch.Tensor:
    """xf: fp32 -> 1 / (1 + exp(-xf)) in fp32, every element through the same routine whatever the length."""
    return 1.0 / (1.0 + torch.exp(-xf))


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = sigmoid_fp32(x.float())
        ctx.save_for_backward(y)
        ctx.dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Only the trainer runs this: it must be deterministic, not invariant. d sigmoid = s (1 - s), in fp32.
        (y,) = ctx.saved_tensors
        return (grad.float() * y * (1.0 - y)).to(ctx.dtype)


def sigmoid_exact(x: torch.Tensor) -> torch.Tensor:
    """x: [...] -> sigmoid(x), [...] in x.dtype, computed in fp32; a row's bits never depend on the call's length."""
    return _Sigmoid.apply(x)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g = gate.float()
        # silu(g) = g / (1 + exp(-g)), the expression torch's vectorised body uses, rounded once to the model dtype;
        # then the product in the model dtype, as `F.silu(gate) * up` rounds it.
        act = (g / (1.0 + torch.exp(-g))).to(gate.dtype)
        ctx.save_for_backward(gate, up)
        return act * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        g = gate.float()
        s = sigmoid_fp32(g)
        act = (g * s).to(gate.dtype)
        grad_up = grad * act
        grad_act = (grad * up).float()
        # d silu / dg = s (1 + g (1 - s)), in fp32 as torch's silu_backward computes it.
        grad_gate = (grad_act * (s * (1.0 + g * (1.0 - s)))).to(gate.dtype)
        return grad_gate, grad_up


def silu_mul_exact(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, I] -> silu(gate) * up, [T, I] in gate.dtype; a row's bits never depend on T."""
    if gate.shape != up.shape:
        raise ValueError(
            f"silu_mul wants gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    return _SiluMul.apply(gate, up)
