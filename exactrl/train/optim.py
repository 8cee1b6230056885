"""AdamW with fp32 master weights when the model is bf16, and learning-rate schedules.

The model the engine samples from *is* the bf16 shadow: after each step the fp32 masters are copied into it in
place, so the engine sees new weights with no file round trip and no extra copy.

Offload (`offload="optimizer"`): the fp32 masters (when they are copies, not the model's own fp32 parameters)
and AdamW's two moments wait in host memory between optimizer steps, pinned on CUDA, and come to the device for
the step, which runs the same kernel on the same values as without offload: the bits cannot depend on where a
tensor waited. The copies are queued on the current stream with `non_blocking=True`, so the host never waits for
them; stream order makes the step read what arrived and the next allocation reuse a buffer only after its copy
back has run. The step itself stays on the device (a host AdamW would be other arithmetic than the device's, so
offload on and off would differ in bits); what offload saves is those 12 bytes per trainable parameter during
generation and the training forward/backward.

Under FSDP2 (torchrun) the fp32 parameter shards are the masters and stay on the device (FSDP2 all-gathers them
for every forward); offload moves each rank's AdamW moments, the local tensors of its shards (8 bytes per element
of the shard), and nothing else. After the one all-reduce of the norm the sharded step streams them too: a group of
moment shards at a time comes in (`to_device`), the unsharded step's AdamW runs on that group's local shards
(torch's fused kernel on CUDA, its loop on the CPU) and the group goes back (`to_host`), so the optimizer phase
holds one group of moments beside the fp32 and gradient shards (a 30B full fine-tune at two ranks has 114 GiB of
moment shards per rank).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from exactrl.distributed.env import DistContext
from exactrl.model.precision import is_fp8
from exactrl.ops.fp8 import requantize_after_step
from exactrl.train import pinned

if TYPE_CHECKING:  # imported where used: it imports triton
    from exactrl.ops.triton.adamw import AdamWTables

OFFLOAD_MODES = ("none", "optimizer")
# With offload the step streams the state through the device in groups of parameters of at most this many bytes of
# masters and moments (one parameter alone may be more): the step's peak is one group, not the whole state.
OFFLOAD_CHUNK_BYTES = 1 << 30


def offload_chunks(numels: list[int], bytes_per_element: int, limit: int) -> list[list[int]]:
    """Consecutive groups of parameter indices whose state (`bytes_per_element` per element) stays within
    `limit` bytes, a parameter larger than the limit in a group of its own."""
    chunks: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        b = n * bytes_per_element
        if not chunks or size + b > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += b
    return chunks


class MasterAdamW:
    """AdamW over fp32 master copies of `model`'s parameters (the parameters themselves when already fp32)."""

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        dist: DistContext | None = None,
        offload: str = "none",
        offload_chunk_bytes: int = OFFLOAD_CHUNK_BYTES,
    ):
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"MasterAdamW offload must be one of {OFFLOAD_MODES}, got {offload!r}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        # fp8 projections: the CausalLM whose fp8 copies follow the step (a critic's backbone too).
        lm = getattr(model, "backbone", model)
        self._fp8_model = lm if is_fp8(lm) else None
        self.dist = dist or DistContext.single()
        # FSDP2: the parameters are fp32 DTensor shards, the masters themselves. The update runs on the local
        # shards as plain tensors (the same kernels as on one device), and only the gradient norm and the skip
        # decision cross ranks, in one all-reduce, so every rank clips by the same factor and skips together.
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        if self.sharded and not self.dist.distributed:
            raise ValueError("sharded (DTensor) parameters need the run's DistContext")
        self.has_master = not self.sharded and any(p.dtype != torch.float32 for p in self.params)
        self._persistent: set[int] = set()  # ids of params whose .grad buffer is kept (see persistent_grads)
        if self.has_master:
            # With offload the masters are made on the host: an fp32 copy of the whole model never sits on the
            # device (the cast of a 16-bit value to fp32 is exact, on any device).
            where = torch.device("cpu") if offload == "optimizer" else None
            self.master = [
                p.detach().to(device=where, dtype=torch.float32, copy=True).requires_grad_(True)
                for p in self.params
            ]
        elif self.sharded:
            with torch.no_grad():
                self.master = [p.to_local() for p in self.params]
        else:
            self.master = self.params
        # Every implementation is elementwise, deterministic and identical on resume. On the CPU torch's plain
        # loop. On CUDA with 16-bit weights, one Triton launch for all parameters that reads the 16-bit gradients
        # and writes the 16-bit weights (exactrl/ops/triton/adamw.py: no fp32 gradient copies, no copy back);
        # otherwise torch's fused kernel. torch's AdamW object holds the state either way, in its own format, so
        # checkpoints do not depend on which kernel ran.
        # The step's device: the weights' (the masters may start on the host, see above).
        self.device = (self.params if self.has_master else self.master)[0].device if self.params else None
        self.on_cuda = self.device is not None and self.device.type == "cuda"
        self._tables: AdamWTables | None = None  # built on the first Triton step
        kw = {"fused": True} if self.on_cuda else {"foreach": False}
        self.opt = torch.optim.AdamW(
            self.master, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, **kw
        )
        # Offload: the device the step runs on, and one host buffer per offloaded tensor, reused every step (the
        # pinned allocations cost more than the copies). Keyed by (master index, "master" | moment name).
        self.offload = offload
        self._chunks = offload_chunks([m.numel() for m in self.master], 12, offload_chunk_bytes)
        self._chunk_tables: dict[int, AdamWTables] = {}  # per chunk (the streamed Triton step)
        self._host: dict[tuple[int, str], torch.Tensor] = {}
        self.on_host = False  # the offloaded tensors are in their host buffers now
        # CUDA events around each queued step (offload's copies included), read by `take_step_seconds`: the
        # optimizer's share of a training step's time, measured without a synchronization of its own.
        # At most the last 64 steps are kept: a caller that never reads them (SFT, a critic's optimizer) holds no
        # growing list.
        self._timings: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=64)
        if offload == "optimizer":
            self.to_host()

    @property
    def param_groups(self):
        return self.opt.param_groups

    def persistent_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Give each of `params` (a subset of the optimized parameters) a zero `.grad` that stays at the same
        address from now on: `zero_grad` zeroes it in place instead of dropping it. A CUDA graph that adds into
        these buffers stays valid across optimizer steps."""
        ids = {id(p) for p in self.params}
        out = []
        for p in params:
            if id(p) not in ids:
                raise ValueError("persistent_grads: a parameter that this optimizer does not own")
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._persistent.add(id(p))
            out.append(p.grad)
        return out

    def zero_grad(self) -> None:
        keep = [p.grad for p in self.params if p.grad is not None and id(p) in self._persistent]
        if keep:
            torch._foreach_zero_(keep)
        for p in self.params:
            if id(p) not in self._persistent:
                p.grad = None
        if self.has_master or self.sharded:
            for m in self.master:
                m.grad = None

    def _masters_take_grads(self) -> None:
        """fp32 copies of the parameters' gradients on the masters, in one multi-tensor copy (not ~300 casts)."""
        src, dst = [], []
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else torch.empty_like(m)
            if p.grad is not None:
                src.append(p.grad)
                dst.append(m.grad)
        if dst:
            torch._foreach_copy_(dst, src)

    def clip_and_step(self, max_norm: float) -> float:
        """Clip the global grad norm to max_norm (0 = no clip), step, copy masters back. Returns the norm, or
        NaN without stepping when any gradient is not finite."""
        norm = self.clip_and_step_async(max_norm)
        if norm is None:
            return 0.0
        value = float(norm)
        return value if math.isfinite(value) else float("nan")

    def clip_and_step_async(self, max_norm: float, skip: torch.Tensor | None = None) -> torch.Tensor | None:
        """`clip_and_step` that does not wait for the device: returns the global grad norm as a 0-d float64
        tensor (non-finite: the step was skipped), or None when no parameter has a gradient.

        skip: an optional 0-d bool tensor; when true the step is skipped as for a non-finite norm (the trainer's
        non-finite loss). On CUDA the decision stays on the device: the Triton AdamW (or torch's fused one, through
        `found_inf` and `grad_scale`) takes the skip flag and the clip factor as device scalars and leaves weights,
        moments and step count alone on a skip, so no value is read back before the update is queued. On the CPU,
        where reading is free, the norm is read and the update is skipped or made by the host."""
        if not self.on_cuda:
            norm = self._clip_and_step_async(max_norm, skip)
            self._requantize()
            return norm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            norm = self._clip_and_step_async(max_norm, skip)
            self._requantize()
            return norm
        finally:
            end.record()
            self._timings.append((start, end))

    def _requantize(self) -> None:
        """A model with fp8 projections (`model.precision = "fp8"`) re-quantizes its trained weights from the model's
        own weights, just written from the new fp32 masters. Not from the masters: every other holder of these
        weights (a checkpoint loaded on resume, the one-step-off behaviour copy, a replay) has the model's weights
        and not the masters, and must quantize them to the same fp8 bits; the offloaded masters too."""
        if self._fp8_model is not None:
            requantize_after_step(self._fp8_model, self.params, [])

    def take_step_seconds(self) -> float:
        """Device seconds of the steps queued since the last call (waits for the last of them); 0 on the CPU."""
        timings, self._timings = self._timings, deque(maxlen=64)
        total = 0.0
        for start, end in timings:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total

    def _clip_and_step_async(self, max_norm: float, skip: torch.Tensor | None) -> torch.Tensor | None:
        if self.on_host and self.has_master and (self._triton_ready() or not self.on_cuda):
            # Masters of a 16-bit model: the step streams the state through the device, a group at a time.
            return self._streamed_step(max_norm, skip)
        if self.on_host and self.sharded:
            # FSDP2: the moment shards stream through the device a group at a time (`_sharded_update`).
            return self._sharded_step(max_norm, skip, streamed=True)
        if self.on_host:
            self.to_device()
        try:
            return self._step(max_norm, skip)
        finally:
            if self.offload == "optimizer":
                self.to_host()

    def _streamed_step(self, max_norm: float, skip: torch.Tensor | None) -> torch.Tensor | None:
        """The offloaded step, group by group: the norm and the clip factor from every gradient first (the
        16-bit gradients stay on the device), then each group's masters and moments come in, step, and go back.
        AdamW is elementwise and the factor is global, so every element gets the bits of the one-group step: the
        same kernel (the Triton AdamW on CUDA, torch's loop on the CPU) on the same values."""
        triton = self._triton_ready()
        grads16 = [p.grad for p in self.params]
        if not triton and all(g is None for g in grads16):
            self.zero_grad()
            return None
        if triton:
            norm, ok, scale = _device_clip(grads16, max_norm, skip)
            ok_f = ok.float()
        else:
            # The CPU path's norm, from the 16-bit gradients: their fp64 values are those of the fp32 copies the
            # unstreamed step takes the norm of (each cast is exact), so the same bits.
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.double()) for g in grads16 if g is not None])
            )
            norm_f = float(norm)
            if not math.isfinite(norm_f) or (skip is not None and bool(skip)):
                self.zero_grad()
                return torch.tensor(float("nan"), dtype=torch.float64)
            factor = max_norm / (norm_f + 1e-6) if max_norm > 0 and norm_f > max_norm else None
        for c, idx in enumerate(self._chunks):
            self.to_device(idx)
            if triton:
                self._triton_chunk(c, idx, grads16, scale, ok, ok_f)
            else:
                self._cpu_chunk(idx, factor)
            self.to_host(idx)
        self.zero_grad()
        self.on_host = True
        if triton:
            return torch.where(ok, norm, torch.full_like(norm, float("nan")))
        return norm

    def _cpu_chunk(self, idx: list[int], factor: float | None) -> None:
        """torch's AdamW on one group: the group's masters take fp32 gradients, every other master has none
        (torch steps only parameters with a gradient), the clip factor as in the unstreamed step."""
        grads = []
        for i in idx:
            p, m = self.params[i], self.master[i]
            if p.grad is not None:
                m.grad = p.grad.to(torch.float32, copy=True)
                grads.append(m.grad)
        if not grads:
            return
        if factor is not None:
            torch._foreach_mul_(grads, factor)
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_([self.params[i] for i in idx], [self.master[i] for i in idx])
        for i in idx:
            self.master[i].grad = None

    def _triton_chunk(self, c: int, idx: list[int], grads, scale, ok, ok_f) -> None:
        from exactrl.ops.triton.adamw import AdamWTables, adamw_step

        group = self.opt.param_groups[0]
        beta1, beta2 = group["betas"]
        masters = [self.master[i] for i in idx]
        state = self.opt.state
        for m in masters:
            if m not in state or not state[m]:
                state[m] = {
                    "step": torch.zeros((), dtype=torch.float32, device=m.device),
                    "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
                }
        steps = [state[m]["step"] for m in masters]
        torch._foreach_add_(steps, [ok_f] * len(steps))
        tables = self._chunk_tables.get(c)
        if tables is None:
            tables = self._chunk_tables[c] = AdamWTables([m.numel() for m in masters], self.device)
        tables.point_at(
            masters,
            [grads[i] for i in idx],
            [state[m]["exp_avg"] for m in masters],
            [state[m]["exp_avg_sq"] for m in masters],
            [self.params[i] for i in idx],
        )
        t = steps[0].double()
        scalars = torch.stack([scale, 1 - beta1**t, 1 - beta2**t, (~ok).double()]).float()
        adamw_step(
            tables,
            scalars,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    def _step(self, max_norm: float, skip: torch.Tensor | None) -> torch.Tensor | None:
        if self.sharded:
            return self._sharded_step(max_norm, skip)
        if self._triton_ready():
            return self._triton_step(max_norm, skip)
        if self.has_master:
            self._masters_take_grads()
        grads = [m.grad for m in self.master if m.grad is not None]
        if not grads:
            self.zero_grad()
            return None
        if not self.on_cuda:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
            )
            norm_f = float(norm)
            if not math.isfinite(norm_f) or (skip is not None and bool(skip)):
                self.zero_grad()
                return torch.tensor(float("nan"), dtype=torch.float64)
            if max_norm > 0 and norm_f > max_norm:
                torch._foreach_mul_(grads, max_norm / (norm_f + 1e-6))
            self._update()
            return norm
        norm, ok, scale = _device_clip(grads, max_norm, skip)
        self.opt.grad_scale = scale.float()  # type: ignore[attr-defined]
        self.opt.found_inf = (~ok).float()  # type: ignore[attr-defined]
        try:
            self._update()
        finally:
            del self.opt.grad_scale, self.opt.found_inf  # type: ignore[attr-defined]
        return torch.where(ok, norm, torch.full_like(norm, float("nan")))

    def _sharded_step(
        self, max_norm: float, skip: torch.Tensor | None, streamed: bool = False
    ) -> torch.Tensor | None:
        """The step on FSDP2 shards: the global norm from every rank's local sum of squares (one all-reduce that
        also carries the skip flags), the clip factor from it, AdamW on the local shards in place. `streamed`
        (offload): the moment shards come to the device a group at a time for their group's update and go back
        after it (`_sharded_update`): the same kernel reads the same values either way."""
        import torch.distributed as dist

        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.to_local()
        grads = [m.grad for m in self.master if m.grad is not None]
        dev = self.master[0].device
        sq = torch.zeros((), dtype=torch.float64, device=dev)
        if grads:
            sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double().square().sum()
        flag = torch.zeros((), dtype=torch.float64, device=dev) if skip is None else skip.to(dev).double()
        both = torch.stack((sq, flag))
        if self.dist.backend == "gloo" and both.is_cuda:  # pragma: no cover - gloo reduces host tensors
            both = both.cpu()
        dist.all_reduce(both, group=self.dist.group)
        both = both.to(dev)
        norm = both[0].sqrt()
        ok = torch.isfinite(norm) & (both[1] == 0)
        if not self.on_cuda:  # reading is free on the CPU: decide on the host, as the unsharded CPU path does
            norm_f = float(norm)
            if not bool(ok):
                self.zero_grad()
                return torch.tensor(float("nan"), dtype=torch.float64)
            if max_norm > 0 and norm_f > max_norm:
                torch._foreach_mul_(grads, max_norm / (norm_f + 1e-6))
            self._sharded_update(streamed)
            return norm
        one = torch.ones((), dtype=torch.float64, device=dev)
        scale = torch.where(ok & (norm > max_norm), (norm + 1e-6) / max_norm, one) if max_norm > 0 else one
        self.opt.grad_scale = scale.float()  # type: ignore[attr-defined]
        self.opt.found_inf = (~ok).float()  # type: ignore[attr-defined]
        try:
            self._sharded_update(streamed)
        finally:
            del self.opt.grad_scale, self.opt.found_inf  # type: ignore[attr-defined]
        return torch.where(ok, norm, torch.full_like(norm, float("nan")))

    def _sharded_update(self, streamed: bool) -> None:
        """AdamW on the local shards whose gradients are set: all at once, or `streamed` (offload) group by group,
        each group's moment shards brought to the device for its update and sent back to their host buffers after
        it, so that the device never holds more than one group's moments (under FSDP2 they are the largest term
        of a full fine-tune's optimizer phase). While a group steps only its shards carry a gradient, and torch's
        AdamW steps exactly the parameters that have one: each shard is stepped once, by the kernel and with the
        clip scale and skip flag of the one-group update, so the bits are that update's (AdamW is elementwise)."""
        if not streamed:
            self._update()
            return
        grads = [m.grad for m in self.master]
        for idx in self._chunks:
            for m in self.master:
                m.grad = None
            for i in idx:
                self.master[i].grad = grads[i]
            self.to_device(idx)
            self.opt.step()
            self.to_host(idx)
        self.on_host = True
        self.zero_grad()

    def _triton_ready(self) -> bool:
        """The one-launch Triton step applies: CUDA, 16-bit weights with fp32 masters, one weight dtype, every
        parameter has a gradient of that dtype, one parameter group."""
        if not (self.on_cuda and self.has_master) or len(self.opt.param_groups) != 1:
            return False
        dt = self.params[0].dtype
        return all(p.dtype == dt and p.grad is not None and p.grad.dtype == dt for p in self.params)

    def _triton_step(self, max_norm: float, skip: torch.Tensor | None) -> torch.Tensor:
        from exactrl.ops.triton.adamw import AdamWTables, adamw_step

        grads = [p.grad for p in self.params]
        norm, ok, scale = _device_clip(grads, max_norm, skip)
        group = self.opt.param_groups[0]
        beta1, beta2 = group["betas"]
        state = self.opt.state
        for m in self.master:  # torch's own state layout (fused AdamW: a float32 step on the device)
            if m not in state or not state[m]:
                state[m] = {
                    "step": torch.zeros((), dtype=torch.float32, device=m.device),
                    "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
                }
        steps = [state[m]["step"] for m in self.master]
        # Skipped steps do not count, as with fused AdamW's found_inf. A list of 0-d tensors, not the one tensor:
        # `_foreach_add_(tensors, tensor)` reads the scalar back to the host, a device sync in mid-step.
        ok_f = ok.float()
        torch._foreach_add_(steps, [ok_f] * len(steps))
        groups = (
            self.master,
            grads,
            [state[m]["exp_avg"] for m in self.master],
            [state[m]["exp_avg_sq"] for m in self.master],
            self.params,
        )
        if self._tables is None:
            self._tables = AdamWTables([m.numel() for m in self.master], self.master[0].device)
        self._tables.point_at(*groups)
        t = steps[0].double()
        scalars = torch.stack([scale, 1 - beta1**t, 1 - beta2**t, (~ok).double()]).float()
        adamw_step(
            self._tables,
            scalars,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )
        self.zero_grad()
        return torch.where(ok, norm, torch.full_like(norm, float("nan")))

    def _update(self) -> None:
        self.opt.step()
        if self.has_master:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
        self.zero_grad()

    # -- offload ---------------------------------------------------------------------------------------------
    def _offloaded(self, idx: list[int] | None = None) -> list[tuple[tuple[int, str], torch.Tensor]]:
        """(key, tensor) of what offload moves (of the masters `idx`, default all): the masters when they are
        copies of 16-bit parameters (fp32 parameters and FSDP shards are the model's own weights, which the
        forward needs), and every AdamW moment that exists (torch creates them at the first step)."""
        out = []
        for i in range(len(self.master)) if idx is None else idx:
            m = self.master[i]
            if self.has_master:
                out.append(((i, "master"), m.data))
            st = self.opt.state.get(m, {})
            for name in ("exp_avg", "exp_avg_sq"):
                if name in st:
                    out.append(((i, name), st[name]))
        return out

    def _put(self, key: tuple[int, str], t: torch.Tensor) -> None:
        i, name = key
        m = self.master[i]
        if name == "master":
            m.data = t  # the same Parameter object: torch's state and param_groups stay keyed by it
        else:
            self.opt.state[m][name] = t

    def _host_buffer(self, key: tuple[int, str], like: torch.Tensor, own: bool = False) -> torch.Tensor:
        """The host buffer of `key`, made at first use (pinned on CUDA) with `like`'s shape and dtype."""
        host = self._host.get(key)
        if host is None:
            if not self.on_cuda:
                host = torch.empty(like.shape, dtype=like.dtype, device="cpu")
            elif own and like.device.type == "cpu" and like.is_contiguous() and not like.is_pinned():
                # `like` is the key's own tensor already on the host (a master made there, a loaded moment):
                # page-locked in place, no second copy. Memory that is page-locked already (another optimizer's
                # buffer it was loaded from) cannot be registered twice: it gets a buffer of its own below.
                host = pinned.register(like)
            else:
                # Exactly its bytes (torch's pin_memory=True would round each one up to a power of two).
                host = pinned.empty_pinned(like.shape, like.dtype)
            self._host[key] = host
        return host

    def init_state(self) -> None:
        """Zero AdamW state for every master that has none yet (torch makes it at the first step), where the state
        waits between steps: the host buffers with offload, else the master's device. A checkpoint loads into
        these tensors in place (exactrl/train/sharded_checkpoint.py); with offload no moment of a resumed run passes
        through the device outside a step."""
        for i, m in enumerate(self.master):
            st = self.opt.state[m]
            if st:
                continue
            # fused AdamW and the Triton step keep the step count on the step's device; torch's loop on the host.
            st["step"] = torch.zeros((), dtype=torch.float32, device=self.device if self.on_cuda else "cpu")
            for name in ("exp_avg", "exp_avg_sq"):
                if self.offload == "optimizer" and self.on_host:
                    st[name] = self._host_buffer((i, name), m).zero_()
                else:
                    st[name] = torch.zeros_like(m)

    def to_host(self, idx: list[int] | None = None) -> None:
        """Move the masters and moments (of the masters `idx`, default all) into their host buffers (queued, not
        waited for)."""
        for key, t in self._offloaded(idx):
            host = self._host_buffer(key, t, own=True)
            if host is not t:
                host.copy_(t, non_blocking=True)
                self._put(key, host)
        if idx is None:
            self.on_host = True

    def to_device(self, idx: list[int] | None = None) -> None:
        """Bring the masters and moments (of the masters `idx`, default all) to the step's device (queued: stream
        order makes the step wait)."""
        for key, t in self._offloaded(idx):
            # A fresh device buffer even on the CPU, where host and device are one memory: the state really moves,
            # as it does on a GPU, and a test can see it.
            dev = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            dev.copy_(t, non_blocking=True)
            self._put(key, dev)
        if idx is None:
            self.on_host = False

    def synchronize(self) -> None:
        """Wait for the copies to the host buffers (before the host reads them: a checkpoint)."""
        if self.on_host and self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def offloaded_bytes(self) -> int:
        """Bytes that offload keeps in host memory between steps (those tensors' device bytes without offload)."""
        return sum(t.numel() * t.element_size() for _, t in self._offloaded())

    def state_dict(self) -> dict:
        self.synchronize()
        return {
            "opt": self.opt.state_dict(),
            "master": [m.detach().cpu() for m in self.master] if self.has_master else None,
        }

    def load_state_dict(self, state: dict) -> None:
        # torch puts loaded moments on their parameter's device: with offload the masters are on the host and the
        # moments land there, but fp32 parameters (no masters) live on the device, so the state is moved after.
        self.opt.load_state_dict(state["opt"])
        if self.has_master and state.get("master") is not None:
            with torch.no_grad():
                for m, saved, p in zip(self.master, state["master"], self.params):
                    m.copy_(saved)
                    p.copy_(m)
        if self.on_cuda:  # torch loads a fused step count onto its parameter's device: the host, with offload
            for st in self.opt.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].to(self.device)
        if self.offload == "optimizer":
            self.to_host()


def _device_clip(
    grads: list[torch.Tensor], max_norm: float, skip: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(global L2 norm fp64, step-ok flag, gradient divisor), all on the device: the divisor is exactly 1 unless
    the norm is over max_norm (0 = no clip); ok is false for a non-finite norm or when `skip` is set. Per-tensor
    norms accumulate in fp32 (from 16-bit gradients too: the values an fp32 copy would hold), in a few
    fixed-order, deterministic launches."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double())
    ok = torch.isfinite(norm)
    if skip is not None:
        ok = ok & ~skip.to(ok.device)
    one = torch.ones((), dtype=torch.float64, device=norm.device)
    scale = one
    if max_norm > 0:
        scale = torch.where(ok & (norm > max_norm), (norm + 1e-6) / max_norm, one)
    return norm, ok, scale


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac))
    if schedule == "linear":
        return 1.0 - frac
    raise ValueError(f"unknown lr_schedule {schedule!r}; use constant, cosine or linear")


def set_lr(opt: MasterAdamW, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
