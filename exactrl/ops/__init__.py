"""Ops backends: `exact` CPU (torch, batch-invariant), `exact` CUDA (Triton), and `fast`: PyTorch's defaults on
the CPU, cuBLAS + FlashAttention + fused Triton kernels on CUDA (exactrl/ops/fast_cuda.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from exactrl.ops.base import Ops
from exactrl.ops.batch import BLOCK_N, AttentionBatch

__all__ = ["BLOCK_N", "AttentionBatch", "Ops", "get_ops", "set_exact_environment", "torch_determinism_off"]


def get_ops(device: torch.device | str, exact: bool = True) -> Ops:
    """The backend for a device: exact mode uses batch-invariant kernels, fast mode the fastest path without
    the invariance rules (on CUDA with Triton: FastCudaOps; elsewhere PyTorch's defaults)."""
    device = torch.device(device)
    if not exact and device.type == "cuda":
        try:
            from exactrl.ops.fast_cuda import FastCudaOps
        except ImportError:  # pragma: no cover - no Triton on this machine: PyTorch's defaults
            pass
        else:
            return FastCudaOps()
    if not exact:
        from exactrl.ops.torch_ops import FastOps

        return FastOps()
    if device.type == "cpu":
        from exactrl.ops.torch_ops import ExactTorchOps

        return ExactTorchOps()
    if device.type == "cuda":
        try:
            from exactrl.ops.triton_ops import TritonOps
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError(
                f"exact mode on CUDA needs Triton ({e}); install triton or set exact = false"
            ) from e
        return TritonOps()
    raise ValueError(
        f"no exact backend for device type {device.type!r}; use cpu or cuda, or set exact = false"
    )


def set_exact_environment(exact: bool) -> None:
    """Process-wide numerics switches that exact mode depends on (TF32 and reduced-precision reductions off)."""
    if exact:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


@contextlib.contextmanager
def torch_determinism_off() -> Iterator[None]:
    """Run the block with `torch.use_deterministic_algorithms` off, then turn it back on as it was (with its
    warn_only; torch fills uninitialized memory only while the mode is on).

    The RL loop turns torch's deterministic algorithms on in exact mode so that the trainer's backward (e.g.
    the embedding gradient) gives the same bits in every run. The rollout engine needs none of it: its forward
    is exactrl's own kernels and copies of data (a KV-cache write copies rows to distinct slots: any
    implementation gives the same bytes), and the mode costs it dearly: every `torch.empty` becomes a fill
    kernel and each KV-cache write a sort (measured on an H100, qwen3-1.7b, 8 sequences of 1,536-1,792 tokens:
    256 decode steps in 6.66 s with the mode on, 2.10 s off; docs/benchmarks.md)."""
    if not torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
