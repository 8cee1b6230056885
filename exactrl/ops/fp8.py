"""FP8 projections (`model.precision = "fp8"`): the W8A8 block recipe, one quantizer and one GEMM for the engine
and the trainer alike, so their logprobs stay bitwise equal.

The recipe (DeepSeek-V3's block scaling):
- Weights: e4m3 with one fp32 scale per 128 x 128 block, scale = amax(|block|) / 448, quantized from the
  model-dtype weight (`requantize_after_step` after every optimizer step, once the fp32 master is written into it;
  at load from the loaded weights): the weights every holder of them shares, so a resumed run, the one-step-off copy
  and a replay quantize to the same bits. A packed
  projection (q/k/v, gate/up) is blocked part by part, so every part's bits are those of its own projection.
- Activations: e4m3 per token and 128-channel group, the scale from that row's group alone (amax is exact in any
  order, and the division is IEEE), so a row's fp8 bits never depend on the other rows of the call.
- GEMM: out[m, n] = sum over K-blocks kb = 0, 1, ... in order of (dot(a_q[m, kb], w_q[n, kb]) in fp32)
  * a_scale[m, kb] * w_scale[n, kb], accumulated in fp32, plus the bias, rounded once to the model dtype.

CPU emulation (`fp8_gemm_cpu`): the dot of two 128-long fp8 vectors is computed in float64, where it is exact
(every product of two e4m3 values is a multiple of 2^-18 below 2^18, so 128 of them add up within 43 bits of a
53-bit significand), then rounded once to fp32: the correctly rounded dot, whatever order or blocking the BLAS
picks, so the row's bits cannot depend on M. The GPU kernel (`exactrl/ops/triton/fp8_matmul.py`) takes the
tensor core's fp32 dot instead, which need not round the same way: CPU and GPU are each exact with themselves.

Backward (the trainer): the wrapped backend's own `linear` backward with the model-dtype weight W and the saved
model-dtype x (`wrapped_linear_backward`): the gradient of the forward's function with the quantizers of x and of W
taken as the identity, through the model dtype's kernels. On exact CUDA that is `linear_backward` of
exactrl/ops/triton/matmul.py (dX through the exact Triton GEMM, dW by torch.matmul), the function the bf16
projections' backward calls; on any other backend (the CPU's exact one, fast mode), autograd through its own
`linear`, its forward run again in the backward. The fp32 master takes dW;
the next forward uses its re-quantized blocks. The routed experts on CUDA: exactrl/ops/triton/fp8_moe.py.

`Fp8Ops` wraps any backend: the model's projections registered with it (`exactrl.model.precision.use_fp8`) run this recipe; every other
op, and every weight not registered (the LM head, the MoE router), is the wrapped backend's unchanged.
"""

from __future__ import annotations

import sys

import torch

from exactrl.ops.base import Ops

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
BLOCK = 128  # channels per activation group; weight blocks are BLOCK x BLOCK
PRECISIONS = ("dtype", "fp8")
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer


