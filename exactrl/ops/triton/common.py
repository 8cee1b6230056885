"""Pieces shared by the Triton kernels.

`mma` is the one matrix-multiply-accumulate every kernel calls. On the GPU it is `tl.dot` (fp32 operands with
input_precision="ieee": exact mode never uses TF32). Under TRITON_INTERPRET=1 (the CPU test path) the
interpreter's `tl.dot` is unusable for these tests (it multiplies the raw uint16 bits of bf16 operands, and
numpy's matmul gives a row different low bits depending on its place in the tile), so there `mma` upcasts to
fp32 and sums the products over k in one order for every element. The GPU code never takes that branch.

`pdl_wait` and `pdl` are programmatic dependent launch (on Hopper): a kernel launched with `pdl(device)` may
be started by the GPU while the kernel before it in the stream is still running, and `pdl_wait` (the first
statement of every such kernel, before any load or store) holds it until that kernel has finished and its writes
are visible. The launch latency of each kernel of a decode step (a dozen a layer, each a few microseconds of work)
hides behind the one before it; no instruction of a kernel's arithmetic changes. Only kernels launched inside
`pdl_launches()` (the engine's steps) take it: a training step's long kernels have no launch latency to hide, and
on an H100 the attribute cost qwen3-1.7b's training step 7% (docs/benchmarks.md, "Kernels").
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

if INTERPRET:

    @triton.jit
    def mma(a, b, acc):
        # Products summed over k with the same order for every output element: numpy's matmul (what the
        # interpreter's tl.dot calls) gives rows different low bits depending on their place in the tile.
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        return acc + tl.sum(prod, axis=1)

else:

    @triton.jit
    def mma(a, b, acc):
        # fp32 operands: IEEE fp32 FMAs, never TF32 (rule 7 of DESIGN.md). 16-bit operands: tensor cores with
        # an fp32 accumulator; every output element is its own chain of MMAs, independent of the tile's other rows.
        if a.dtype == tl.float32:
            out = tl.dot(a, b, acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc)
        return out


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """First statement of a kernel launched with `pdl(device)`: wait for the previous kernel in the stream to
    complete (its writes visible), then let the next one be launched early. A kernel that stores must wait before
    it stores too (the previous kernel may still read the buffer), so nothing may come before this call."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# .on: whether this thread is inside `pdl_launches` (threads start outside). Module state rather than an argument
# threaded through every op: the launches sit deep in the kernels' host wrappers, under the model, the LoRA and MoE
# layers and the ops interface, and the engine is the one place that enters it; thread-local, so a trainer thread
# running beside the engine (algorithm.overlap) never takes it.
_SCOPE = threading.local()


@contextlib.contextmanager
def pdl_launches(on: bool = True) -> Iterator[None]:
    """Kernels this thread launches inside the block use programmatic dependent launch where `pdl` allows it; the
    engine runs each step (prefill, decode graphs and their capture, sampling) inside one. Outside, and in other
    threads, launches are plain. Same bits either way (tests/ops/test_pdl.py). Training stays outside: on an H100
    (2026-11-26, the same machine and day, `exactrl bench train --preset qwen3-1.7b`) its step ran 38.4k tok/s with the
    attribute on every kernel against 41.1k without it."""
    prev = getattr(_SCOPE, "on", False)
    _SCOPE.on = on
    try:
        yield
    finally:
        _SCOPE.on = prev


def pdl(device: torch.device) -> dict:
    """Launch arguments of a kernel that starts with `pdl_wait(USE_PDL)`: programmatic dependent launch on a
    Hopper GPU inside `pdl_launches` (off outside it, under the interpreter, on ROCm, on other GPUs, and with
    EXACTRL_PDL=0)."""
    on = (
        getattr(_SCOPE, "on", False)
        and device.type == "cuda"
        and _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())
    )
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@functools.cache
def _pdl_capable(index: int) -> bool:
    if INTERPRET or os.environ.get("EXACTRL_PDL", "1") == "0" or torch.version.hip is not None:
        return False
    # Hopper only: the GPUs it was tested on. Blackwell has the instructions too, but graph capture with the launch
    # attribute is untested there (and reported to fail on some), so it waits for a test run.
    return torch.cuda.get_device_capability(index)[0] == 9


def num_programs_cap(device: torch.device) -> int:
    """How many programs a persistent kernel launches at most: one per SM on the GPU, a few in the interpreter."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _sm_count(index: int) -> int:
    # Cached: asked on every launch, and the device query costs more host time than the launch itself.
    return torch.cuda.get_device_properties(index).multi_processor_count


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def kernel_dtype_ok(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"exact Triton ops support bf16, fp16 and fp32 tensors, got {t.dtype}")
