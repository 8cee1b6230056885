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
  (running max m, sum l, accumulator acc, all fp32) is row-wise elementwise arithmetic, a max (exact in any
  order) and MMAs (the row sum of p is one, against a column of ones): no reduction whose order follows the
  tile's layout, so the query tile's rows and warps never change a row's bits. Training and prefill use a 64-row
  tile; a decode step, whose tile holds G real rows, a 16-row one (`_fwd_config`).
- A program walks as many tiles as its *latest* query needs. For an earlier query of the same tile the extra
  tiles are fully masked, and a fully masked tile is an exact no-op: max(m, -inf) = m, exp2(m - m) = 1,
  exp2(-inf) = 0, so l * 1 + 0 = l and acc * 1 + dot(0, V) = acc, bit for bit (V is finite: keys past the
  sequence are loaded as zeros). Hence decode (1 query), a prefill chunk and a packed training row agree.
- Keys are reduced in fixed chunks of ATTN_SPLIT_KEYS positions, folded into the total in chunk order (`_fold`).
  A program of training or prefill walks every chunk and folds in registers; a decode step of few sequences
  splits the chunks over programs (split-KV) and a combine kernel folds their partials in the same order with the
  same `_fold`. A fixed split size and merge order, never a split count chosen by the batch: a row's arithmetic
  is the same in every path. Padding rows of a tile are never stored.
- The rows of a tile do not depend on the call's size (a step pads its tile; it never switches kernels), and the
  number of rows/sequences is excluded from Triton's integer specialisation.

Backward (training only): deterministic, not batch invariant, FlashAttention-2 style in three launches:
1. delta = rowsum(dO * O) in fp32 per (token, q-head), read from the stored dtype (_attn_bwd_delta_kernel).
2. dK, dV: one program per (sequence, key tile, KV head) keeps its K, V tile and loops over the query tiles
   that see it; the G q-heads of the KV head are rows of each tile, so their sum happens inside the MMA in a
   fixed order (no atomics). Query tiles that straddle the key tile's diagonal apply the causal mask; the later,
   full ones (every key visible) load and compute without any mask; the sequence's last, partial tile masks
   rows only. Keys-major tiles (scores as [keys, rows], chosen when block_n >= 16 * num_warps, and in fp32)
   feed p^T and ds^T to the dV and dK MMAs straight from registers; rows-major tiles (where a [keys, rows] MMA
   would leave warps idle) compute [rows, keys] and transpose p and ds through shared memory.
3. dQ: one program per (sequence, query tile, KV head) walks key tiles from 0: those wholly below the tile's
   first query without masks, those reaching its diagonal with the mask.
Both recompute p = exp2(scaled score - lse) from the forward's lse, rely on a sequence's queries having
consecutive positions (as AttentionBatch builds them), and have their own tile (_BWD_LAUNCH).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from exactrl.ops.batch import AttentionBatch
from exactrl.ops.torch_ops import kv_cache_views
from exactrl.ops.triton.common import mma, next_pow2, num_programs_cap, pdl, pdl_wait
from exactrl.ops.triton.kv_write import write_kv_cache  # K and V into the paged cache in one launch

# Key tile of the forward kernel, in positions. The engine's KV page size does not need to be a multiple of it
# (keys are gathered through key_slots), but it is the unit of the "fully masked tile is a no-op" argument.
ATTN_BLOCK_N = 64
# Keys are reduced in chunks of ATTN_SPLIT_KEYS positions ([0, 64), [64, 128), ...): each chunk's tiles go into
# an online softmax of their own, from scratch, and the chunks' results are folded into the total in order. The
# chunk boundaries are fixed positions, like the tiles', so a decode step may compute the chunks in separate
# programs (split-KV) and fold them afterwards in a second kernel with the same arithmetic: the same bits as one
# program walking every chunk, and as training. A multiple of ATTN_BLOCK_N. One key tile a chunk: on an H200
# (2026-11-26, qwen3-0.6b heads, benchmarks/probe_decode_attn.py --split) one sequence's decode attention over
# 128-384 keys took 6.7 us split this way against 9.9 with 256-key chunks, and the training forward over 8 x 1,024
# tokens 204 us against 216 (a chunk of one tile starts its softmax from scratch: no rescale within it).
ATTN_SPLIT_KEYS = 64
# Query tile: ROWS (query, q-head) rows per program for training and prefill. A decode step (one query per sequence,
# G real rows) takes DECODE_LAUNCH's 16-row tile instead: the same kernel and arithmetic, fewer padding rows.
ATTN_ROWS = 64
# (rows, num_warps, num_stages) of a decode step's tile, 16-bit (GQA groups of at most 16). H200, 2026-11-26,
# qwen3-0.6b heads (benchmarks/probe_decode_attn.py, every tile equal to the 64-row tile's bits): 256 sequences of
# 128-384 keys 87.8 us against 146.7 for the 64-row tile, 64 sequences 27.3 against 43.1, one sequence 9.8 / 9.4.
DECODE_LAUNCH = (16, 2, 2)
_LOG2E = 1.4426950408889634

