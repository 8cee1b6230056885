"""Token log-probabilities: log_softmax(linear(hidden, weight).float() / temperature)[targets], plus entropy.

Forward rows are processed in chunks of LOGPROB_CHUNK_ROWS: the chunk's logits come from the invariant matmul (in the
hidden dtype), then one program per row reads them in fixed BLOCK_V slices with an online (max, sum) per lane
and one final lane reduction. Nothing depends on the chunk size or on the other rows, so a row's logprob is
the same bits whether it was computed during sampling (a decode step) or in a training batch.

The temperature enters exactly once, as `z = logits.float() / T` with IEEE division (`div_rn`, correctly
rounded), in `scaled_logits` (what the sampler sees) and inside the logprob kernels: the same fp32 numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactrl.ops.triton.matmul import matmul

LOGPROB_CHUNK_ROWS = 1024  # rows of [rows, vocab] logits alive at once
_BLOCK_V = 4096  # vocabulary slice per loop step (fixed: the lane reduction tree depends on it)
_SCALE_BLOCK = 4096


@triton.jit(do_not_specialize=["n_cols"])
def _scale_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, tl.math.div_rn(x, temperature), mask=ok)


@triton.jit
def _logprob_fwd_kernel(
    x_ptr, targets_ptr, lp_ptr, ent_ptr, lse_ptr, stride_x, V, temperature, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)  # sum of exp(z - m) per lane
    sz = tl.zeros([BLOCK_V], tl.float32)  # sum of exp(z - m) * z per lane (for the entropy)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        z = tl.math.div_rn(tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), temperature)
        m_new = tl.maximum(m, tl.where(ok, z, float("-inf")))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes with no entry yet: avoid inf - inf
        alpha = tl.exp(m - m_ref)
        p = tl.where(ok, tl.exp(z - m_ref), 0.0)
        s = s * alpha + p
        sz = sz * alpha + p * z  # z is 0, not -inf, at masked lanes: no 0 * inf
        m = m_new
    mx = tl.max(m, axis=0)
    w = tl.exp(m - mx)
    total = tl.sum(s * w, axis=0)
    lse = mx + tl.log(total)
    target = tl.load(targets_ptr + row)
    zt = tl.math.div_rn(tl.load(base + target).to(tl.float32), temperature)
    tl.store(lp_ptr + row, zt - lse)
    tl.store(lse_ptr + row, lse)
    # H = -sum p log p = lse - E_p[z]
    tl.store(ent_ptr + row, lse - tl.sum(sz * w, axis=0) / total)


@triton.jit
def _logprob_bwd_kernel(
    x_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, gz_ptr, stride_x, stride_gz, V, temperature,
    HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
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
            logits, out, logits.stride(0), out.stride(0), V, float(temperature), BLOCK=_SCALE_BLOCK
        )
    return out


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [R, V] (last dim contiguous) -> (logprob [R], entropy [R], lse [R]) fp32, natural log."""
    R, V = logits.shape
    lp = torch.empty(R, dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(lp)
    lse = torch.empty_like(lp)
    if R:
        _logprob_fwd_kernel[(R,)](
            logits,
            targets,
            lp,
            ent,
            lse,
            logits.stride(0),
            V,
            float(temperature),
            BLOCK_V=_BLOCK_V,
            num_warps=8,
        )
    return lp, ent, lse


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward keeps only (logprob, entropy, lse) per row. Backward recomputes the logits in vocabulary slices
    `[all rows, v0:v1)` instead of row chunks: the gradient of a logit needs only its row's saved statistics, so
    each slice yields its rows of dweight in one GEMM over all T rows (written once, never accumulated in a
    [V, D] buffer), while dhidden, [T, D], sums the slices' contributions in fp32. The recomputed logits are the
    forward's bits: the invariant matmul gives an element the same value in any slice or row chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk):  # type: ignore[override]
        T = hidden.shape[0]
        lp = torch.empty(T, dtype=torch.float32, device=hidden.device)
        ent = torch.empty_like(lp)
        lse = torch.empty_like(lp)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            lp[s:e], ent[s:e], lse[s:e] = logprobs_from_logits(
                matmul(hidden[s:e], weight), targets[s:e], temperature
            )
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        return lp, (ent if with_entropy else None)

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):  # type: ignore[override]
        hidden, weight, targets, lse, ent = ctx.saved_tensors
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
        # As many logits per slice as a forward row chunk holds ([T, vc] with T * vc ~ chunk * V), and at least
        # 256 columns so a slice stays a reasonable GEMM.
        vc = min(V, max(256, ctx.chunk * V // max(T, 1)))
        rows = torch.arange(T, device=hidden.device)
        for v0 in range(0, V, vc):
            v1 = min(V, v0 + vc)
            w_s = weight[v0:v1]
            logits = matmul(hidden, w_s)
            gz = torch.empty_like(logits)
            _logprob_bwd_kernel[(T,)](
                logits, lse, ent, grad_lp, grad_ent, gz,
                logits.stride(0), gz.stride(0), v1 - v0, ctx.temperature, HAS_ENT=has_ent, BLOCK_V=_BLOCK_V,
                num_warps=8,
            )  # fmt: skip
            if need_h:
                gh_f += matmul(gz, w_s.t(), out_dtype=torch.float32)
            if need_w:
                # One element per row (no accumulation races): the target's, or + 0 (a no-op) at a clamped
                # column when the target lies outside this slice. No host sync.
                hit = (targets >= v0) & (targets < v1)
                cols = (targets - v0).clamp(0, v1 - v0 - 1)
                gz[rows, cols] += torch.where(hit, g_target, 0.0).to(gz.dtype)
                gw[v0:v1] = torch.matmul(gz.t(), hidden)
        gh = None
        if need_h:
            gh = (gh_f + g_target[:, None] * weight[targets].float()).to(hidden.dtype)
        return gh, gw, None, None, None, None


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [T, D], weight: [V, D], targets: [T] int64 -> (logprobs [T] fp32, entropy [T] fp32 or None)."""
    _check_temperature(temperature)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    targets = targets.contiguous()
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), with_entropy, chunk_rows)


def logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """hidden: [T, D] -> [T, V] fp32 `linear(hidden, weight).float() / temperature`, as the logprob kernel sees it."""
    _check_temperature(temperature)
    return scaled_logits(
        matmul(hidden if hidden.stride(-1) == 1 else hidden.contiguous(), weight), temperature
    )
