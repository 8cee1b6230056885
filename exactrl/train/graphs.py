"""Training microbatches replayed as CUDA graphs.

A training step of a small model is bound by the host: forward, loss and backward of one microbatch are about
two thousand kernel launches, and Python issues them more slowly than the GPU runs them. A `MicrobatchGraphs`
captures the whole microbatch once per input geometry (a *bucket*: see `exactrl.train.packing.Bucket`) and
replays it with one launch: forward through the shared model, LM-head logprobs, the loss, the backward pass, and
the accumulation of the gradients into buffers that live outside the graph (`MasterAdamW.persistent_grads`).

The captured body is the eager body: `run` calls the same function directly when graphs are off (the CPU, or
`cuda_graphs = false`), and a replay executes exactly the kernels that function launched during capture, on the
same shapes, so a graph step and an eager step of the same bucket are bitwise equal (tested on the GPU).

Rules the body follows, because capture records kernels and not Python: every input is a tensor of the bucket's
shape copied into a static buffer before replay; nothing reads a device value on the host (no `.item()`, no
`nonzero`); scalars that may change between steps (divisors, the Dr.GRPO constant) are 0-d tensors, never Python
floats; outputs are read after replay, before the next one overwrites them.

All buckets share one memory pool: replays never overlap (one stream, one microbatch at a time) and each graph's
outputs are cloned by the caller, so one graph's temporaries can reuse another's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import torch

from exactrl.progress import Progress

K = TypeVar("K", bound=Hashable)  # a microbatch's key: its bucket shape and the loss's switches
Body = Callable[[K, dict[str, torch.Tensor], bool], dict[str, torch.Tensor]]


def accumulate_grads(
    loss: torch.Tensor, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], accumulate: bool
) -> None:
    """Gradients of `loss` with respect to `params`, added into `buffers` (each param's persistent .grad) when
    `accumulate`, else computed and dropped (a warm-up run that must leave the buffers alone).

    Accumulating: a backward into the parameters' own .grad, which are the buffers. Autograd adds each gradient
    into its .grad in place (`grad += new`, in the buffer's dtype) as soon as the gradient is ready, so no second
    set of gradients exists at the end of the backward: the peak holds the buffers plus the gradients in flight,
    not a whole model's worth more. Warm-up: each parameter's .grad is cleared for the backward, and a hook drops
    every gradient the moment it lands; the buffers go back afterwards, untouched."""
    params = list(params)
    if accumulate:
        for p, b in zip(params, buffers):
            if p.grad is not b:
                raise RuntimeError("accumulate_grads: a parameter's .grad is not its persistent buffer")
        torch.autograd.backward(loss, inputs=params)
        return
    saved = [p.grad for p in params]
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]
    try:
        for p in params:
            p.grad = None
        torch.autograd.backward(loss, inputs=params)
    finally:
        for h in hooks:
            h.remove()
        for p, g in zip(params, saved):
            p.grad = g


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


class _Entry:
    def __init__(
        self, graph: torch.cuda.CUDAGraph, static: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
    ):
        self.graph, self.static, self.out = graph, static, out


class MicrobatchGraphs(Generic[K]):
    """Runs `body(key, inputs, accumulate)` for one microbatch, eagerly or as a CUDA graph captured per key.

    body: reads its tensor inputs (whose shapes the key determines), runs forward + loss + backward, adds the
    gradients into persistent buffers when `accumulate` (see `accumulate_grads`) and returns a dict of output
    tensors. `watched`: tensors whose storage the graphs read in place (the parameters and the gradient
    buffers); if any of them moves (weights replaced, buffers re-allocated) the graphs are dropped and captured
    again instead of reading stale memory.
    `max_graphs`: at most this many buckets get a graph; microbatches of further buckets run eagerly (the same
    body, so the same bits), which bounds the memory a run with very varied lengths can tie up.
    """

    def __init__(
        self,
        body: Body[K],
        *,
        enabled: bool,
        watched: Callable[[], Sequence[torch.Tensor]],
        max_graphs: int = 64,
    ):
        self.body, self.enabled, self._watched = body, enabled, watched
        self.max_graphs = max_graphs
        self.eager_runs = 0  # microbatches of buckets past max_graphs
        self._graphs: dict[K, _Entry] = {}
        self._pool: Any = None  # torch.cuda.graph_pool_handle() once a graph is captured
        self._addresses: tuple[int, ...] = ()
        self.captures = 0
        self.replays = 0
        self.capture_s = 0.0  # wall time spent warming up and capturing, over this object's life

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: K, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The body's outputs for `inputs`. With graphs on, these are the graph's static output tensors: valid
        until the next `run`, so clone what must outlive it."""
        if not self.enabled:
            return self._eager(key, inputs)
        addresses = tuple(t.data_ptr() for t in self._watched())
        if addresses != self._addresses:
            # Dropping the graphs frees their shared pool; the next capture starts a new one.
            self._graphs.clear()
            self._pool = None
            self._addresses = addresses
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.max_graphs:
                self.eager_runs += 1
                return self._eager(key, inputs)
            try:
                entry = self._capture(key, inputs)
            except Exception as e:
                raise RuntimeError(
                    f"CUDA graph capture of a training microbatch failed ({type(e).__name__}: {e}); "
                    "set train.cuda_graphs = false to train without graphs"
                ) from e
            self._graphs[key] = entry
        for name, t in inputs.items():
            dst = entry.static[name]
            if dst.shape != t.shape or dst.dtype != t.dtype:
                raise ValueError(
                    f"graph input {name!r}: {tuple(t.shape)} {t.dtype} does not match the bucket's "
                    f"{tuple(dst.shape)} {dst.dtype} (a bucket key must determine every input's shape)"
                )
            dst.copy_(t, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.out

    def _eager(self, key: K, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = self._watched()[0].device
        return self.body(key, {k: v.to(device, non_blocking=True) for k, v in inputs.items()}, True)

    def _capture(self, key: K, inputs: dict[str, torch.Tensor]) -> _Entry:
        t0 = time.perf_counter()
        device = self._watched()[0].device
        static = {k: v.to(device, copy=True) for k, v in inputs.items()}
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # A first capture compiles the Triton kernels for the bucket's shapes: it can take a while, and says so.
        with Progress(f"capturing the training CUDA graph of bucket {key}", 2, "steps") as bar:
            # One eager warm-up run first (Triton compiles for the bucket's shapes, side streams and lazy state
            # are created), on the current stream so that its activations go back to the pool eager steps use.
            # Its gradients are dropped.
            self.body(key, static, False)
            bar.update(1)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the off-policy loop's generation worker (exactrl/train/offpolicy.py) keeps launching
            # the engine's kernels on its own stream while a training graph is captured here; only this thread's
            # calls must stay capture-safe. One thread (the synchronous loop): the same as the default mode.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.body(key, static, True)
            bar.update(1)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return _Entry(graph, static, out)
