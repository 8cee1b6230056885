"""Causal attention: ONE forward kernel for training (packed sequences), chunked prefill and decode (paged cache).

A program owns one tile of query rows of one sequence and one KV head; the rows are (query, q-head) pairs, so
the G = Hq / Hkv query heads that share a KV head share its K/V loads (GQA; a decode step fills G rows).
Keys are read through `AttentionBatch.key_slots[seq, n]`: a slot into a flat key store, which is the packed
k/v of the call in training and the flattened paged cache `[num_blocks * block_size, Hkv, Dh]` in rollout.
The kernel cannot tell the two apart, so the arithmetic is the same.

Why a query row's output is the same bits in every batch, chunking and storage:
- Keys are visited from absolute position 0 in tiles of ATTN_BLOCK_N positions ([0, 64), [64, 128), ...),
  whatever the batch. A tile's keys are gathered slot by slot, so a tile may straddle KV pages: the page size
  needs no relation to ATTN_BLOCK_N (AttentionBatch still asks for a multiple of 16).
- Scores are `tl.dot(q_tile, k_tile^T)`: each row's scores come from its own q row alone. The online softmax
  (running max m, sum l, accumulator acc, all fp32) is row-wise elementwise/row-reduction arithmetic.
- A program walks as many tiles as its *latest* query needs. For an earlier query of the same tile the extra
  tiles are fully masked, and a fully masked tile is an exact no-op: max(m, -inf) = m, exp2(m - m) = 1,
  exp2(-inf) = 0, so l * 1 + 0 = l and acc * 1 + dot(0, V) = acc, bit for bit (V is finite: keys past the
  sequence are loaded as zeros). Hence decode (1 query), a prefill chunk and a packed training row agree.
- No split-KV: one program reduces all of a query's keys in order. Padding rows of a tile are never stored.
- The rows of a tile do not depend on the call's size (decode pads a tile of ROWS rows; it never switches
  kernels), and the number of rows/sequences is excluded from Triton's integer specialisation.

Backward (training only), FlashAttention-2 style and deterministic: one program per (sequence, key tile, KV
head) owns dK/dV of its keys and loops over the queries that see them (the G q-heads of the KV head are rows
of the same tile, so their sum is inside the MMA, in a fixed order; no atomics); dQ is a separate pass over
query tiles. Neither needs batch invariance, only determinism.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from exactrl.ops.batch import AttentionBatch
from exactrl.ops.torch_ops import write_kv_cache  # one cache write for every backend
from exactrl.ops.triton.common import mma, next_pow2

# Key tile of the forward kernel, in positions. The engine's KV page size does not need to be a multiple of it
# (keys are gathered through key_slots), but it is the unit of the "fully masked tile is a no-op" argument.
ATTN_BLOCK_N = 64
# Query tile: ROWS (query, q-head) rows per program. Fixed, so decode pads to it rather than switching kernels.
ATTN_ROWS = 64
_LOG2E = 1.4426950408889634

# (num_warps, num_stages) per dtype for the forward (the invariant kernel). bf16 on an H200 (triton 3.6):
# 3 stages was the fastest of the tried (rows, block_n, warps, stages) for training and decode.
_FWD_LAUNCH = {torch.bfloat16: (4, 3), torch.float16: (4, 3), torch.float32: (8, 1)}
# Backward tiles (rows, key block, num_warps, num_stages): free to differ from the forward, since the backward
# only has to be deterministic. fp32 runs on FMAs (no TF32) and gets smaller tiles to fit shared memory.
_BWD_LAUNCH = {
    torch.bfloat16: (128, 64, 8, 2),  # fastest tried on an H200: 1.97 ms vs 3.04 ms for (64, 64, 8, 2)
    torch.float16: (128, 64, 8, 2),
    torch.float32: (32, 32, 8, 1),
}


@triton.jit(do_not_specialize=["tiles_per_seq"])
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, q_pos_ptr, key_lens_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse,
    stride_slots, tiles_per_seq, head_dim, qk_scale,
    G: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = pid // tiles_per_seq
    tile = tiles_per_seq - 1 - pid % tiles_per_seq  # late (long) query tiles start first
    row_begin = tl.load(cu_q_ptr + b)
    row_end = tl.load(cu_q_ptr + b + 1)
    first = row_begin + tile * P
    if first >= row_end:
        return
    r = tl.arange(0, ROWS)
    qi = r // G
    hq = kvh * G + r % G
    row = first + qi
    row_ok = (qi < P) & (row < row_end)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    pos = tl.load(q_pos_ptr + row, mask=row_ok, other=0)
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    key_len = tl.load(key_lens_ptr + b)
    n_tiles = tl.max(pos, axis=0) // BLOCK_N + 1
    slot_base = slots_ptr + b * stride_slots
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for j in range(0, n_tiles):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < key_len
        slot = tl.load(slot_base + n, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32)) * qk_scale
        s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Exactly 1 when the running max did not move (always so in a tile fully masked for this row), without
        # relying on the hardware exp2 being exact at 0.
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        p = tl.exp2(s - m_new[:, None])  # 0 exactly at masked keys
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = mma(p.to(v.dtype), v, acc)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + row[:, None] * stride_ot + hq[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    # log2-domain log-sum-exp of the scaled scores, for the backward (stored on every call: one kernel binary).
    tl.store(lse_ptr + row * stride_lse + hq, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit(do_not_specialize=["kv_tiles_per_seq"])
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, q_pos_ptr, key_lens_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse, stride_slots,
    kv_tiles_per_seq, head_dim, qk_scale, sm_scale,
    G: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = pid // kv_tiles_per_seq
    n0 = (pid % kv_tiles_per_seq) * BLOCK_N
    key_len = tl.load(key_lens_ptr + b)
    if n0 >= key_len:
        return
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < key_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    kv_mask = n_ok[:, None] & d_ok[None, :]
    slot = tl.load(slots_ptr + b * stride_slots + n, mask=n_ok, other=0)
    k = tl.load(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    row_begin = tl.load(cu_q_ptr + b)
    nq = tl.load(cu_q_ptr + b + 1) - row_begin
    pos0 = tl.load(q_pos_ptr + row_begin)
    # Query positions of a sequence are consecutive, so queries before index n0 - pos0 cannot see these keys.
    i_start = tl.maximum(n0 - pos0, 0)
    r = tl.arange(0, ROWS)
    qr = r // G
    hq = kvh * G + r % G
    for i0 in range(i_start, nq, P):
        qi = i0 + qr
        row = row_begin + qi
        row_ok = (qr < P) & (qi < nq)
        mask = row_ok[:, None] & d_ok[None, :]
        pos = tl.load(q_pos_ptr + row, mask=row_ok, other=0)
        q = tl.load(
            q_ptr + row[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :], mask=mask, other=0.0
        )
        do = tl.load(
            do_ptr + row[:, None] * stride_dot + hq[:, None] * stride_doh + d[None, :], mask=mask, other=0.0
        )
        lse = tl.load(lse_ptr + row * stride_lse + hq, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + row * stride_lse + hq, mask=row_ok, other=0.0)
        s = mma(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32)) * qk_scale
        valid = row_ok[:, None] & (n[None, :] <= pos[:, None])
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dv = mma(tl.trans(p.to(do.dtype)), do, dv)
        dp = mma(do, tl.trans(v), tl.zeros([ROWS, BLOCK_N], tl.float32))
        ds = p * (dp - delta[:, None])
        dk = mma(tl.trans(ds.to(q.dtype)), q, dk)
    dk = dk * sm_scale
    tl.store(
        dk_ptr + slot[:, None] * stride_dkt + kvh * stride_dkh + d[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        dv_ptr + slot[:, None] * stride_dvt + kvh * stride_dvh + d[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit(do_not_specialize=["tiles_per_seq"])
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, q_pos_ptr, key_lens_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse, stride_slots, tiles_per_seq, head_dim, qk_scale, sm_scale,
    G: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = pid // tiles_per_seq
    tile = tiles_per_seq - 1 - pid % tiles_per_seq
    row_begin = tl.load(cu_q_ptr + b)
    row_end = tl.load(cu_q_ptr + b + 1)
    first = row_begin + tile * P
    if first >= row_end:
        return
    r = tl.arange(0, ROWS)
    qi = r // G
    hq = kvh * G + r % G
    row = first + qi
    row_ok = (qi < P) & (row < row_end)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    mask = row_ok[:, None] & d_ok[None, :]
    pos = tl.load(q_pos_ptr + row, mask=row_ok, other=0)
    q = tl.load(q_ptr + row[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :], mask=mask, other=0.0)
    do = tl.load(
        do_ptr + row[:, None] * stride_dot + hq[:, None] * stride_doh + d[None, :], mask=mask, other=0.0
    )
    lse = tl.load(lse_ptr + row * stride_lse + hq, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + row * stride_lse + hq, mask=row_ok, other=0.0)
    key_len = tl.load(key_lens_ptr + b)
    n_tiles = tl.max(pos, axis=0) // BLOCK_N + 1
    slot_base = slots_ptr + b * stride_slots
    dq = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for j in range(0, n_tiles):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < key_len
        slot = tl.load(slot_base + n, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32)) * qk_scale
        valid = row_ok[:, None] & (n[None, :] <= pos[:, None])
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dp = mma(do, tl.trans(v), tl.zeros([ROWS, BLOCK_N], tl.float32))
        ds = p * (dp - delta[:, None])
        dq = mma(ds.to(k.dtype), k, dq)
    dq = dq * sm_scale
    tl.store(
        dq_ptr + row[:, None] * stride_dqt + hq[:, None] * stride_dqh + d[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=mask,
    )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _geometry(q: torch.Tensor, k_store: torch.Tensor) -> tuple[int, int, int, int]:
    T, hq, dh = q.shape
    hkv = k_store.shape[1]
    if hq % hkv or k_store.shape[2] != dh:
        raise ValueError(f"attention needs Hq a multiple of Hkv and equal head dims, got q {tuple(q.shape)}, "
                         f"k {tuple(k_store.shape)}")  # fmt: skip
    g = hq // hkv
    if g > ATTN_ROWS:
        raise ValueError(
            f"GQA group of {g} query heads per KV head is larger than the query tile ({ATTN_ROWS})"
        )
    return hq, hkv, g, max(16, next_pow2(dh))


def attention_fwd(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    batch: AttentionBatch,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, Dh]; k_store/v_store: [S, Hkv, Dh] indexed by batch.key_slots -> (out [T, Hq, Dh] in q.dtype,
    lse [T, Hq] fp32, log2 domain).

    `config` (rows, block_n, num_warps, num_stages) is for benchmarks only: the exact ops always use the fixed
    (ATTN_ROWS, ATTN_BLOCK_N, _FWD_LAUNCH[dtype])."""
    q, k_store, v_store = (_last_dim_contiguous(t) for t in (q, k_store, v_store))
    hq, hkv, g, block_d = _geometry(q, k_store)
    T, _, dh = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((T, hq), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    rows, block_n, warps, stages = config or (ATTN_ROWS, ATTN_BLOCK_N, *_FWD_LAUNCH[q.dtype])
    p = rows // g
    tiles_per_seq = triton.cdiv(batch.max_seqlen_q, p)
    sm_scale = 1.0 / math.sqrt(dh)
    slots = batch.key_slots
    grid = (batch.num_seqs * tiles_per_seq, hkv)
    _attn_fwd_kernel[grid](
        q, k_store, v_store, out, lse, batch.cu_seqlens_q, batch.q_pos, batch.key_lens, slots,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), slots.stride(0), tiles_per_seq, dh, sm_scale * _LOG2E,
        G=g, P=p, ROWS=rows, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse


def attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    batch: AttentionBatch,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention_fwd for packed sequences (keys indexed by key_slots into k/v). Deterministic.

    `config` (rows, block_n, num_warps, num_stages) overrides _BWD_LAUNCH[dtype] (benchmarks)."""
    q, k, v, grad_out = (_last_dim_contiguous(t) for t in (q, k, v, grad_out))
    hq, hkv, g, block_d = _geometry(q, k)
    T, _, dh = q.shape
    # delta_i = rowsum(dO_i * O_i): a row-wise torch reduction, deterministic.
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if T == 0:
        return dq, dk, dv
    rows, block_n, warps, stages = config or _BWD_LAUNCH[q.dtype]
    rows = max(rows, next_pow2(g))
    p = rows // g
    sm_scale = 1.0 / math.sqrt(dh)
    slots = batch.key_slots
    kv_tiles = triton.cdiv(batch.max_key_len, block_n)
    _attn_bwd_dkdv_kernel[(batch.num_seqs * kv_tiles, hkv)](
        q, k, v, grad_out, lse, delta, dk, dv, batch.cu_seqlens_q, batch.q_pos, batch.key_lens, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0), slots.stride(0), kv_tiles, dh, sm_scale * _LOG2E, sm_scale,
        G=g, P=p, ROWS=rows, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    tiles_per_seq = triton.cdiv(batch.max_seqlen_q, p)
    _attn_bwd_dq_kernel[(batch.num_seqs * tiles_per_seq, hkv)](
        q, k, v, grad_out, lse, delta, dq, batch.cu_seqlens_q, batch.q_pos, batch.key_lens, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1), lse.stride(0), slots.stride(0),
        tiles_per_seq, dh, sm_scale * _LOG2E, sm_scale,
        G=g, P=p, ROWS=rows, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, batch):  # type: ignore[override]
        out, lse = attention_fwd(q, k, v, batch)
        ctx.batch = batch
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_bwd(grad_out, q, k, v, out, lse, ctx.batch)
        return dq, dk, dv, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention, q: [T, Hq, Dh], k/v: [T, Hkv, Dh] -> [T, Hq, Dh]; differentiable when kv_cache is None."""
    if kv_cache is None:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _PackedAttention.apply(q, k, v, batch)
        return attention_fwd(q, k, v, batch)[0]
    if batch.slot_mapping is None:
        raise ValueError(
            "attention with a KV cache needs batch.slot_mapping (build it with AttentionBatch.paged)"
        )
    k_flat, v_flat = write_kv_cache(k, v, kv_cache, batch.slot_mapping)
    return attention_fwd(q, k_flat, v_flat, batch)[0]
