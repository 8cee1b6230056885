"""Random weights drawn in place: the values `torch.randn(shape, generator=g) * std` would give, rounded to the
parameter's dtype, without ever holding an fp32 copy of the tensor (or of the model).

Why: a 30B model's fp32 copy is 120 GB of host memory before the cast and the copy to the device, and the draws
were made three passes over it (draw, scale, copy). Here each draw fills at most `CHUNK` elements of fp32 scratch
(or the parameter itself when it is fp32 on the CPU), which is scaled and copied into the parameter where it lives;
for a GPU the chunk goes over as drawn and is scaled and cast there, while the host draws the next one.

Why the chunks give the same bits as one draw of the whole tensor: torch's CPU `normal_` for 16 or more contiguous
fp32 elements first fills them with uniforms from the generator, in order, then turns each block of 16 into
normals on its own (Box-Muller); when the size is not a multiple of 16 it draws 16 fresh uniforms for the last 16
elements and transforms them again. So chunks whose boundaries fall on multiples of 16 consume the generator and
transform the values exactly as the whole draw does, provided the last chunk holds 16 or more (a draw of fewer
than 16 takes another path). tests/model/test_init.py compares both ways with torch.equal.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK = 1 << 24  # elements a draw (64 MB of fp32 scratch); a multiple of 16


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each draw over n elements: `chunk` at a time, the last holding 16 or more (a remainder of
    fewer than 16 joins the chunk before it)."""
    if chunk % 16:
        raise ValueError(f"chunk must be a multiple of 16, got {chunk}")
    out = []
    start = 0
    while start < n:
        end = min(n, start + chunk)
        if n - end < 16:
            end = n
        out.append((start, end))
        start = end
    return out


@torch.no_grad()
def normal_into(
    dst: torch.Tensor,
    std: float,
    generator: torch.Generator,
    done: Callable[[int], None] | None = None,
    chunk: int | None = None,
) -> None:
    """dst <- torch.randn(dst.shape, generator=generator) * std, cast to dst's dtype on dst's device, bit for bit,
    drawn `chunk` (default CHUNK) elements at a time. done(n): called after each chunk with its element count."""
    if not dst.is_contiguous():  # not reached by the model's parameters; kept exact all the same
        dst.copy_(torch.randn(dst.shape, generator=generator, dtype=torch.float32) * std)
        if done is not None:
            done(dst.numel())
        return
    flat = dst.view(-1)
    bounds = chunk_bounds(flat.numel(), CHUNK if chunk is None else chunk)
    if not bounds:
        return
    if flat.is_cuda:
        _normal_into_cuda(flat, bounds, std, generator, done)
        return
    direct = flat.dtype == torch.float32
    scratch = None if direct else torch.empty(max(e - s for s, e in bounds), dtype=torch.float32)
    for start, end in bounds:
        out = flat[start:end] if scratch is None else scratch[: end - start]
        out.normal_(0.0, 1.0, generator=generator)  # what randn draws
        out.mul_(std)  # as randn(...) * std: the same fp32 product
        if scratch is not None:
            flat[start:end].copy_(out)
        if done is not None:
            done(end - start)


def _normal_into_cuda(
    flat: torch.Tensor,
    bounds: list[tuple[int, int]],
    std: float,
    generator: torch.Generator,
    done: Callable[[int], None] | None,
) -> None:
    """The draws on the host (the generator is the CPU's), scaled and cast on the device, so that the host does
    nothing but draw: two pinned buffers take turns, one chunk's copy running while the next is drawn. The scaling
    is one IEEE fp32 multiply on either side, and the cast rounds to nearest even on both: the same bits."""
    size = max(e - s for s, e in bounds)
    bufs = [torch.empty(size, dtype=torch.float32, pin_memory=True) for _ in range(min(2, len(bounds)))]
    copied: list[torch.cuda.Event | None] = [None] * len(bufs)  # each buffer's copy out of it has finished
    for i, (start, end) in enumerate(bounds):
        k = i % len(bufs)
        last = copied[k]
        if last is not None:
            last.synchronize()  # the buffer's last chunk is on the device: it may be drawn into again
        out = bufs[k][: end - start]
        out.normal_(0.0, 1.0, generator=generator)  # what randn draws
        on_device = out.to(flat.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        copied[k] = event
        flat[start:end].copy_(on_device.mul_(std))
        if done is not None:
            done(end - start)
    torch.cuda.synchronize(flat.device)


INIT_DRAWS = ("stream", "keyed")


def part_seed(seed: int, key: str) -> int:
    """The seed of one drawn part under keyed draws: a hash of the run's seed and the part's name (the unpacked
    model's parameter name), the same on every machine and in every process."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw_workers() -> int:
    """Threads for keyed draws: this process's share of the cores it may run on (the ranks of one host split
    them: LOCAL_WORLD_SIZE under torchrun), at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(16, cores // local))


@torch.no_grad()
def keyed_normal_into(
    parts: list[tuple[str, torch.Tensor]],
    std: float,
    seed: int,
    done: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> None:
    """Keyed draws: each (key, tensor) part <- torch.randn(part.shape, generator=its own generator) * std, cast to
    the part's dtype where it lives; the generator is seeded by `part_seed(seed, key)`. The parts are independent,
    so they are drawn on `workers` threads at once (torch's ops release the GIL; each generator is its own), where
    one stream of draws (`normal_into` in parameter order) runs on one core: a 30B model's random weights took
    ~150 s per rank on a 2 x H200 host's cores, 2026-11-28. Every part's values are those of its own draw,
    whatever the number of threads, the chunking or the device (tests/model/test_init.py)."""
    lock = threading.Lock()

    def progress(n: int) -> None:
        if done is not None:
            with lock:
                done(n)

    def one(part: tuple[str, torch.Tensor]) -> None:
        key, t = part
        g = torch.Generator().manual_seed(part_seed(seed, key))
        if t.is_cuda:  # a new thread's current device is cuda:0: the copies' events belong on the part's own
            with torch.cuda.device(t.device):
                normal_into(t, std, g, progress)
        else:
            normal_into(t, std, g, progress)

    n = draw_workers() if workers is None else workers
    if n <= 1 or len(parts) <= 1:
        for part in parts:
            one(part)
        return
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="exactrl-init") as pool:
        for _ in pool.map(one, parts):  # re-raises a part's error here
            pass
