"""Ops in plain PyTorch: `ExactTorchOps` (batch-invariant, the CPU exact backend) and `FastOps` (PyTorch's
default kernels, for comparison and as the negative control of every exactness test).

Why the exact ops look the way they do (facts measured on the CPU machines, guarded by tests/ops):
- MKL's fp32 GEMM gives a row different bits when the call has fewer than 8 rows; padding the row count up to
  a multiple of 16 made every tried row count agree. So `linear` pads rows.
- Row-wise reductions over the last, contiguous dimension (sum, amax, log_softmax) give a row the same bits
  whatever else is in the call. So attention's dot products are an elementwise product and a last-dim sum,
  never a batched matmul whose blocking depends on the number of query rows.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F

from exactrl.ops.batch import BLOCK_N, AttentionBatch
from exactrl.ops.elementwise_torch import sigmoid_exact, silu_mul_exact
from exactrl.ops.moe_torch import experts_exact, experts_fast, route_topk

ROW_MULTIPLE = 16  # linear pads its rows to a multiple of this (and at least this many)
LOGPROB_CHUNK_ROWS = 1024  # rows of [rows, vocab] fp32 logits alive at once in logprobs


def _round_up(x: int, m: int) -> int:
    return max(m, -(-x // m) * m)


# ----------------------------------------------------------------------------------------------------------
# Shared pieces (the same in both backends)
# ----------------------------------------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF order: normalise in fp32, cast back to the input dtype, then multiply by the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_torch(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cs = cos_sin[positions]  # [T, Dh] fp32
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def kv_cache_views(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged cache's (k_cache, v_cache), each [num_blocks, block_size, Hkv, Dh], as flat [slots, Hkv, Dh]
    views: the key store attention reads through batch.key_slots."""
    k_cache, v_cache = kv_cache
    hkv, dh = k_cache.shape[-2:]
    return k_cache.view(-1, hkv, dh), v_cache.view(-1, hkv, dh)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new rows into the paged cache (before attending: rule 4) and return flat [slots, Hkv, Dh] views."""
    k_flat, v_flat = kv_cache_views(kv_cache)
    k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))
    return k_flat, v_flat


def _slots(batch: AttentionBatch) -> torch.Tensor:
    """The batch's KV cache slots: set by the engine whenever it attends against a cache (a cast, no check: the
    decode path runs this per layer)."""
    return cast(torch.Tensor, batch.slot_mapping)


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, k_store=None, v_store=None
) -> torch.Tensor:
    """Plain masked softmax attention in fp32, differentiable; keys gathered through batch.key_slots.

    Used by the fast backend, as the reference in tests, and to compute gradients of the exact attention."""
    k_store = k if k_store is None else k_store
    v_store = v if v_store is None else v_store
    T, hq, dh = q.shape
    hkv = k_store.shape[1]
    g = hq // hkv
    B, L = batch.key_slots.shape
    # Queries padded per sequence: [B, Qmax, Hq, Dh].
    qmax = batch.max_seqlen_q
    row_in_seq = torch.arange(T, device=q.device) - batch.cu_seqlens_q[batch.q_seq]
    qp = q.new_zeros(B, qmax, hq, dh)
    qp = qp.index_put((batch.q_seq, row_in_seq), q)
    kk = k_store[batch.key_slots].float().repeat_interleave(g, dim=2)  # [B, L, Hq, Dh]
    vv = v_store[batch.key_slots].float().repeat_interleave(g, dim=2)
    qpos = torch.full((B, qmax), -1, dtype=torch.int64, device=q.device)
    qpos = qpos.index_put((batch.q_seq, row_in_seq), batch.q_pos)
    mask = torch.arange(L, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, Qmax, L]
    scores = torch.einsum("bqhd,bkhd->bhqk", qp.float(), kk) / math.sqrt(dh)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vv)
    return out[batch.q_seq, row_in_seq].to(q.dtype)


def attention_sdpa(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """The fast backend's attention: PyTorch's fused `scaled_dot_product_attention` (GQA, boolean causal mask)
    on queries padded per sequence and keys gathered through batch.key_slots. Differentiable. Its kernels pick
    their split by shape, so a row's bits may depend on the batch: fine for the fast mode, never used by exact."""
    T, hq, dh = q.shape
    B, L = batch.key_slots.shape
    qmax = batch.max_seqlen_q
    row_in_seq = torch.arange(T, device=q.device) - batch.cu_seqlens_q[batch.q_seq]
    qp = q.new_zeros(B, qmax, hq, dh).index_put((batch.q_seq, row_in_seq), q)
    kk = k_store[batch.key_slots].to(q.dtype)  # [B, L, Hkv, Dh]
    vv = v_store[batch.key_slots].to(q.dtype)
    qpos = torch.full((B, qmax), -1, dtype=torch.int64, device=q.device)
    qpos = qpos.index_put((batch.q_seq, row_in_seq), batch.q_pos)
    n = torch.arange(L, device=q.device)
    # Padding query rows (qpos = -1) look at key 0 only, so no row is fully masked (NaN in the backward).
    mask = (n[None, None, :] <= qpos[:, :, None]) | ((qpos < 0)[:, :, None] & (n == 0)[None, None, :])
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        kk.transpose(1, 2),
        vv.transpose(1, 2),
        attn_mask=mask[:, None],
        enable_gqa=True,
    )  # [B, Hq, Qmax, Dh]
    return out.transpose(1, 2)[batch.q_seq, row_in_seq]


