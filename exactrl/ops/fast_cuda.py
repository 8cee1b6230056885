"""`FastCudaOps`: the fast (not batch-invariant) backend on CUDA, the path an inference engine or a trainer
would take without the invariance rules. It is what exact mode's price is measured against, and it stays the
negative control of every exactness test (parity shows its mismatches).

| op | fast kernel | why it is not batch invariant |
| --- | --- | --- |
| linear, packed_linear | cuBLAS (`F.linear`); packed: dX as a chain of GEMMs over the parts' gradients, no concatenated copy | cuBLAS picks its algorithm (tile, split-K) by M |
| attention, training | FlashAttention-2 varlen (`torch.nn.attention.varlen.varlen_attn`), forward and backward | FA2 picks its split by shape |
| attention, prefill/decode | exactrl's paged Triton kernel (the exact one) | (the same kernel as exact mode) |
| norms, RoPE, SiLU | exactrl's fused Triton kernels | (row-local: nothing to give up) |
| logprobs (training) | cuBLAS LM head, logits kept for the backward; exactrl's Triton log-softmax kernels | cuBLAS picks its algorithm by shape |
| logits, logprobs (no grad, or too many rows to keep) | exactrl's fused Triton LM-head + log-softmax kernels | (the same kernels as exact mode) |
| moe_experts | `torch._grouped_mm` (CUTLASS grouped GEMM) over the rows sorted by expert, combine in the model dtype | the library picks its kernel by shape; the combine rounds each weighted output to the model dtype |
| moe_route | exactrl's Triton router (the exact one) | (row-local: nothing to give up) |

The fused norm/RoPE/SiLU and log-softmax kernels are shared with exact mode because a fast path fuses them too
and we have no faster non-invariant version of them (a row is reduced by one program either way; no split over
the vocab; a split-vocab logprob kernel might be faster and is not written). Training's LM-head GEMMs are cuBLAS's
where the logits are kept (exactrl/ops/triton/logprobs.py: up to LOGPROB_KEEP_BYTES); a call that recomputes them
in its backward keeps the invariant matmul for them, whose recomputed logits are the forward's bits. The torch
composition the fused kernels replace (cuBLAS LM head, then log_softmax, gather and their backward as separate fp32
passes over [rows, vocab]) made the fast training step slower than transformers' on an H100 (29k vs 40k tok/s,
qwen3-0.6b, 2026-11-24): not a fast path. So fast and exact differ exactly where invariance
binds: the GEMMs and the training attention. The fast path has no varlen flash
attention over a paged KV cache in this torch build (torch 2.11's `varlen_attn` takes no block table), so cached
attention runs exactrl's own paged kernel, the same as exact mode's, with its split-KV decode at low concurrency
(keys split across programs at fixed 64-key chunks; exact mode can afford it because training folds the same
chunks: exactrl/ops/triton/attention.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from exactrl.ops.batch import AttentionBatch
from exactrl.ops.triton.logprobs import logprobs as triton_logprobs
from exactrl.ops.triton_ops import TritonOps


def _varlen_attn():
    """torch's varlen FlashAttention entry point, or None where this build has none (then the Triton kernel)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - depends on the torch build
        return None
    return varlen_attn