# (num_warps, num_stages) per dtype for the forward (the invariant kernel). bf16 on an H200 (triton 3.6):
# 3 stages was the fastest of the tried (rows, block_n, warps, stages) for training and decode.
_FWD_LAUNCH = {torch.bfloat16: (4, 3), torch.float16: (4, 3), torch.float32: (8, 1)}


class AttnBwdConfig(NamedTuple):
    """Backward launch: (rows, block_n, num_warps, num_stages) of the dK/dV kernel and of the dQ kernel. rows:
    (query, q-head) rows of a query tile (raised to the GQA group if smaller); block_n: positions of a key tile.
    The dK/dV kernel works keys-major when block_n >= 16 * num_warps (and in fp32), rows-major otherwise."""

    dkdv: tuple[int, int, int, int]
    dq: tuple[int, int, int, int]


# Backward tiles: free to differ from the forward's and from each other (the backward only has to be
# deterministic); benchmarks/bench_kernels.py --only-attention-configs sweeps each kernel's. fp32 runs on FMAs
# (no TF32) and gets smaller tiles to fit shared memory.
_BWD_LAUNCH = {
    # The fastest pair of `bench_kernels.py --only-attention-configs` on an H200 (8 x 2048, Hq 16, Hkv 8, Dh 128):
    # 1.35 ms vs 1.54 ms for (128, 64, 8, 2) in both kernels; every tried tile gave the same gradient bits.
    torch.bfloat16: AttnBwdConfig(dkdv=(32, 64, 4, 2), dq=(128, 128, 8, 2)),
    torch.float16: AttnBwdConfig(dkdv=(32, 64, 4, 2), dq=(128, 128, 8, 2)),
    torch.float32: AttnBwdConfig(dkdv=(32, 32, 8, 1), dq=(32, 32, 8, 1)),
}