# ----------------------------------------------------------------------------------------------------------
# Exact (batch-invariant) attention
# ----------------------------------------------------------------------------------------------------------


def attention_tiled(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """Per-query online softmax over key tiles of BLOCK_N positions, starting at position 0.

    q: [T, Hq, Dh]; k_store/v_store: [S, Hkv, Dh] indexed by batch.key_slots. A tile whose keys are all
    masked leaves (m, l, acc) bit-for-bit unchanged: exp(m - m) == 1 and exp(-inf) == 0, so the number of
    tiles a query walks through (its batch's longest sequence) never shows in its result.
    """
    T, hq, dh = q.shape
    hkv = k_store.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(dh)
    qf = (q.float() * scale).view(T, hkv, g, 1, dh)
    slots = batch.key_slots[batch.q_seq]  # [T, L]
    q_pos = batch.q_pos
    m = torch.full((T, hkv, g), float("-inf"), device=q.device)
    l_sum = torch.zeros((T, hkv, g), device=q.device)
    acc = torch.zeros((T, hkv, g, dh), device=q.device)
    num_tiles = -(-batch.max_key_len // BLOCK_N)
    for j in range(num_tiles):
        tile = slots[:, j * BLOCK_N : (j + 1) * BLOCK_N]  # [T, BN]
        kt = k_store[tile].float().permute(0, 2, 1, 3)[:, :, None]  # [T, Hkv, 1, BN, Dh]
        vt = v_store[tile].float().permute(0, 2, 3, 1)[:, :, None]  # [T, Hkv, 1, Dh, BN]
        # Dot products as product + last-dim sum: each score is reduced over Dh alone, in one fixed order.
        scores = (qf * kt).sum(-1)  # [T, Hkv, g, BN]
        key_pos = torch.arange(j * BLOCK_N, (j + 1) * BLOCK_N, device=q.device)
        valid = key_pos[None, :] <= q_pos[:, None]  # [T, BN]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])  # masked keys: exp(-inf) == 0 exactly
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[:, :, :, None, :] * vt).sum(-1)
        m = m_new
    out = acc / l_sum[..., None]
    return out.view(T, hq, dh).to(q.dtype)


class _PackedAttention(torch.autograd.Function):
    """Exact forward (tiled), gradient from the plain fp32 formulation (deterministic on CPU)."""

    @staticmethod
    def forward(ctx, q, k, v, batch):  # type: ignore[override]
        ctx.batch = batch
        ctx.save_for_backward(q, k, v)
        return attention_tiled(q, k, v, batch)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = attention_reference(qd, kd, vd, ctx.batch)
            gq, gk, gv = torch.autograd.grad(out, (qd, kd, vd), grad_out)
        return gq, gk, gv, None


# ----------------------------------------------------------------------------------------------------------
# Logprobs: row-chunked, fp32, temperature inside the op
# ----------------------------------------------------------------------------------------------------------


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T / temperature) gathered at targets, plus entropy, chunked over rows.

    Backward recomputes each chunk's logits instead of keeping [T, V] in memory."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, linear_fn, chunk):  # type: ignore[override]
        T = hidden.shape[0]
        lp = torch.empty(T, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(T, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for s in range(0, T, chunk):
            z = linear_fn(hidden[s : s + chunk], weight).float() / temperature
            logp = torch.log_softmax(z, dim=-1)
            lp[s : s + chunk] = logp.gather(1, targets[s : s + chunk, None])[:, 0]
            if ent is not None:
                ent[s : s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.temperature, ctx.with_entropy, ctx.linear_fn, ctx.chunk = (
            temperature,
            with_entropy,
            linear_fn,
            chunk,
        )
        if ent is not None:
            ctx.save_for_backward(hidden, weight, targets, ent)
        else:
            ctx.save_for_backward(hidden, weight, targets)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors[:3]
        ent = ctx.saved_tensors[3] if ctx.with_entropy else None
        t = ctx.temperature
        gh = torch.zeros_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            z = ctx.linear_fn(h, weight).float() / t
            logp = torch.log_softmax(z, dim=-1)
            p = logp.exp()
            g_lp = grad_lp[s : s + ctx.chunk, None] if grad_lp is not None else None
            # d logp[y] / dz = onehot(y) - p
            gz = torch.zeros_like(z)
            if g_lp is not None:
                gz = -p * g_lp
                gz.scatter_add_(1, targets[s : s + ctx.chunk, None], g_lp)
            if ent is not None and grad_ent is not None:
                # H = -sum p log p; dH/dz_j = -p_j (log p_j + H)
                gz = gz - grad_ent[s : s + ctx.chunk, None] * p * (logp + ent[s : s + ctx.chunk, None])
            gz = gz / t
            if gh is not None:
                gh[s : s + ctx.chunk] = gz @ weight.float()
            if gw is not None:
                gw += gz.t() @ h.float()
        return (
            gh.to(hidden.dtype) if gh is not None else None,
            gw.to(weight.dtype) if gw is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(
            f"logprobs need a temperature > 0 (greedy decoding records logprobs at 1.0), got {temperature}"
        )


# ----------------------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------------------


class ExactTorchOps:
    """Batch-invariant ops in plain PyTorch: the exact backend on the CPU."""

    name = "exact-torch"
    exact = True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        mp = _round_up(m, ROW_MULTIPLE)
        if mp == m:
            return F.linear(x, weight, bias)
        # Pad rows so the GEMM takes the same blocking path whatever the batch (see module doc). The padded rows
        # are cut off by a copy, not a slice: a slice is a view, and a view returned by an FSDP2-sharded decoder
        # layer (its MLP's down projection) makes torch warn that an in-place op on it could skip the layer's
        # all-gather in the backward, at every microbatch whose token count is not a multiple of ROW_MULTIPLE.
        # The copy is m x n elements beside an m x n x k GEMM, and gives the same bits.
        x = F.pad(x, (0, 0, 0, mp - m))
        return F.linear(x, weight, bias)[:m].clone()

    def packed_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
    ) -> tuple[torch.Tensor, ...]:
        return self.linear(x, weight, bias).split(list(sizes), dim=-1)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_torch(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + residual
        return self.rms_norm(s, weight, eps), s

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return rope_torch(x, positions, cos_sin)

    def rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        return self.rope(self.rms_norm(x, weight, eps), positions, cos_sin)

    def qk_norm_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        slot_mapping: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The composition the interface describes; nothing here is bound by launches.
        q = self.rms_norm_rope(q, q_weight, eps, positions, cos_sin)
        k = self.rms_norm_rope(k, k_weight, eps, positions, cos_sin)
        if kv_cache is not None:
            if slot_mapping is None:
                raise ValueError("qk_norm_rope with a KV cache needs slot_mapping (batch.slot_mapping)")
            write_kv_cache(k, v, kv_cache, slot_mapping)
        return q, k

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # Not F.silu: its CPU kernel rounds a tensor's tail differently from its body (elementwise_torch.py).
        return silu_mul_exact(gate, up)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return sigmoid_exact(x)

    def moe_route(
        self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return route_topk(logits, top_k, norm_topk_prob)

    def moe_experts(self, x, gate_up, down, weights, ids) -> torch.Tensor:
        # Per expert through this backend's invariant linear (exactrl/ops/moe_torch.py says why that suffices).
        return experts_exact(self.linear, self.silu_mul, x, gate_up, down, weights, ids)

    def attention(self, q, k, v, batch: AttentionBatch, kv_cache=None, *, kv_written=False) -> torch.Tensor:
        if kv_cache is None:
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return _PackedAttention.apply(q, k, v, batch)
            return attention_tiled(q, k, v, batch)
        k_flat, v_flat = (
            kv_cache_views(kv_cache) if kv_written else write_kv_cache(k, v, kv_cache, _slots(batch))
        )
        return attention_tiled(q, k_flat, v_flat, batch)

    def logprobs(self, hidden, weight, targets, temperature: float = 1.0, with_entropy: bool = False):
        _check_temperature(temperature)
        return _ChunkedLogprobs.apply(
            hidden, weight, targets, float(temperature), with_entropy, self.linear, LOGPROB_CHUNK_ROWS
        )

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        _check_temperature(temperature)
        return self.linear(hidden, weight).float() / float(temperature)

    def scale_logits(self, raw: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        _check_temperature(temperature)
        return raw.float() / float(temperature)

    def logprobs_from_logits(
        self, raw: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        # The same expression as one chunk of `logprobs`: the sampler's recorded logprob is the trainer's.
        z = self.scale_logits(raw, temperature)
        return torch.log_softmax(z, dim=-1).gather(1, targets[:, None])[:, 0]


class FastOps(ExactTorchOps):
    """PyTorch's default kernels: cuBLAS `F.linear` with no row padding, fused SDPA attention. Rows may change
    bits with the batch (the control the exact backends are measured against)."""

    name = "fast"
    exact = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul_torch(gate, up)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def moe_route(
        self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers' router: torch.topk (no promise about ties), the renormalising sum in torch's own order.
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def moe_experts(self, x, gate_up, down, weights, ids) -> torch.Tensor:
        return experts_fast(x, gate_up, down, weights, ids)

    def attention(self, q, k, v, batch: AttentionBatch, kv_cache=None, *, kv_written=False) -> torch.Tensor:
        if kv_cache is None:
            return attention_sdpa(q, k, v, batch)
        k_flat, v_flat = (
            kv_cache_views(kv_cache) if kv_written else write_kv_cache(k, v, kv_cache, _slots(batch))
        )
        return attention_sdpa(q, k_flat, v_flat, batch)