def _blocks(k: int) -> int:
    return -(-k // BLOCK)


def fp8_copy_shapes(shape: torch.Size | tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(values, scales) shapes of the fp8 copy of a weight of `shape` [..., N, K]: the e4m3 values with K padded to
    whole 128-blocks, and one fp32 scale a row and block (each row holds its block's)."""
    *lead, n, k = shape
    kb = _blocks(k)
    return (*lead, n, kb * BLOCK), (*lead, n, kb)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax -> fp32 scale amax / 448 (an all-zero group gets 1: its values quantize to 0 either way).

    Divided by a tensor, not the Python number: torch on CUDA turns a division by a CPU scalar into a multiplication
    by its reciprocal (not correctly rounded); the CPU, torch's CUDA tensor division and the Triton quantizer
    (`tl.math.div_rn`) all give the IEEE quotient."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x / scale is at most 448 up to one rounding: clamp so the cast never meets a value past the format's range.
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] (any float dtype) -> (q [T, KB * 128] e4m3, zero past K; scale [T, KB] fp32), KB = ceil(K / 128).

    Each row's 128-channel group is scaled by its own amax / 448 (from the value converted to fp32): row-local.
    On CUDA one Triton launch (`exactrl/ops/triton/fp8_quant.py`), the same bits as `quantize_activations_torch`."""
    if x.device.type == "cuda":
        from exactrl.ops.triton.fp8_quant import quantize_activations_triton

        return quantize_activations_triton(x)
    return quantize_activations_torch(x)


def quantize_activations_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` in torch ops (the CPU's, and the reference of the CUDA kernel)."""
    t, k = x.shape
    kb = _blocks(k)
    xf = torch.zeros(t, kb * BLOCK, dtype=torch.float32, device=x.device)
    xf[:, :k] = x
    groups = xf.view(t, kb, BLOCK)
    scale = _scale_of(groups.abs().amax(-1))  # [T, KB]
    q = _to_fp8(groups, scale[..., None]).view(t, kb * BLOCK)
    return q, scale


def quantize_weight(
    w: torch.Tensor, parts: list[int] | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., N, K] (the model-dtype weight, or any float tensor, converted to fp32) -> (q [..., N, KB * 128] e4m3,
    zero past K; row_scale [..., N, KB] fp32: every row holds its 128 x 128 block's scale).

    A leading dimension (a stack of experts) quantizes each [N, K] matrix on its own, in one pass: the amax of a
    block and the elementwise ops are exact whatever the tensor around them, so every matrix gets the bits it gets
    alone. parts: the row counts of a packed weight's projections (default: one part); blocks start at each part's
    first row, so a part quantizes as it would alone. out: the (q, row_scale) buffers to write in place (the
    engine's CUDA graphs read those addresses)."""
    *_, n, k = w.shape
    parts = [n] if parts is None else list(parts)
    if sum(parts) != n:
        raise ValueError(f"quantize_weight: parts {parts} do not add up to the weight's {n} rows")
    kb = _blocks(k)
    q_shape, s_shape = fp8_copy_shapes(w.shape)
    q, row_scale = out if out is not None else (
        torch.empty(q_shape, dtype=FP8_DTYPE, device=w.device),
        torch.empty(s_shape, dtype=torch.float32, device=w.device),
    )  # fmt: skip
    m = w.reshape(-1, n, k)  # [E, N, K]: E = 1 without a leading dimension
    e = m.shape[0]
    q_out, s_out = q.view(e, n, kb * BLOCK), row_scale.view(e, n, kb)
    start = 0
    for rows in parts:  # a part's blocks at once: rows padded with zeros to whole blocks (amax unchanged)
        nb = _blocks(rows)
        blk = torch.zeros(e, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
        blk[:, :rows, :k] = m[:, start : start + rows]
        groups = blk.view(e, nb, BLOCK, kb, BLOCK)
        scale = _scale_of(groups.abs().amax(dim=(2, 4)))  # [E, NB, KB]: one per 128 x 128 block
        qp = _to_fp8(groups, scale[:, :, None, :, None]).view(e, nb * BLOCK, kb * BLOCK)
        q_out[:, start : start + rows] = qp[:, :rows]
        s_out[:, start : start + rows] = scale.repeat_interleave(BLOCK, dim=1)[:, :rows]
        start += rows
    return q, row_scale


# The most fp32 elements of one part's working copy `Fp8Weight.quantize` lets one `quantize_weight` call of an expert
# stack make (2^26: 256 MB, about three such copies alive at once): experts go a chunk at a time, at least one.
QUANTIZE_CHUNK_ELEMENTS = 1 << 26


def part_working_elements(shape: torch.Size | tuple[int, ...], parts: list[int] | None) -> int:
    """Elements of `quantize_weight`'s fp32 working copy of the largest part of one [N, K] matrix (of a weight of
    `shape`, [..., N, K]): the part's rows and K padded to whole 128-blocks."""
    *_, n, k = shape
    return max(_blocks(rows) for rows in (parts or [n])) * BLOCK * _blocks(k) * BLOCK


def expert_chunk(shape: torch.Size | tuple[int, ...], parts: list[int] | None) -> int:
    """How many experts of a stack [E, N, K] one `quantize_weight` call takes (`QUANTIZE_CHUNK_ELEMENTS`)."""
    return max(1, QUANTIZE_CHUNK_ELEMENTS // part_working_elements(shape, parts))


def dequantize_weight(q: torch.Tensor, row_scale: torch.Tensor, k: int) -> torch.Tensor:
    """(q [N, KB * 128], row_scale [N, KB]) -> [N, k] fp32: the weight the fp8 GEMM multiplies by."""
    n, kb = row_scale.shape
    return (q.float().view(n, kb, BLOCK) * row_scale[..., None]).view(n, kb * BLOCK)[:, :k]


def is_weightless(t: torch.Tensor) -> bool:
    """Whether `t` stands for a weight it holds no memory of (a generator rank's fp8 projection, held as its fp8
    copy alone: `exactrl.model.precision.empty_fp8_only`): its shape and dtype over one element (every stride 0)."""
    return t.numel() > 1 and all(s == 0 for s in t.stride())


def fp8_gemm_cpu(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a: [M, KB * 128] e4m3, a_scale: [M, KB], w: [N, KB * 128] e4m3 (or its exact float64 copy, as `Fp8Weight`
    keeps it on the CPU), w_scale: [N, KB] -> [M, N] out_dtype.

    Each K-block's dot exactly in float64, rounded once to fp32; then the fixed-order fp32 chain
    acc = acc + (dot * a_scale) * w_scale over kb = 0, 1, ...; the bias added in fp32; one rounding to out_dtype."""
    m, kb = a_scale.shape
    n = w_scale.shape[0]
    a64 = a.to(torch.float64).view(m, kb, BLOCK).transpose(0, 1)  # [KB, M, 128]
    w64 = w.to(torch.float64).view(n, kb, BLOCK).permute(1, 2, 0)  # [KB, 128, N] (no copy when float64)
    dots = torch.bmm(a64, w64).float()  # [KB, M, N]: exact sums, one rounding each
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for b in range(kb):
        acc = acc + (dots[b] * a_scale[:, b, None]) * w_scale[None, :, b]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def check_fp8_copy(w: torch.Tensor, w_scale: torch.Tensor) -> None:
    """Refuse an fp8 copy with no values (a per-use entry's own buffers, `Fp8Weight`): read, it would be garbage."""
    if w.numel() == 0 or w_scale.numel() == 0:
        raise RuntimeError(
            'fp8 GEMM: the weight\'s fp8 copy is empty. Under FSDP2 with train.fsdp_fp8_copies = "per_use" a '
            "projection's copy exists only during its own op (`Fp8Weight.current()` quantizes the gathered weight "
            "for that call); code that reads a registered weight's `q` / `scale` / `operand` must read "
            "`current()`'s instead"
        )


def fp8_gemm(a, a_scale, w, w_scale, bias, out_dtype) -> torch.Tensor:
    """The fp8 GEMM of the device: the Triton kernel on CUDA, the float64-exact emulation elsewhere."""
    check_fp8_copy(w, w_scale)
    if a.device.type == "cuda":
        from exactrl.ops.triton.fp8_matmul import fp8_gemm_triton

        return fp8_gemm_triton(a, a_scale, w, w_scale, bias, out_dtype)
    return fp8_gemm_cpu(a, a_scale, w, w_scale, bias, out_dtype)


def _triton_linear_backward(inner: Ops):
    """exactrl/ops/triton/matmul.py when `inner`'s linear is TritonOps' (the exact CUDA backend), else None. A
    TritonOps exists only once its module is imported: a CPU run never imports triton for this question."""
    triton_ops = sys.modules.get("exactrl.ops.triton_ops")
    if triton_ops is None or type(inner).linear is not triton_ops.TritonOps.linear:
        return None
    from exactrl.ops.triton import matmul

    return matmul


def _grads_through(outputs, grads, inputs, needs):
    """d(inputs) of `outputs` (recomputed with autograd on) for `grads` (None: zero), None where not needed."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
    if not pairs:
        return (None,) * len(inputs)
    wanted = [t for t, n in zip(inputs, needs) if n and t is not None]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    return tuple(next(got) if n and t is not None else None for t, n in zip(inputs, needs))


def _detached(x, weight, bias, needs):
    return tuple(
        None if t is None else t.detach().requires_grad_(bool(n)) for t, n in zip((x, weight, bias), needs)
    )


def wrapped_linear_backward(inner: Ops, grad_out, x, weight, bias, needs) -> tuple:
    """The backward of `inner.linear(x, weight, bias)` for grad_out (the wrapped backend's own arithmetic, the
    fp8 projections' backward): exact CUDA, `linear_backward` of exactrl/ops/triton/matmul.py (the one its
    `_Linear` calls); any other backend, autograd through its own `linear` (run again: the CPU's exact linear pads
    the rows, and its backward is torch's on the padded rows)."""
    mm = _triton_linear_backward(inner)
    if mm is not None:
        return mm.linear_backward(grad_out, x, weight, bias is not None, needs)
    with torch.enable_grad():
        xd, wd, bd = _detached(x, weight, bias, needs)
        return _grads_through([inner.linear(xd, wd, bd)], [grad_out], (xd, wd, bd), needs)


def wrapped_packed_linear_backward(inner: Ops, grads, x, weight, bias, sizes, needs) -> tuple:
    """`wrapped_linear_backward` of `inner.packed_linear(x, weight, bias, sizes)`, grads one per part (None: zero)."""
    mm = _triton_linear_backward(inner)
    if mm is not None:
        return mm.packed_linear_backward(grads, x, weight, sizes, bias is not None, needs)
    with torch.enable_grad():
        xd, wd, bd = _detached(x, weight, bias, needs)
        return _grads_through(inner.packed_linear(xd, wd, bd, sizes), grads, (xd, wd, bd), needs)


class _Fp8Linear(torch.autograd.Function):
    """Forward: quantize x's rows, the fp8 GEMM against the quantized weight. Backward: the wrapped backend's
    `linear` backward with the model-dtype weight (the quantizers taken as the identity), so x and the weight are
    kept, not their fp8 values. q_w may be the fp8 values' exact float64 copy (the CPU's operand: the fp8 ->
    float64 conversion is slow)."""

    @staticmethod
    def forward(ctx, x, weight, bias, q_w, s_w, inner):  # type: ignore[override]
        q_x, s_x = quantize_activations(x)
        ctx.save_for_backward(x, weight, bias)
        ctx.inner = inner
        return fp8_gemm(q_x, s_x, q_w, s_w, bias, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight, bias = ctx.saved_tensors
        grads = wrapped_linear_backward(ctx.inner, grad_out, x, weight, bias, ctx.needs_input_grad[:3])
        return (*grads, None, None, None)


class _Fp8PackedLinear(torch.autograd.Function):
    """`_Fp8Linear` of a packed weight, split into its parts (views of one output); the backward is the wrapped
    backend's `packed_linear` backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, q_w, s_w, sizes, inner):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        q_x, s_x = quantize_activations(x)
        ctx.save_for_backward(x, weight, bias)
        ctx.inner, ctx.sizes = inner, sizes
        return fp8_gemm(q_x, s_x, q_w, s_w, bias, x.dtype).split(sizes, dim=-1)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        x, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        out = wrapped_packed_linear_backward(ctx.inner, grads, x, weight, bias, ctx.sizes, needs)
        return (*out, None, None, None, None)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    # As the wrapped backends take it (a backward's dW reads x as saved).
    return x if x.stride(-1) == 1 else x.contiguous()


def fp8_linear(x, weight, bias, q_w, s_w, inner: Ops | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K] (the model-dtype parameter the gradients go to), (q_w, s_w) its `quantize_weight`
    -> [T, N]. The backward is `inner`'s linear backward (default: the exact backend of x's device)."""
    return _Fp8Linear.apply(_unit_stride(x), weight, bias, q_w, s_w, inner or _exact_ops(x))


def fp8_packed_linear(x, weight, bias, q_w, s_w, sizes: list[int], inner: Ops | None = None) -> tuple:
    """`fp8_linear` of a packed weight [sum(sizes), K], one [T, size] output per part; backward: `inner`'s
    packed_linear backward."""
    return _Fp8PackedLinear.apply(
        _unit_stride(x), weight, bias, q_w, s_w, list(sizes), inner or _exact_ops(x)
    )


def _exact_ops(x: torch.Tensor) -> Ops:
    from exactrl.ops import get_ops

    return get_ops(x.device)


class Fp8Weight:
    """One registered parameter's fp8 copy: a projection [N, K] or a stack of experts [E, N, K] (each expert and
    each part blocked on its own). `version` is the parameter's `_version` when quantized: any in-place write to
    the parameter since (a weight sync, a checkpoint load, torch's optimizer on fp32 weights) is seen and the
    copy re-made from the parameter.

    An FSDP2 trainer's gathered weight (exactrl/model/precision.py `follow_gathered`, `train.fsdp_fp8_copies`):
    - kept: the copy is kept from one step to the next; `source` is the shard the optimizer steps (the gathered
      `param` is not written by the step: `requantize_after_step` marks the copy stale, and the next use
      quantizes the gather of the moment);
    - per_use: the entry holds no copy; `current()` quantizes the parameter as it is into new buffers for the one
      op that asks, freed when that op drops them. Its own buffers are empty, and the GEMM refuses them
      (`check_fp8_copy`)."""

    def __init__(
        self,
        param: torch.Tensor,
        parts: list[int] | None,
        source: torch.Tensor | None = None,
        per_use: bool = False,
    ):
        self.param = param
        self.parts = parts
        # The parameter an optimizer steps: the weight itself, or under FSDP2 its shard.
        self.source = param if source is None else source
        self.per_use = per_use
        q_shape, s_shape = ((0,), (0,)) if per_use else fp8_copy_shapes(param.shape)
        self.q = torch.empty(q_shape, dtype=FP8_DTYPE, device=param.device)
        self.scale = torch.empty(s_shape, dtype=torch.float32, device=param.device)
        self.version = -1
        # The GEMM's weight operand: the fp8 values themselves on CUDA; on the CPU their exact float64 copy, made
        # once per quantization (the CPU's fp8 -> float64 conversion costs more than the GEMM).
        self.operand = self.q

    def _holds_a_copy(self, what: str) -> None:
        if self.per_use:
            raise RuntimeError(
                f"Fp8Weight.{what}: this fp8 projection (an FSDP2 trainer's gathered weight, "
                'train.fsdp_fp8_copies = "per_use") holds no copy of its own; current() quantizes one for each use'
            )

    @torch.no_grad()
    def quantize(self, source: torch.Tensor | None = None) -> None:
        """Quantize from `source` (default, and what the optimizer uses: the parameter itself, the weights every
        holder of them shares) into the same buffers."""
        self._holds_a_copy("quantize")
        if source is None and is_weightless(self.param):
            raise RuntimeError(
                f"fp8: a projection weight {tuple(self.param.shape)} is held as its fp8 copy alone (a generator "
                "rank's), so its copy cannot be quantized here: it comes with the weight sync, which has not sent it"
            )
        src = self.param.detach() if source is None else source.detach()
        if src.dim() == 2:
            quantize_weight(src, self.parts, (self.q, self.scale))
        else:  # an expert stack: a chunk of experts a call (each blocked on its own), the fp32 working set bounded
            step = expert_chunk(src.shape, self.parts)
            for e in range(0, src.shape[0], step):
                quantize_weight(
                    src[e : e + step], self.parts, (self.q[e : e + step], self.scale[e : e + step])
                )
        if self.q.device.type != "cuda":
            self.operand = self.q.to(torch.float64)
        self.version = self.param._version

    @torch.no_grad()
    def set(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Take (q, scale) made elsewhere as the copy of the parameter as it is now, into the same buffers (a
        tensor-parallel engine shard's rows of its whole weight's copy, exactrl/model/precision.py)."""
        self._holds_a_copy("set")
        if q is not self.q:  # (received into the buffers themselves: nothing to copy)
            self.q.copy_(q)
        if scale is not self.scale:
            self.scale.copy_(scale)
        if self.q.device.type != "cuda":
            self.operand = self.q.to(torch.float64)
        self.version = self.param._version

    def current(self) -> Fp8Weight:
        """The copy of the parameter as it is now: this entry (re-quantized if the parameter was written since),
        or for a per-use entry a new copy of its own, for the caller's op alone."""
        if self.per_use:
            fresh = Fp8Weight(self.param, self.parts)
            fresh.quantize()
            return fresh
        if self.param._version != self.version:
            self.quantize()
        return self


class Fp8Ops:
    """An ops backend whose registered projections compute in fp8 (this module's recipe); every other op and
    weight goes to the wrapped backend `inner` unchanged."""

    def __init__(self, inner: Ops):
        self.inner = inner
        self.name = f"{inner.name}+fp8"
        self.exact = inner.exact
        self._weights: dict[int, Fp8Weight] = {}

    def __getattr__(self, name: str):  # every op this class does not define: the wrapped backend's
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __deepcopy__(self, memo: dict) -> Fp8Ops:
        """A deep copy of the model (the reference policy) gets its own fp8 weights, keyed by its own parameters."""
        import copy

        new = Fp8Ops(copy.deepcopy(self.inner, memo))
        for entry in self._weights.values():
            e = copy.deepcopy(entry, memo)
            new._weights[id(e.param)] = e
        return new

    # -- the registered weights --------------------------------------------------------------------------
    def register(
        self,
        param: torch.Tensor,
        parts: list[int] | None = None,
        *,
        source: torch.Tensor | None = None,
        per_use: bool = False,
        quantize: bool = True,
    ) -> Fp8Weight:
        """quantize=False: the copy is made at its first use (a weight whose values come later). source: the
        tensor the optimizer steps for `param` (an FSDP2 shard). per_use: no copy is kept, each use quantizes its
        own (`Fp8Weight`)."""
        entry = Fp8Weight(param, parts, source, per_use)
        if quantize and not per_use:
            entry.quantize()
        self._weights[id(param)] = entry
        return entry

    def clear(self) -> None:
        """Forget every registered weight (their parameters were replaced: FSDP2's shards, a replica's own)."""
        self._weights.clear()

    def entry_of(self, weight: torch.Tensor) -> Fp8Weight | None:
        """`weight`'s fp8 copy as it is (stale or not), or None if `weight` is not registered (the same id may be a
        tensor registered once and since freed: the entry's own parameter is compared)."""
        entry = self._weights.get(id(weight))
        return entry if entry is not None and entry.param is weight else None

    def entries(self) -> list[Fp8Weight]:
        """Every registered fp8 copy."""
        return list(self._weights.values())

    def _entry(self, weight: torch.Tensor) -> Fp8Weight | None:
        entry = self.entry_of(weight)
        return entry.current() if entry is not None else None

    @property
    def num_weights(self) -> int:
        return len(self._weights)

    # -- the ops -----------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        entry = self._entry(weight)
        if entry is None:  # the LM head, the router: the wrapped backend's
            return self.inner.linear(x, weight, bias)
        return fp8_linear(x, weight, bias, entry.operand, entry.scale, self.inner)

    def packed_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
    ) -> tuple[torch.Tensor, ...]:
        entry = self._entry(weight)
        if entry is None:
            return self.inner.packed_linear(x, weight, bias, sizes)
        if entry.parts != list(sizes):
            raise ValueError(
                f"fp8 packed_linear: the weight was registered with parts {entry.parts}, got {sizes}"
            )
        return fp8_packed_linear(x, weight, bias, entry.operand, entry.scale, sizes, self.inner)

    def moe_experts(self, x, gate_up, down, weights, ids) -> torch.Tensor:
        """The routed experts in fp8: expert e's gate|up and down GEMMs with its own blocks, combined in rank
        order in fp32 (`experts_exact`'s arithmetic with the fp8 GEMM). The GEMM is row-local, so a slot's bits
        do not depend on which other slots share its expert's call. On CUDA the grouped fp8 kernels run each
        expert over its routed slots, sorted on the device (`exactrl/ops/triton/fp8_moe.py`: no host sync, CUDA
        graphs capture it), with gradients (the trainer) the same forward and the exact bf16 experts' backward
        with the model-dtype weights. On the CPU each expert takes its routed slots (counts read on the host),
        autograd through `fp8_linear`."""
        from exactrl.ops.moe_torch import check_experts_args

        e_gu, e_down = self._entry(gate_up), self._entry(down)
        if e_gu is None or e_down is None:
            return self.inner.moe_experts(x, gate_up, down, weights, ids)
        check_experts_args(x, gate_up, down, weights, ids)
        if x.device.type == "cuda":
            check_fp8_copy(e_gu.q, e_gu.scale)
            check_fp8_copy(e_down.q, e_down.scale)
            from exactrl.ops.triton.fp8_moe import fp8_moe_experts

            return fp8_moe_experts(
                x, gate_up, down, weights, ids, (e_gu.q, e_gu.scale), (e_down.q, e_down.scale),
                self.inner.silu_mul, quantize_activations,
            )  # fmt: skip
        return self.experts_grouped(x, gate_up, down, weights, ids, e_gu, e_down)

    def _expert(self, rows, e, gate_up, down, e_gu: Fp8Weight, e_down: Fp8Weight) -> torch.Tensor:
        """rows [R, D] through expert e: fp8 gate|up, silu_mul, fp8 down -> [R, D]."""
        inter = gate_up.shape[1] // 2
        gu = fp8_linear(rows, gate_up[e], None, e_gu.operand[e], e_gu.scale[e], self.inner)
        h = self.inner.silu_mul(gu[:, :inter], gu[:, inter:])
        return fp8_linear(h, down[e], None, e_down.operand[e], e_down.scale[e], self.inner)

    def experts_grouped(self, x, gate_up, down, weights, ids, e_gu, e_down) -> torch.Tensor:
        """Each expert on the slots routed to it (the counts read on the host), scattered back, rank-order combine."""
        from exactrl.ops.moe_torch import _groups, combine_rank_order

        t, k = ids.shape
        order, counts = _groups(ids, gate_up.shape[0])
        sorted_out = x.new_zeros(order.numel(), x.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                slots = order[start : start + n]
                sorted_out[start : start + n] = self._expert(x[slots // k], e, gate_up, down, e_gu, e_down)
                start += n
        outs = torch.empty_like(sorted_out)
        outs[order] = sorted_out
        return combine_rank_order(outs.view(t, k, x.shape[1]), weights, x.dtype)


def check_fp8_device(device: torch.device | str) -> None:
    """Refuse a GPU without FP8 tensor cores (compute capability below 8.9) by name."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f'model.precision = "fp8" needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, '
            f'Blackwell); {name} is {cap[0]}.{cap[1]}. Set model.precision = "dtype" (--precision dtype)'
        )


def requantize_after_step(model: torch.nn.Module, params: list[torch.Tensor], masters: list[torch.Tensor]):
    """After an optimizer step: re-quantize the fp8 weights among the optimizer's `params` from their fp32
    `masters` (empty: from the parameters). Frozen weights (a LoRA base) are left as they are."""
    ops = getattr(model, "ops", None)
    if isinstance(ops, Fp8Ops):
        sources: list[torch.Tensor | None] = list(masters) if masters else [None] * len(params)
        for p, m in zip(params, sources):
            entry = ops.entry_of(p)
            if entry is not None:
                entry.quantize(m)
        # FSDP2: the step wrote shards; each gathered weight's kept copy is re-made from its next gather (a per-use
        # entry keeps none: each use quantizes the gather of the moment).
        stepped = {id(p) for p in params}
        for entry in ops.entries():
            if entry.source is not entry.param and id(entry.source) in stepped:
                entry.version = -1