@triton.jit
def _load_kv_tile(
    k_base, v_base, slot_ptr, n, key_len, d, d_ok, stride_kt, stride_vt,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    # The K and V rows of key positions n (one tile), gathered through the slot table; k_base, v_base point at
    # the KV head. MASKED: positions past key_len load as 0. Otherwise every position of the tile exists and the
    # loads drop the masks (a load with a true mask is the load), keeping only the head-dim mask when Dh is padded.
    if MASKED:
        n_ok = n < key_len
        slot = tl.load(slot_ptr + n, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * stride_kt + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vt + d[None, :], mask=kv_mask, other=0.0)
    else:
        slot = tl.load(slot_ptr + n)
        if EVEN_D:
            k = tl.load(k_base + slot[:, None] * stride_kt + d[None, :])
            v = tl.load(v_base + slot[:, None] * stride_vt + d[None, :])
        else:
            k = tl.load(k_base + slot[:, None] * stride_kt + d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_base + slot[:, None] * stride_vt + d[None, :], mask=d_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _fwd_tile(
    j, q, m_i, l_i, acc, k_base, v_base, slot_base, key_len, pos, d, d_ok, stride_kt, stride_vt, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    # One key tile [j * BLOCK_N, (j + 1) * BLOCK_N) into the online softmax. MASKED=False only for tiles whose
    # every key exists and is visible to every stored row: their loads drop the masks. The causal `where` stays
    # in both: it also keeps the compiler from contracting the scale multiply into the `s - m` of exp2 (an FMA,
    # other bits) in one path and not the other.
    n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    k, v = _load_kv_tile(
        k_base, v_base, slot_base, n, key_len, d, d_ok, stride_kt, stride_vt, MASKED=MASKED, EVEN_D=EVEN_D
    )
    s = mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32)) * qk_scale
    s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Exactly 1 when the running max did not move (always so in a tile fully masked for this row), without
    # relying on the hardware exp2 being exact at 0.
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
    p = tl.exp2(s - m_new[:, None])  # 0 exactly at masked keys
    # The row sum of p as an MMA against a column of ones (16 equal columns; max picks one exactly), from the
    # p that the PV MMA below reads. A `tl.sum` along the tile would add a row's columns in an order that follows
    # the register layout, hence the tile's rows and warps: a decode step's 16-row tile and training's 64-row
    # tile gave some rows other bits (benchmarks/probe_decode_attn.py). An MMA chain is per element, the same
    # bits for every tile (as the GEMM tiles found), so the query tile is free to differ between the paths.
    pv = p.to(v.dtype)
    ones = tl.full([BLOCK_N, 16], 1.0, v.dtype)
    l_i = l_i * alpha + tl.max(mma(pv, ones, tl.zeros([q.shape[0], 16], tl.float32)), axis=1)
    acc = acc * alpha[:, None]
    acc = mma(pv, v, acc)
    return m_new, l_i, acc


@triton.jit
def _fold(m_t, l_t, acc_t, m_c, l_c, acc_c):
    # The running total (m_t, l_t, acc_t) with one chunk's own online-softmax result (m_c, l_c, acc_c) folded in.
    # Every operation is elementwise per row (no reduction, explicit FMAs), so the training kernel, which folds in
    # registers, and the split decode's combine kernel, which folds partials read from memory, get the same bits.
    # A chunk with no visible key for a row (l_c == 0) leaves that row's total as it was, bit for bit; the first
    # chunk folded into the empty total is that chunk exactly (a = 0, b = 1).
    m_new = tl.maximum(m_t, m_c)
    a = tl.where(m_new == m_t, 1.0, tl.exp2(m_t - m_new))
    b = tl.where(m_new == m_c, 1.0, tl.exp2(m_c - m_new))
    l_new = tl.fma(l_c, b, l_t * a)
    acc_new = tl.fma(acc_c, b[:, None], acc_t * a[:, None])
    seen = l_c > 0
    return tl.where(seen, m_new, m_t), tl.where(seen, l_new, l_t), tl.where(seen[:, None], acc_new, acc_t)


@triton.jit
def _chunk_edge(j, m_t, l_t, acc_t, m_i, l_i, acc, CHUNK_TILES: tl.constexpr):
    # After key tile j: when it is its chunk's last, fold the chunk into the total and start the next one empty.
    if (j + 1) % CHUNK_TILES == 0:
        m_t, l_t, acc_t = _fold(m_t, l_t, acc_t, m_i, l_i, acc)
        m_i = tl.full(m_i.shape, float("-inf"), tl.float32)
        l_i = tl.zeros(l_i.shape, tl.float32)
        acc = tl.zeros(acc.shape, tl.float32)
    return m_t, l_t, acc_t, m_i, l_i, acc


@triton.jit(do_not_specialize=["tiles_per_seq"])
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, q_pos_ptr, key_lens_ptr, slots_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse,
    stride_slots, tiles_per_seq, head_dim, qk_scale, max_chunks,
    G: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, CHUNK_TILES: tl.constexpr, PARTIAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # PARTIAL (split decode, one query per sequence): program_id(2) computes one chunk of keys and stores its
    # (m, l, acc) for the combine kernel; otherwise a program walks every chunk and folds each into the total.
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
    # Tiles wholly at or before the earliest stored query's position (and within the keys) are visible in full to
    # every stored row: no masks there. The rest are masked. Padding rows (never stored) load position 0 and see
    # those tiles too; their results are discarded.
    first_pos = tl.min(tl.where(row_ok, pos, 2147483647), axis=0)
    n_full = tl.minimum(first_pos + 1, key_len) // BLOCK_N
    slot_base = slots_ptr + b * stride_slots
    j_lo = 0
    j_hi = n_tiles
    if PARTIAL:
        j_lo = tl.program_id(2) * CHUNK_TILES
        if j_lo >= n_tiles:  # past this sequence's keys: the combine kernel reads no partial from here
            return
        j_hi = tl.minimum(j_lo + CHUNK_TILES, n_tiles)
    m_t = tl.full([ROWS], float("-inf"), tl.float32)
    l_t = tl.zeros([ROWS], tl.float32)
    acc_t = tl.zeros([ROWS, BLOCK_D], tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for j in range(j_lo, tl.minimum(n_full, j_hi)):
        m_i, l_i, acc = _fwd_tile(
            j, q, m_i, l_i, acc, k_base, v_base, slot_base, key_len, pos, d, d_ok, stride_kt, stride_vt,
            qk_scale, BLOCK_N=BLOCK_N, MASKED=False, EVEN_D=EVEN_D,
        )  # fmt: skip
        if not PARTIAL:
            m_t, l_t, acc_t, m_i, l_i, acc = _chunk_edge(j, m_t, l_t, acc_t, m_i, l_i, acc, CHUNK_TILES)
    for j in range(tl.maximum(n_full, j_lo), j_hi):
        m_i, l_i, acc = _fwd_tile(
            j, q, m_i, l_i, acc, k_base, v_base, slot_base, key_len, pos, d, d_ok, stride_kt, stride_vt,
            qk_scale, BLOCK_N=BLOCK_N, MASKED=True, EVEN_D=EVEN_D,
        )  # fmt: skip
        if not PARTIAL:
            m_t, l_t, acc_t, m_i, l_i, acc = _chunk_edge(j, m_t, l_t, acc_t, m_i, l_i, acc, CHUNK_TILES)
    if PARTIAL:
        # The decode rows (query 0 of the tile, its G heads) of this chunk, at [sequence, KV head, chunk, head].
        part = ((b * tl.num_programs(1) + kvh) * max_chunks + tl.program_id(2)) * G + r
        keep = r < G
        tl.store(part_m_ptr + part, m_i, mask=keep)
        tl.store(part_l_ptr + part, l_i, mask=keep)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=keep[:, None])
        return
    # The last chunk, when it ended before its boundary (after a boundary fold l_i is 0: a no-op).
    m_t, l_t, acc_t = _fold(m_t, l_t, acc_t, m_i, l_i, acc)
    out = acc_t / l_t[:, None]
    tl.store(
        out_ptr + row[:, None] * stride_ot + hq[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    # log2-domain log-sum-exp of the scaled scores, for the backward (stored on every call: one kernel binary).
    tl.store(lse_ptr + row * stride_lse + hq, m_t + tl.log2(l_t), mask=row_ok)


@triton.jit
def _attn_combine_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, lse_ptr, cu_q_ptr, q_pos_ptr,
    stride_ot, stride_oh, stride_lse, max_chunks, head_dim,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_TILES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # Split decode, second kernel: one program per (sequence, KV head) folds the chunks' partials in order,
    # with the training kernel's _fold and its last two lines (out = acc / l, lse).
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(cu_q_ptr + b)
    if row >= tl.load(cu_q_ptr + b + 1):  # a sequence without a query (a bucket's padding): nothing to fold
        return
    pos = tl.load(q_pos_ptr + row)
    # At most the chunks the first kernel had programs for (a position is always inside the slot table's width).
    n_chunks = tl.minimum((pos // BLOCK_N) // CHUNK_TILES + 1, max_chunks)
    r = tl.arange(0, GP)
    keep = r < G
    d = tl.arange(0, BLOCK_D)
    m_t = tl.full([GP], float("-inf"), tl.float32)
    l_t = tl.zeros([GP], tl.float32)
    acc_t = tl.zeros([GP, BLOCK_D], tl.float32)
    base = (b * tl.num_programs(1) + kvh) * max_chunks
    for c in range(0, n_chunks):
        part = (base + c) * G + r
        m_c = tl.load(part_m_ptr + part, mask=keep, other=float("-inf"))
        l_c = tl.load(part_l_ptr + part, mask=keep, other=0.0)
        acc_c = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=keep[:, None], other=0.0)
        m_t, l_t, acc_t = _fold(m_t, l_t, acc_t, m_c, l_c, acc_c)
    out = acc_t / l_t[:, None]
    hq = kvh * G + r
    tl.store(
        out_ptr + row * stride_ot + hq[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=keep[:, None] & (d < head_dim)[None, :],
    )
    tl.store(lse_ptr + row * stride_lse + hq, m_t + tl.log2(l_t), mask=keep)


@triton.jit
def _attn_bwd_delta_kernel(
    do_ptr, o_ptr, delta_ptr, n_rows, num_heads, stride_dot, stride_doh, stride_ot, stride_oh, head_dim,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # delta[t, h] = sum over d of dO[t, h, d] * O[t, h, d], in fp32 from the stored dtype: one tl.sum per row.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    t = (r // num_heads).to(tl.int64)
    h = r % num_heads
    d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (d < head_dim)[None, :]
    do_ptrs = do_ptr + t[:, None] * stride_dot + h[:, None] * stride_doh + d[None, :]
    o_ptrs = o_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :]
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + r, tl.sum(do * o, axis=1), mask=r_ok)


@triton.jit
def _dkdv_step(
    dk, dv, k_op, v_op, q_ptr, do_ptr, lse_ptr, delta_ptr, q_offs, do_offs, row_offs,
    row, i0, nq, n, pos0, qr, d_ok, stride_qt, stride_dot, stride_lse, qk_scale,
    P: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, KEYS_MAJOR: tl.constexpr,
):  # fmt: skip
    # Queries i0 .. i0 + P - 1 of the sequence (G heads each; `row` is the packed row of its query 0) into dK, dV.
    # k_op, v_op: this key tile's K, V ([keys, dims]) when KEYS_MAJOR, else K^T, V^T ([dims, keys]).
    q_ptrs = q_ptr + (row + i0) * stride_qt + q_offs
    do_ptrs = do_ptr + (row + i0) * stride_dot + do_offs
    lse_ptrs = lse_ptr + (row + i0) * stride_lse + row_offs
    delta_ptrs = delta_ptr + (row + i0) * stride_lse + row_offs
    if MASKED:
        # Rows past the tile or the sequence, and dims past head_dim, load as 0 and their lse as +inf: p = 0.
        row_ok = (qr < P) & (i0 + qr < nq)
        mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptrs, mask=mask, other=0.0)
        do = tl.load(do_ptrs, mask=mask, other=0.0)
        lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
    else:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    pos = pos0 + i0 + qr
    if KEYS_MAJOR:  # [keys, rows] scores: p^T and ds^T are the register operands of their MMAs as computed
        zero = tl.zeros([k_op.shape[0], q.shape[0]], tl.float32)
        p_t = tl.exp2(mma(k_op, tl.trans(q), zero) * qk_scale - lse[None, :])
        if CAUSAL:  # this query tile straddles the key tile's diagonal
            p_t = tl.where(n[:, None] <= pos[None, :], p_t, 0.0)
        dv = mma(p_t.to(do.dtype), do, dv)
        ds_t = p_t * (mma(v_op, tl.trans(do), zero) - delta[None, :])
        dk = mma(ds_t.to(q.dtype), q, dk)
    else:  # [rows, keys] scores: p and ds are transposed (through shared memory) for the dV and dK MMAs
        zero = tl.zeros([q.shape[0], k_op.shape[1]], tl.float32)
        p = tl.exp2(mma(q, k_op, zero) * qk_scale - lse[:, None])
        if CAUSAL:
            p = tl.where(n[None, :] <= pos[:, None], p, 0.0)
        dv = mma(tl.trans(p.to(do.dtype)), do, dv)
        ds = p * (mma(do, v_op, zero) - delta[:, None])
        dk = mma(tl.trans(ds.to(q.dtype)), q, dk)
    return dk, dv


@triton.jit(do_not_specialize=["kv_tiles_per_seq"])
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, q_pos_ptr, key_lens_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse, stride_slots,
    kv_tiles_per_seq, head_dim, qk_scale, sm_scale,
    G: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN: tl.constexpr, KEYS_MAJOR: tl.constexpr, STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = pid // kv_tiles_per_seq
    n0 = (pid % kv_tiles_per_seq) * BLOCK_N  # early (long) key tiles start first
    key_len = tl.load(key_lens_ptr + b).to(tl.int32)
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
    if not KEYS_MAJOR:  # transposed once here, so that K^T, V^T are put in shared memory once, not per tile
        k = tl.trans(k)
        v = tl.trans(v)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    row_begin = tl.load(cu_q_ptr + b)
    nq = (tl.load(cu_q_ptr + b + 1) - row_begin).to(tl.int32)
    pos0 = tl.load(q_pos_ptr + row_begin).to(tl.int32)  # the sequence's queries sit at pos0, pos0 + 1, ...
    r = tl.arange(0, ROWS)
    qr = r // G
    hq = kvh * G + r % G
    # In-tile offsets (int32); the tile's first packed row enters once per tile as a scalar.
    q_offs = qr[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :]
    do_offs = qr[:, None] * stride_dot + hq[:, None] * stride_doh + d[None, :]
    row_offs = qr * stride_lse + hq
    # Queries before i_start see none of these keys; from i_full on they see all of them. Tiles of P queries from
    # i_start: the first ones straddle the diagonal (masked), then full tiles without any mask, then the
    # sequence's last, partial tile (row mask only).
    i_start = tl.maximum(n0 - pos0, 0)
    i_full = n0 + BLOCK_N - 1 - pos0
    i_mid = i_start + (tl.maximum(i_full - i_start, 0) + P - 1) // P * P
    i_tail = i_mid + tl.maximum(nq - i_mid, 0) // P * P
    for i0 in range(i_start, tl.minimum(i_mid, nq), P):
        dk, dv = _dkdv_step(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, q_offs, do_offs, row_offs,
            row_begin, i0, nq, n, pos0, qr, d_ok, stride_qt, stride_dot, stride_lse, qk_scale,
            P=P, CAUSAL=True, MASKED=True, KEYS_MAJOR=KEYS_MAJOR,
        )  # fmt: skip
    for i0 in tl.range(i_mid, i_tail, P, num_stages=STAGES):
        dk, dv = _dkdv_step(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, q_offs, do_offs, row_offs,
            row_begin, i0, nq, n, pos0, qr, d_ok, stride_qt, stride_dot, stride_lse, qk_scale,
            P=P, CAUSAL=False, MASKED=not EVEN, KEYS_MAJOR=KEYS_MAJOR,
        )  # fmt: skip
    for i0 in range(i_tail, nq, P):  # at most one tile
        dk, dv = _dkdv_step(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, q_offs, do_offs, row_offs,
            row_begin, i0, nq, n, pos0, qr, d_ok, stride_qt, stride_dot, stride_lse, qk_scale,
            P=P, CAUSAL=False, MASKED=True, KEYS_MAJOR=KEYS_MAJOR,
        )  # fmt: skip
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


@triton.jit
def _dq_step(
    dq, q, do, lse, delta, k_ptr, v_ptr, slot_ptr, j, key_len, pos, d, d_ok, stride_kt, stride_vt, qk_scale,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    # Key tile j into dQ of this query tile. CAUSAL: the tile is at the diagonal (mask n <= pos; keys past the
    # sequence load as 0). Otherwise every key of the tile is visible to every query of the tile.
    n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    k, v = _load_kv_tile(
        k_ptr, v_ptr, slot_ptr, n, key_len, d, d_ok, stride_kt, stride_vt, MASKED=CAUSAL, EVEN_D=EVEN_D
    )
    zero = tl.zeros([q.shape[0], BLOCK_N], tl.float32)
    p = tl.exp2(mma(q, tl.trans(k), zero) * qk_scale - lse[:, None])
    if CAUSAL:
        p = tl.where(n[None, :] <= pos[:, None], p, 0.0)
    ds = p * (mma(do, tl.trans(v), zero) - delta[:, None])
    return mma(ds.to(k.dtype), k, dq)


@triton.jit(do_not_specialize=["tiles_per_seq"])
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, q_pos_ptr, key_lens_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse, stride_slots, tiles_per_seq, head_dim, qk_scale, sm_scale,
    G: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = pid // tiles_per_seq
    i0 = (tiles_per_seq - 1 - pid % tiles_per_seq) * P  # late (long) query tiles start first
    row_begin = tl.load(cu_q_ptr + b)
    nq = (tl.load(cu_q_ptr + b + 1) - row_begin).to(tl.int32)
    if i0 >= nq:
        return
    pos0 = tl.load(q_pos_ptr + row_begin).to(tl.int32)  # the sequence's queries sit at pos0, pos0 + 1, ...
    r = tl.arange(0, ROWS)
    qr = r // G
    hq = kvh * G + r % G
    row_ok = (qr < P) & (i0 + qr < nq)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    mask = row_ok[:, None] & d_ok[None, :]
    row = row_begin + i0  # int64: the tile's first packed row
    q_offs = qr[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + row * stride_qt + q_offs, mask=mask, other=0.0)
    do_offs = qr[:, None] * stride_dot + hq[:, None] * stride_doh + d[None, :]
    do = tl.load(do_ptr + row * stride_dot + do_offs, mask=mask, other=0.0)
    row_offs = qr * stride_lse + hq
    # Rows past the tile or the sequence load lse = +inf, so their p is 0 (they are never stored either).
    lse = tl.load(lse_ptr + row * stride_lse + row_offs, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + row * stride_lse + row_offs, mask=row_ok, other=0.0)
    pos = pos0 + i0 + qr
    key_len = tl.load(key_lens_ptr + b).to(tl.int32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    slot_ptr = slots_ptr + b * stride_slots
    dq = tl.zeros([ROWS, BLOCK_D], tl.float32)
    # Key tiles before n_full are visible in full to every query of the tile; the rest reach its diagonal. fp32
    # (FMA dots) keeps one masked loop: with two, the compiler holds q's and dO's operand copies across both.
    n_full = 0
    if q.dtype != tl.float32:
        n_full = (pos0 + i0 + 1) // BLOCK_N
        for j in tl.range(0, n_full, num_stages=STAGES):
            dq = _dq_step(
                dq, q, do, lse, delta, k_base, v_base, slot_ptr, j, key_len, pos, d, d_ok, stride_kt, stride_vt,
                qk_scale, BLOCK_N=BLOCK_N, CAUSAL=False, EVEN_D=EVEN_D,
            )  # fmt: skip
    n_tiles = (pos0 + tl.minimum(i0 + P, nq) - 1) // BLOCK_N + 1
    for j in range(n_full, n_tiles):
        dq = _dq_step(
            dq, q, do, lse, delta, k_base, v_base, slot_ptr, j, key_len, pos, d, d_ok, stride_kt, stride_vt,
            qk_scale, BLOCK_N=BLOCK_N, CAUSAL=True, EVEN_D=EVEN_D,
        )  # fmt: skip
    dq = dq * sm_scale
    tl.store(
        dq_ptr + row * stride_dqt + (qr[:, None] * stride_dqt + hq[:, None] * stride_dqh + d[None, :]),
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


# Whether decode steps may run split-KV (`_split_decode`); benchmarks turn it off for a before/after comparison
# (`exactrl bench rollout --split-kv off`). Either way a row gets the same bits.
SPLIT_DECODE = True
# Tests: fill the split's partial buffers first with values that look like a seen chunk carrying NaN, so that a
# combine reading a chunk nobody wrote fails instead of folding garbage unseen. Off in use: it costs fills.
POISON_PARTIALS = False


def _split_decode(batch: AttentionBatch, hkv: int, device: torch.device) -> bool:
    """A decode step (one query per sequence) whose (sequence, KV head) programs would leave most SMs idle runs
    split-KV: one program per chunk of keys, then the combine kernel. The rule reads the batch's geometry only
    (never its key lengths), so a CUDA graph captured for a bucket keeps one choice; either choice gives the same
    bits. On an H100 (qwen3-0.6b heads, benchmarks/probe_decode_attn.py --split, --wide) it took one decode
    step's attention from 46 to 12 us at one sequence of 1-2k keys and from 75 to 53 us at 16 such sequences; at
    32 sequences and more, with the engine's slot table of 2,560 keys (programs for every chunk of it), splitting
    was as slow or slower (128-384 keys: 20.6 -> 25.5 us at 32, 44 -> 53 us at 64), hence at most one program per
    SM before the split."""
    return (
        SPLIT_DECODE
        and batch.max_seqlen_q == 1
        and batch.num_seqs * hkv <= num_programs_cap(device) * (32 if device.type == "cpu" else 1)
    )


def _fwd_config(dtype: torch.dtype, batch: AttentionBatch, g: int) -> tuple[int, int, int, int]:
    """(rows, block_n, num_warps, num_stages) of the forward: DECODE_LAUNCH's tile for a 16-bit decode step whose
    GQA group fits it, else the training tile. Which one never changes a row's bits (the row sum is an MMA)."""
    if batch.max_seqlen_q == 1 and dtype != torch.float32 and g <= DECODE_LAUNCH[0]:
        return DECODE_LAUNCH[0], ATTN_BLOCK_N, DECODE_LAUNCH[1], DECODE_LAUNCH[2]
    return ATTN_ROWS, ATTN_BLOCK_N, *_FWD_LAUNCH[dtype]


def attention_fwd(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    batch: AttentionBatch,
    config: tuple[int, int, int, int] | None = None,
    split: bool | None = None,
    split_keys: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, Dh]; k_store/v_store: [S, Hkv, Dh] indexed by batch.key_slots -> (out [T, Hq, Dh] in q.dtype,
    lse [T, Hq] fp32, log2 domain).

    split: run a decode step (batch.max_seqlen_q == 1) as split-KV (chunk partials + combine); None: by
    `_split_decode`. `config` (rows, block_n, num_warps, num_stages) and `split_keys` are for benchmarks and tests
    only: the exact ops use `_fwd_config`'s tile and ATTN_SPLIT_KEYS."""
    q, k_store, v_store = (_last_dim_contiguous(t) for t in (q, k_store, v_store))
    hq, hkv, g, block_d = _geometry(q, k_store)
    T, _, dh = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((T, hq), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    rows, block_n, warps, stages = config or _fwd_config(q.dtype, batch, g)
    split_keys = split_keys or ATTN_SPLIT_KEYS
    if split_keys % block_n:
        raise ValueError(f"the key chunk ({split_keys}) must be a multiple of the key tile ({block_n})")
    chunk_tiles = split_keys // block_n
    if split is None:
        split = _split_decode(batch, hkv, q.device)
    elif split and batch.max_seqlen_q != 1:
        raise ValueError("split-KV attention is for decode steps (one query per sequence)")
    p = rows // g
    tiles_per_seq = triton.cdiv(batch.max_seqlen_q, p)
    sm_scale = 1.0 / math.sqrt(dh)
    slots = batch.key_slots
    B = batch.num_seqs
    # Chunks from the slot table's width (static in a decode graph), not from this step's key lengths.
    max_chunks = triton.cdiv(slots.shape[1], split_keys) if split else 1
    if split:
        f32: dict[str, Any] = dict(dtype=torch.float32, device=q.device)
        if POISON_PARTIALS:  # a chunk nobody wrote looks seen (l = 1) and carries NaN into the output
            part_m = torch.zeros((B, hkv, max_chunks, g), **f32)
            part_l = torch.ones((B, hkv, max_chunks, g), **f32)
            part_acc = torch.full((B, hkv, max_chunks, g, block_d), float("nan"), **f32)
        else:
            part_m = torch.empty((B, hkv, max_chunks, g), **f32)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty((B, hkv, max_chunks, g, block_d), **f32)
    else:
        part_m = part_l = part_acc = lse
    grid = (B * tiles_per_seq, hkv, max_chunks)
    _attn_fwd_kernel[grid](
        q, k_store, v_store, out, lse, batch.cu_seqlens_q, batch.q_pos, batch.key_lens, slots,
        part_m, part_l, part_acc,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), slots.stride(0), tiles_per_seq, dh, sm_scale * _LOG2E,
        max_chunks, G=g, P=p, ROWS=rows, BLOCK_N=block_n, BLOCK_D=block_d, EVEN_D=dh == block_d,
        CHUNK_TILES=chunk_tiles, PARTIAL=split, num_warps=warps, num_stages=stages,
        **pdl(q.device),
    )  # fmt: skip
    if split:
        _attn_combine_kernel[(B, hkv)](
            part_m, part_l, part_acc, out, lse, batch.cu_seqlens_q, batch.q_pos,
            out.stride(0), out.stride(1), lse.stride(0), max_chunks, dh,
            G=g, GP=next_pow2(g), BLOCK_N=block_n, BLOCK_D=block_d, CHUNK_TILES=chunk_tiles, num_warps=4,
            **pdl(part_m.device),
        )  # fmt: skip
    return out, lse


def attention_bwd_delta(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """delta [T, Hq] fp32 = rowsum over Dh of grad_out * out (the softmax backward's correction term)."""
    grad_out, out = _last_dim_contiguous(grad_out), _last_dim_contiguous(out)
    T, hq, dh = out.shape
    delta = torch.empty((T, hq), dtype=torch.float32, device=out.device)
    if T == 0:
        return delta
    block_r = 32
    _attn_bwd_delta_kernel[(triton.cdiv(T * hq, block_r),)](
        grad_out, out, delta, T * hq, hq, grad_out.stride(0), grad_out.stride(1), out.stride(0), out.stride(1), dh,
        BLOCK_R=block_r, BLOCK_D=max(16, next_pow2(dh)), num_warps=4,
        **pdl(grad_out.device),
    )  # fmt: skip
    return delta


def _bwd_tile(
    launch: tuple[int, int, int, int] | None, default: tuple[int, int, int, int], g: int
) -> tuple[int, int, int, int, int]:
    rows, block_n, warps, stages = launch or default
    rows = max(rows, next_pow2(g))
    return rows, rows // g, block_n, warps, stages


def _keys_major(block_n: int, warps: int, dtype: torch.dtype) -> bool:
    # A [keys, rows] wgmma needs 16 keys per warp, or warps duplicate work. fp32 dots run on FMAs, where the
    # rows-major form (K^T, V^T kept in registers across the loops) spills far more.
    return block_n >= 16 * warps or dtype == torch.float32


def attention_bwd_dkdv(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    batch: AttentionBatch,
    launch: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of attention_fwd (one program per sequence, key tile and KV head). `launch` (rows, block_n,
    num_warps, num_stages) overrides _BWD_LAUNCH[dtype].dkdv (benchmarks)."""
    q, k, v, grad_out = (_last_dim_contiguous(t) for t in (q, k, v, grad_out))
    hq, hkv, g, block_d = _geometry(q, k)
    dh = q.shape[2]
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if q.shape[0] == 0:
        return dk, dv
    rows, p, block_n, warps, stages = _bwd_tile(launch, _BWD_LAUNCH[q.dtype].dkdv, g)
    sm_scale = 1.0 / math.sqrt(dh)
    slots = batch.key_slots
    kv_tiles = triton.cdiv(batch.max_key_len, block_n)
    _attn_bwd_dkdv_kernel[(batch.num_seqs * kv_tiles, hkv)](
        q, k, v, grad_out, lse, delta, dk, dv, batch.cu_seqlens_q, batch.q_pos, batch.key_lens, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0), slots.stride(0), kv_tiles, dh, sm_scale * _LOG2E, sm_scale,
        G=g, P=p, ROWS=rows, BLOCK_N=block_n, BLOCK_D=block_d, EVEN=p * g == rows and dh == block_d,
        KEYS_MAJOR=_keys_major(block_n, warps, q.dtype), STAGES=stages, num_warps=warps, num_stages=stages,
        **pdl(q.device),
    )  # fmt: skip
    return dk, dv


def attention_bwd_dq(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    batch: AttentionBatch,
    launch: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """dQ of attention_fwd (one program per query tile and KV head). `launch` (rows, block_n, num_warps,
    num_stages) overrides _BWD_LAUNCH[dtype].dq (benchmarks)."""
    q, k, v, grad_out = (_last_dim_contiguous(t) for t in (q, k, v, grad_out))
    hq, hkv, g, block_d = _geometry(q, k)
    dh = q.shape[2]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0:
        return dq
    rows, p, block_n, warps, stages = _bwd_tile(launch, _BWD_LAUNCH[q.dtype].dq, g)
    sm_scale = 1.0 / math.sqrt(dh)
    slots = batch.key_slots
    tiles_per_seq = triton.cdiv(batch.max_seqlen_q, p)
    _attn_bwd_dq_kernel[(batch.num_seqs * tiles_per_seq, hkv)](
        q, k, v, grad_out, lse, delta, dq, batch.cu_seqlens_q, batch.q_pos, batch.key_lens, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1), lse.stride(0), slots.stride(0),
        tiles_per_seq, dh, sm_scale * _LOG2E, sm_scale,
        G=g, P=p, ROWS=rows, BLOCK_N=block_n, BLOCK_D=block_d, EVEN_D=dh == block_d,
        STAGES=stages, num_warps=warps, num_stages=stages,
        **pdl(q.device),
    )  # fmt: skip
    return dq


def attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    batch: AttentionBatch,
    config: AttnBwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention_fwd for packed sequences (keys indexed by key_slots into k/v). Deterministic.

    `config` overrides _BWD_LAUNCH[dtype] (benchmarks)."""
    q, k, v, grad_out = (_last_dim_contiguous(t) for t in (q, k, v, grad_out))
    delta = attention_bwd_delta(grad_out, out)
    dk, dv = attention_bwd_dkdv(grad_out, q, k, v, lse, delta, batch, config.dkdv if config else None)
    dq = attention_bwd_dq(grad_out, q, k, v, lse, delta, batch, config.dq if config else None)
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
    kv_written: bool = False,
) -> torch.Tensor:
    """Causal attention, q: [T, Hq, Dh], k/v: [T, Hkv, Dh] -> [T, Hq, Dh]; differentiable when kv_cache is None.
    kv_written: the new rows are already in kv_cache (norm.qk_norm_rope wrote them), k and v are not read."""
    if kv_cache is None:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _PackedAttention.apply(q, k, v, batch)
        return attention_fwd(q, k, v, batch)[0]
    if batch.slot_mapping is None:
        raise ValueError(
            "attention with a KV cache needs batch.slot_mapping (build it with AttentionBatch.paged)"
        )
    if kv_written:
        k_flat, v_flat = kv_cache_views(kv_cache)
    else:
        k_flat, v_flat = write_kv_cache(k, v, kv_cache, batch.slot_mapping)
    return attention_fwd(q, k_flat, v_flat, batch)[0]
