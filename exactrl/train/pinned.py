"""Page-locked host buffers of exactly their size, for `train.offload = "optimizer"`.

torch's `pin_memory=True` goes through its caching host allocator, which rounds every block up to the next power of
two: a qwen3-8b full fine-tune's 91.5 GiB of offloaded fp32 masters and AdamW moments took 125.25 GiB of pinned host
memory, and the host's OOM killer ended the run (docs/memory.md). Here a buffer is ordinary (pageable) host memory
that is then registered with the CUDA driver (`cudaHostRegister`): page-locked, so copies to and from the device
are asynchronous, and exactly as large as the tensor. A CPU tensor that already exists (the masters, made on the
host) is registered in place, with no second copy.

What the caching allocator does that this does not: it records the copies in flight on each block and reuses a
freed block only after they ran. The offload buffers are never freed while the optimizer lives (one per tensor,
reused every step, stream-ordered copies), and when they are released the device is synchronized first.
"""

from __future__ import annotations

import weakref

import torch


def _unregister(ptr: int) -> None:
    # Called when the tensor that owns the registration is collected: no copy may still read or write it.
    try:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # at interpreter exit CUDA may already be torn down; the memory goes with the process
        pass


def register(t: torch.Tensor) -> torch.Tensor:
    """Page-lock a contiguous CPU tensor's memory in place (exactly its bytes) and return it. The registration is
    dropped when the tensor object is collected."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"only a contiguous CPU tensor can be page-locked in place, got {t.device} {t.shape}"
        )
    n = t.numel() * t.element_size()
    if n == 0:
        return t
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0))
    if rc == 712:  # cudaErrorHostMemoryAlreadyRegistered
        raise RuntimeError(
            f"page-locking {n} bytes of host memory for train.offload failed: the memory is page-locked already "
            "(cudaHostRegister error 712); a registered buffer cannot be registered again"
        )
    if rc != 0:
        raise RuntimeError(
            f"page-locking {n} bytes of host memory for train.offload failed (cudaHostRegister error {rc}): the "
            "host may not allow that much locked memory (ulimit -l), or its RAM is short"
        )
    weakref.finalize(t, _unregister, t.data_ptr())
    return t


def empty_pinned(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor of exactly `shape` x `dtype` bytes (uninitialized)."""
    return register(torch.empty(shape, dtype=dtype, device="cpu"))
