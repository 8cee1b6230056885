"""Token log-probabilities: log_softmax(linear(hidden, weight).float() / temperature)[targets], plus entropy.

Forward rows are processed in chunks of LOGPROB_CHUNK_ROWS whose logits come from the invariant matmul (in the
hidden dtype). Why a row's logprob is the same bits in every path (a decode step, a scoring pass, training):
- A row's vocabulary is reduced in fixed chunks of LOGPROB_SPLIT_COLS columns ([0, S), [S, 2S), ...): in a chunk,
  an online (max, sum, z-weighted sum) per lane over _BLOCK_V-wide slices from scratch, then one lane reduction to
  three scalars (`_chunk_stats`); the chunks are folded into the row's total in chunk order (`_fold_chunk`, scalar,
  explicit FMAs); then lse, logprob and entropy (`_finish_row`). Chunk boundaries are column positions, never a
  count chosen from the call, and nothing reads another row.
- Two launch forms run that arithmetic: one program per row walking every chunk and folding in registers, or one
  program per (row, chunk) storing the chunk's scalars and a combine kernel folding them per row (the form every
  call of more than one chunk takes: faster at every row count measured, `_split_form`).
  `_chunk_stats` runs inside the same kernel in both forms with the same _BLOCK_V and _FWD_WARPS, hence the same
  register layout and lane reduction tree; the fold and the epilogue are the same helpers. The choice reads the
  call's geometry only (`_split_form`). tests/ops/test_logprob_split.py checks both forms and the training path
  against each other with torch.equal (interpreter; the real vocabulary on the GPU).

The backward needs the logits again. A call whose [rows, vocab] logits fit `LOGPROB_KEEP_BYTES` (a training
microbatch of up to 8,192 tokens at a 152k vocabulary in bf16) computes them in one GEMM and keeps them: the
backward turns them into their gradient in place, and the LM head costs three GEMMs, as in any fast trainer.
Larger calls keep only per-row statistics and recompute the logits in vocabulary slices in the backward (a
fourth GEMM, about 6% of a qwen3-1.7b step's FLOPs, for a peak of one chunk instead of all the logits). Both give
the same bits: the invariant matmul gives an element the same value in any row chunk, slice or whole.

The temperature enters exactly once, as `z = logits.float() / T` with IEEE division (`div_rn`, correctly
rounded), in `scaled_logits` (what the sampler sees) and inside the logprob kernels: the same fp32 numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.common import pdl, pdl_wait
from exactrl.ops.triton.matmul import matmul

# Rows of [rows, vocab] logits alive at once when they are not kept.
LOGPROB_CHUNK_ROWS = 1024
# The largest [rows, vocab] logits a differentiable call keeps for its backward.
LOGPROB_KEEP_BYTES = 3 * 2**30
_BLOCK_V = 4096  # vocabulary slice per loop step (fixed: the lane reduction tree depends on it)
_FWD_WARPS = 8  # warps of every forward program (fixed: the lane reduction tree depends on it too)
# A row's vocabulary is reduced in chunks of LOGPROB_SPLIT_COLS columns ([0, S), [S, 2S), ...), each from scratch,
# folded into the row's total in chunk order: the arithmetic of every path (training, scoring, decode), so that the
# chunks may be reduced in separate programs (as every call of more than one chunk does) and folded in a second
# kernel. A multiple of _BLOCK_V. Changing it changes every logprob's low bits (both sides at once: still exact).
LOGPROB_SPLIT_COLS = 2 * _BLOCK_V
# Chunks of at most this many slices are unrolled (their loads issued together); longer ones loop.
_UNROLL_SLICES = tl.constexpr(4)
_SCALE_BLOCK = 4096


@triton.jit(do_not_specialize=["n_cols"])
def _scale_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols, temperature, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, tl.math.div_rn(x, temperature), mask=ok)


@triton.jit
def _slice_step(base, v0, c1, temperature, m, s, sz, BLOCK_V: tl.constexpr):
    # The columns [v0, v0 + BLOCK_V) below c1 into the per-lane online (max m, sum s, z-weighted sum sz).
    cols = v0 + tl.arange(0, BLOCK_V)
    ok = cols < c1
    z = tl.math.div_rn(tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), temperature)
    m_new = tl.maximum(m, tl.where(ok, z, float("-inf")))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes with no entry yet: avoid inf - inf
    alpha = tl.exp(m - m_ref)
    p = tl.where(ok, tl.exp(z - m_ref), 0.0)
    s = s * alpha + p
    # p = 0 at masked lanes and at -inf logits (a masked vocabulary): add 0 there, never 0 * -inf = NaN.
    sz = sz * alpha + p * tl.where(p > 0.0, z, 0.0)
    return m_new, s, sz


@triton.jit
def _chunk_stats(base, c0, V, temperature, BLOCK_V: tl.constexpr, CHUNK_SLICES: tl.constexpr):
    # One vocabulary chunk [c0, min(c0 + CHUNK_SLICES * BLOCK_V, V)) of a row, from scratch -> (max, sum of
    # exp(z - max), sum of exp(z - max) * z): a per-lane online softmax over the chunk's slices, then one lane
    # reduction. Both launch forms run this in the same kernel with the same BLOCK_V and num_warps (_FWD_WARPS), hence
    # the same register layout and tl.max / tl.sum tree: a chunk's three scalars are the same bits in either form.
    c1 = tl.minimum(c0 + CHUNK_SLICES * BLOCK_V, V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)  # sum of exp(z - m) per lane
    sz = tl.zeros([BLOCK_V], tl.float32)  # sum of exp(z - m) * z per lane (for the entropy)
    if CHUNK_SLICES <= _UNROLL_SLICES:
        # Unrolled: the slices' loads can be issued together (a split program is one chunk: one load latency).
        for i in tl.static_range(CHUNK_SLICES):
            m, s, sz = _slice_step(base, c0 + i * BLOCK_V, c1, temperature, m, s, sz, BLOCK_V)
    else:  # a long chunk (probes): a loop, the same steps in the same order
        for v0 in range(c0, c1, BLOCK_V):
            m, s, sz = _slice_step(base, v0, c1, temperature, m, s, sz, BLOCK_V)
    mc = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(mc == float("-inf"), 0.0, mc))  # a chunk of -inf logits only: w = 0, sums 0
    return mc, tl.sum(s * w, axis=0), tl.sum(sz * w, axis=0)


@triton.jit
def _fold_chunk(m_t, s_t, sz_t, m_c, s_c, sz_c):
    # The row's running (max, sum, z-weighted sum) with one chunk's scalars folded in. Scalar arithmetic with
    # explicit FMAs and no reduction: the one-program-per-row kernel (folding in registers) and the combine kernel
    # (folding partials read from memory) get the same bits. The first chunk folded into the empty total (-inf, 0, 0)
    # is that chunk exactly (a = exp(-inf) = 0, b = 1). A chunk without a finite entry is (-inf, 0, 0) and leaves
    # the total as it was, bit for bit: m_new = m_t, a = 1, b = 0 (1 if the total is still empty, times zeros), and
    # fma(0, b, x * 1) = x for the sums (never -0: they start at +0). No inf - inf, not even in a branch the
    # where discards: while the total is empty and the chunk too, m_new = -inf is replaced by 0.
    m_new = tl.maximum(m_t, m_c)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.where(m_new == m_t, 1.0, tl.exp(m_t - m_ref))
    b = tl.where(m_new == m_c, 1.0, tl.exp(m_c - m_ref))
    return m_new, tl.fma(s_c, b, s_t * a), tl.fma(sz_c, b, sz_t * a)


@triton.jit
def _finish_row(base, targets_ptr, lp_ptr, ent_ptr, lse_ptr, row, m_t, s_t, sz_t, temperature):
    # The row's epilogue, shared by both launch forms: lse, the target's logprob and the entropy.
    lse = m_t + tl.log(s_t)
    target = tl.load(targets_ptr + row)
    zt = tl.math.div_rn(tl.load(base + target).to(tl.float32), temperature)
    tl.store(lp_ptr + row, zt - lse)
    tl.store(lse_ptr + row, lse)
    # H = -sum p log p = lse - E_p[z]
    tl.store(ent_ptr + row, lse - sz_t / s_t)


@triton.jit
def _logprob_fwd_kernel(
    x_ptr, targets_ptr, lp_ptr, ent_ptr, lse_ptr, part_ptr, stride_x, V, temperature,
    BLOCK_V: tl.constexpr, CHUNK_SLICES: tl.constexpr, PARTIAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # PARTIAL (the split form): program (row, c) reduces chunk c of its row and stores its three scalars at
    # part[row, c, :] for _logprob_combine_kernel. Otherwise one program per row walks every chunk in order,
    # folding each into the row's total in registers, and finishes the row.
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    if PARTIAL:
        c = tl.program_id(1)
        m_c, s_c, sz_c = _chunk_stats(
            base, c * (CHUNK_SLICES * BLOCK_V), V, temperature, BLOCK_V, CHUNK_SLICES
        )
        part = part_ptr + (row * tl.num_programs(1) + c) * 3
        tl.store(part, m_c)
        tl.store(part + 1, s_c)
        tl.store(part + 2, sz_c)
    else:
        m_t = tl.full([], float("-inf"), tl.float32)
        s_t = tl.zeros([], tl.float32)
        sz_t = tl.zeros([], tl.float32)
        for c0 in range(0, V, CHUNK_SLICES * BLOCK_V):
            m_c, s_c, sz_c = _chunk_stats(base, c0, V, temperature, BLOCK_V, CHUNK_SLICES)
            m_t, s_t, sz_t = _fold_chunk(m_t, s_t, sz_t, m_c, s_c, sz_c)
        _finish_row(base, targets_ptr, lp_ptr, ent_ptr, lse_ptr, row, m_t, s_t, sz_t, temperature)


@triton.jit
def _logprob_combine_kernel(
    x_ptr, targets_ptr, lp_ptr, ent_ptr, lse_ptr, part_ptr, stride_x, temperature,
    N_CHUNKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # The split form's second kernel: one program per row folds its chunks' scalars in chunk order with the
    # unsplit kernel's _fold_chunk and finishes the row with its _finish_row. Unrolled over the (few) chunks so
    # that all their loads can be in flight at once, not one load latency per chunk.
    row = tl.program_id(0).to(tl.int64)
    m_t = tl.full([], float("-inf"), tl.float32)
    s_t = tl.zeros([], tl.float32)
    sz_t = tl.zeros([], tl.float32)
    for c in tl.static_range(N_CHUNKS):
        part = part_ptr + (row * N_CHUNKS + c) * 3
        m_t, s_t, sz_t = _fold_chunk(m_t, s_t, sz_t, tl.load(part), tl.load(part + 1), tl.load(part + 2))
    _finish_row(
        x_ptr + row * stride_x, targets_ptr, lp_ptr, ent_ptr, lse_ptr, row, m_t, s_t, sz_t, temperature
    )


@triton.jit
def _logprob_bwd_kernel(
    x_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, gz_ptr, stride_x, stride_gz, V, temperature,
    HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    lse = tl.load(lse_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    if HAS_ENT:
        ent = tl.load(ent_ptr + row)
        g_ent = tl.load(g_ent_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        z = tl.math.div_rn(tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), temperature)
        logp = z - lse
        p = tl.exp(logp)
        # d logp[y] / dz = onehot(y) - p;  dH / dz = -p (log p + H). The one-hot term is added by the caller:
        # kept out of the long vocabulary reduction of dhidden, it costs no fp32 accuracy there.
        gz = -p * g_lp
        if HAS_ENT:
            gz = gz - g_ent * p * (logp + ent)
        gz = tl.math.div_rn(gz, temperature)
        tl.store(gz_ptr + row * stride_gz + cols, gz.to(gz_ptr.dtype.element_ty), mask=ok)


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[R, V] (any float dtype) -> fp32 logits / temperature, the exact numbers the logprob kernels normalise."""
    R, V = logits.shape
    out = torch.empty((R, V), dtype=torch.float32, device=logits.device)
    if R and V:
        grid = (R, triton.cdiv(V, _SCALE_BLOCK))
        _scale_kernel[grid](
            logits,
            out,
            logits.stride(0),
            out.stride(0),
            V,
            float(temperature),
            BLOCK=_SCALE_BLOCK,
            **pdl(logits.device),
        )
    return out