class FastCudaOps(TritonOps):
    """cuBLAS GEMMs, FlashAttention-2 varlen for packed training sequences, the paged Triton kernel for the
    rollout engine, fused Triton norms and logprobs: fast, and free to change a row's bits with the batch."""

    name = "fast-cuda"
    exact = False

    def __init__(self) -> None:
        self._varlen = _varlen_attn()
        self.training_attention = "flash-varlen" if self._varlen is not None else "triton"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def packed_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
    ) -> tuple[torch.Tensor, ...]:
        if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return _CublasPackedLinear.apply(x, weight, bias, list(sizes))
        return F.linear(x, weight, bias).split(list(sizes), dim=-1)

    def logprobs(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return triton_logprobs(hidden, weight, targets, temperature, with_entropy, mm=cublas_mm)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        kv_written: bool = False,
    ) -> torch.Tensor:
        if kv_cache is None and self._varlen is not None and q.dtype != torch.float32:
            return self._flash_varlen(q, k, v, batch)
        return super().attention(q, k, v, batch, kv_cache, kv_written=kv_written)

    def _flash_varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        # Packed whole sequences: sequence b's keys are its own rows, so the query offsets are the key offsets.
        # FA2 takes GQA natively (Hkv divides Hq) and a causal mask as the window (-1, 0). max_seqlen_q is the
        # bucket's width in captured training graphs, a Python int, so capture sees no host sync.
        cu = batch.cu_seqlens_q.to(torch.int32)
        m = int(batch.max_seqlen_q)
        return self._varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, m, m, window_size=(-1, 0))

    # logits, scale_logits, logprobs_from_logits: TritonOps' fused kernels (see the module docstring).

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed expert MLPs as a fast MoE layer runs them: the (token, rank) pairs sorted by expert, two
        grouped GEMMs (`torch._grouped_mm`) with silu_mul between, each weighted output rounded to the model
        dtype and a token's k summed (transformers' combine). Where `_grouped_mm` is unavailable (not bf16,
        no Hopper, old torch): one cuBLAS GEMM per expert, which needs the per-expert counts on the host (a
        sync: that fallback cannot be captured in a CUDA graph)."""
        T, k = ids.shape
        E, inter = gate_up.shape[0], down.shape[2]
        flat = ids.reshape(-1)
        sorted_ids, order = torch.sort(flat)  # no order promised within an expert: nothing here is invariant
        xs = x.index_select(0, order // k)
        if grouped_mm_ok(x, gate_up, down):
            ends = torch.searchsorted(
                sorted_ids, torch.arange(1, E + 1, device=x.device, dtype=flat.dtype), out_int32=True
            )
            gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends)
            h = self.silu_mul(gu[:, :inter], gu[:, inter:])
            o = torch._grouped_mm(h, down.transpose(1, 2), offs=ends)
        else:
            o = _per_expert_mlps(xs, gate_up, down, torch.bincount(flat, minlength=E).tolist(), self.silu_mul)
        # Back to (token, rank) order, then transformers' combine: weight and sum in the model dtype.
        y = o.new_empty(o.shape).index_copy(0, order, o).view(T, k, -1)
        return (y * weights.to(x.dtype).unsqueeze(-1)).sum(1)


def cublas_mm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T with cuBLAS, in x's dtype or `out_dtype` (16-bit operands into an fp32 output:
    torch.mm's out_dtype, fp32 accumulation written without a 16-bit rounding)."""
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, w)
    return torch.mm(x, w.t(), out_dtype=out_dtype)


class _CublasPackedLinear(torch.autograd.Function):
    """Projections packed into one weight (q/k/v, gate/up) with cuBLAS: one forward GEMM split into views. The
    backward takes the parts' gradients as they come: dX as a chain of GEMMs, each adding its part into one
    output (beta = 1), instead of torch's split backward, which concatenates the gradients into a new
    [T, sum(sizes)] tensor first (a full copy: 5 ms of a qwen3-1.7b step of 8,192 tokens on an H100); dW part
    by part into the packed gradient's rows. The price: dX is rounded to the model dtype once per part (three
    times for q/k/v) instead of once (CPU, bf16: 2.5e-3 relative error against 1.7e-3), a fast path's trade."""

    @staticmethod
    def forward(ctx, x, weight, bias, sizes):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.sizes = bias is not None, sizes
        return F.linear(x, weight, bias).split(sizes, dim=-1)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        starts = [0]
        for n in ctx.sizes:
            starts.append(starts[-1] + n)
        parts = [
            (None if g is None else g.reshape(-1, g.shape[-1]), a, b)
            for g, a, b in zip(grads, starts, starts[1:])
        ]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            for g, a, b in parts:
                if g is not None:
                    gx = torch.mm(g, weight[a:b]) if gx is None else gx.addmm_(g, weight[a:b])
            gx = (torch.zeros_like(x2) if gx is None else gx).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = torch.empty_like(weight)
            for g, a, b in parts:
                if g is None:
                    gw[a:b].zero_()
                else:
                    torch.mm(g.t(), x2, out=gw[a:b])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = torch.cat([x2.new_zeros(b - a) if g is None else g.sum(0) for g, a, b in parts])
        return gx, gw, gb, None


def grouped_mm_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: this torch has it, bf16 on a Hopper-or-newer GPU (the
    CUTLASS kernel; the CPU build also runs bf16 and fp32, which the interpreter tests use), and every row
    16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    row_bytes = (x.shape[1] * x.element_size(), down.shape[2] * x.element_size())
    return all(b % 16 == 0 for b in row_bytes) and x.shape[0] > 0


def _per_expert_mlps(
    xs: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: list[int],
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """xs: [S, D] rows sorted by expert, counts[e] rows each -> [S, D]: each expert's rows through its MLP with
    cuBLAS."""
    inter = down.shape[2]
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gu = F.linear(xs[start : start + n], gate_up[e])
            outs.append(F.linear(silu_mul(gu[:, :inter], gu[:, inter:]), down[e]))
        start += n
    return torch.cat(outs) if outs else xs.new_zeros(xs.shape)