def _split_form(n_chunks: int) -> bool:
    """Whether a call runs the split form (one program per (row, chunk), then the combine kernel): whenever a row
    has more than one chunk. Measured faster than one program per row at every row count (H200, 2026-11-26,
    benchmarks/probe_logprob_split.py, qwen3's 151,936 columns, us per call: 1 row 6.7 against 73.7, 64 rows 22.5
    against 74.3, 256 rows 75.3 against 101.5, a training microbatch of 8,192 rows 2,197 against 3,037). The
    unsplit form (same bits) stays as the reference the tests compare the split form with."""
    return n_chunks > 1


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    split: bool | None = None,
    *,
    split_cols: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [R, V] (last dim contiguous), targets: [R] int64 -> (logprob [R], entropy [R], lse [R]) fp32,
    natural log.

    split: True runs one program per (row, vocabulary chunk) and the combine kernel, False one program per row;
    None picks by `_split_form`. Same bits either way. `split_cols` (the chunk, LOGPROB_SPLIT_COLS) and `block_v`
    (the slice, _BLOCK_V) are for tests and probes: another value gives other bits, so every path of a run must
    use the same, and the exact ops use the module's."""
    block_v = _BLOCK_V if block_v is None else int(block_v)
    split_cols = LOGPROB_SPLIT_COLS if split_cols is None else int(split_cols)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"logprobs_from_logits: block_v must be a power of two >= 16, got {block_v}")
    if split_cols < block_v or split_cols % block_v:
        raise ValueError(
            f"logprobs_from_logits: the vocabulary chunk ({split_cols}) must be a multiple of the slice ({block_v})"
        )
    R, V = logits.shape
    lp = torch.empty(R, dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(lp)
    lse = torch.empty_like(lp)
    if not R:
        return lp, ent, lse
    if not V:
        raise ValueError("logprobs_from_logits: the logits have no vocabulary columns")
    n_chunks = triton.cdiv(V, split_cols)
    if split is None:
        split = _split_form(n_chunks)
    part = torch.empty((R, n_chunks, 3), dtype=torch.float32, device=logits.device) if split else lp
    meta = dict(BLOCK_V=block_v, CHUNK_SLICES=split_cols // block_v, num_warps=_FWD_WARPS)
    _logprob_fwd_kernel[(R, n_chunks) if split else (R,)](
        logits, targets, lp, ent, lse, part, logits.stride(0), V, float(temperature),
        PARTIAL=bool(split), **meta,
        **pdl(logits.device),
    )  # fmt: skip
    if split:
        _logprob_combine_kernel[(R,)](
            logits, targets, lp, ent, lse, part, logits.stride(0), float(temperature),
            N_CHUNKS=n_chunks, num_warps=1,
            **pdl(logits.device),
        )  # fmt: skip
    return lp, ent, lse


def keeps_logits(rows: int, vocab: int, element_size: int) -> bool:
    """Whether a differentiable logprob call over `rows` rows keeps its logits for the backward (the memory plan
    asks the same question: exactrl/train/memory.py)."""
    return rows * vocab * element_size <= LOGPROB_KEEP_BYTES


# mm(x [M, K], w [N, K], out_dtype=None) -> x @ w.T: the LM head's GEMM (the invariant matmul, or fast mode's).
MatMul = Callable[..., torch.Tensor]


def _vocab_slice(V: int, T: int, chunk: int) -> int:
    """The backward's vocabulary slice: about as many logits as a forward row chunk holds ([T, vc] with T * vc ~
    chunk * V) and at least 256 columns so a slice stays a reasonable GEMM, evened out over the slices V needs (no
    thin last slice), and a multiple of 64 so a slice of kept logits starts 128-byte aligned (TMA)."""
    target = max(256, chunk * V // max(T, 1))
    slices = triton.cdiv(V, target)
    return min(V, triton.cdiv(triton.cdiv(V, slices), 64) * 64)


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward keeps only (logprob, entropy, lse) per row, and the logits when `keep`. Backward walks the
    vocabulary in slices `[all rows, v0:v1)` (the kept logits' columns, or logits recomputed there): the
    gradient of a logit needs only its row's saved statistics, so each slice yields its rows of dweight in one
    GEMM over all T rows (written once, never accumulated in a [V, D] buffer), while dhidden, [T, D], sums the
    slices' contributions in fp32. Each slice's logits become their gradient in place."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk, keep, mm):  # type: ignore[override]
        if keep:
            kept = mm(hidden, weight)
            lp, ent, lse = logprobs_from_logits(kept, targets, temperature)
        else:
            T = hidden.shape[0]
            kept = None
            lp = torch.empty(T, dtype=torch.float32, device=hidden.device)
            ent = torch.empty_like(lp)
            lse = torch.empty_like(lp)
            for s in range(0, T, chunk):
                e = min(T, s + chunk)
                lp[s:e], ent[s:e], lse[s:e] = logprobs_from_logits(
                    matmul(hidden[s:e], weight), targets[s:e], temperature
                )
        # Recomputed logits come from the invariant matmul, which gives the forward's bits; a fast GEMM (cuBLAS
        # picks its kernel by shape) would not, so only kept logits may come from `mm`. dhidden's GEMM may.
        ctx.temperature, ctx.with_entropy, ctx.chunk, ctx.mm = temperature, with_entropy, chunk, mm
        ctx.save_for_backward(hidden, weight, targets, lse, ent, kept)
        return lp, (ent if with_entropy else None)

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):  # type: ignore[override]
        hidden, weight, targets, lse, ent, kept = ctx.saved_tensors
        mm = ctx.mm
        T, V = hidden.shape[0], weight.shape[0]
        if grad_lp is None:
            grad_lp = torch.zeros(T, dtype=torch.float32, device=hidden.device)
        has_ent = ctx.with_entropy and grad_ent is not None
        grad_lp = grad_lp.float().contiguous()
        grad_ent = grad_ent.float().contiguous() if has_ent else grad_lp
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # The one-hot term of d logp[y] / d logits, per row; kept out of the long vocabulary sums.
        g_target = grad_lp / ctx.temperature
        gh_f = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        gw = torch.empty_like(weight) if need_w else None
        vc = _vocab_slice(V, T, ctx.chunk)
        rows = torch.arange(T, device=hidden.device)
        for v0 in range(0, V, vc):
            v1 = min(V, v0 + vc)
            w_s = weight[v0:v1]
            gz = kept[:, v0:v1] if kept is not None else matmul(hidden, w_s)
            # In place: each program reads a block of its row's logits, then writes their gradient there.
            _logprob_bwd_kernel[(T,)](
                gz, lse, ent, grad_lp, grad_ent, gz,
                gz.stride(0), gz.stride(0), v1 - v0, ctx.temperature, HAS_ENT=has_ent, BLOCK_V=_BLOCK_V,
                num_warps=8,
                **pdl(gz.device),
            )  # fmt: skip
            if need_h:
                gh_f += mm(gz, w_s.t(), out_dtype=torch.float32)
            if need_w:
                assert gw is not None  # allocated above when need_w
                # One element per row (no accumulation races): the target's, or + 0 (a no-op) at a clamped
                # column when the target lies outside this slice. No host sync.
                hit = (targets >= v0) & (targets < v1)
                cols = (targets - v0).clamp(0, v1 - v0 - 1)
                gz[rows, cols] += torch.where(hit, g_target, 0.0).to(gz.dtype)
                gw[v0:v1] = torch.matmul(gz.t(), hidden)
        if kept is not None:
            # The kept logits are now their gradient. The kernel's writes do not count as a modification to
            # autograd, so say it: a second backward through this graph (retain_graph) then fails in autograd's
            # saved-tensor check instead of reading gradients as logits.
            torch.autograd.graph.increment_version(kept)
        gh = None
        if need_h:
            gh = (gh_f + g_target[:, None] * weight[targets].float()).to(hidden.dtype)
        return gh, gw, None, None, None, None, None, None


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(
            f"logprobs need a temperature > 0 (greedy decoding records logprobs at 1.0), got {temperature}"
        )


def logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = LOGPROB_CHUNK_ROWS,
    mm: MatMul = matmul,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [T, D], weight: [V, D], targets: [T] int64 -> (logprobs [T] fp32, entropy [T] fp32 or None).

    mm: the LM head's GEMM for the kept logits (a differentiable call that `keeps_logits`) and for dhidden in the
    backward; fast mode passes cuBLAS. Logits the backward recomputes come from the invariant matmul."""
    _check_temperature(temperature)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    targets = targets.contiguous()
    # Only a call that will run a backward keeps its logits: a no-grad scoring pass stays one chunk at a time.
    keep = (
        torch.is_grad_enabled()
        and (hidden.requires_grad or weight.requires_grad)
        and keeps_logits(hidden.shape[0], weight.shape[0], hidden.element_size())
    )
    return _ChunkedLogprobs.apply(
        hidden, weight, targets, float(temperature), with_entropy, chunk_rows, keep, mm
    )


def logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """hidden: [T, D] -> [T, V] fp32 `linear(hidden, weight).float() / temperature`, as the logprob kernel sees it."""
    _check_temperature(temperature)
    return scaled_logits(
        matmul(hidden if hidden.stride(-1) == 1 else hidden.contiguous(), weight), temperature
    )
