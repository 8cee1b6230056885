"""Exactness of the Triton backend on the GPU at qwen3-0.6b shapes (marker `gpu`, skipped without CUDA).

- Row-invariance sweep: rows of an m-row call `torch.equal` the same rows of a 300-row call, for every op,
  m in SWEEP, bf16 and fp32.
- Attention: decode and chunked prefill through the paged cache equal the packed training rows.
- RMSNorm and the fused residual add + RMSNorm at training shapes (D = 1024 over a 8k-token batch, D = 128 over
  ~100k head rows): a row alone, in prefixes, at other offsets and inside bigger calls has the bits it has in the
  full call; the fused op has the bits of `x + residual` then `rms_norm`; gradients, run twice for determinism.
- Gradients against float64 PyTorch references.
- Negative controls: cuBLAS (`F.linear`) gives some row different bits when the batch changes, and a norm whose
  reduction order depends on the row count fails the norm check, so the checks are able to fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attn_rows import decode_rows
from norm_invariance import norm_row_failures as _norm_row_failures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

if torch.cuda.is_available():
    from exactrl.ops import set_exact_environment
    from exactrl.ops.batch import AttentionBatch
    from exactrl.ops.torch_ops import attention_reference, rms_norm_torch, rope_torch, silu_mul_torch
    from exactrl.ops.triton.attention import AttnBwdConfig, attention_bwd, attention_fwd
    from exactrl.ops.triton.logprobs import logprobs_from_logits
    from exactrl.ops.triton.norm import norm_config
    from exactrl.ops.triton_ops import TritonOps

    ops = TritonOps()
    set_exact_environment(True)

SWEEP = [1, 2, 3, 5, 7, 8, 15, 16, 17, 64, 255, 256, 300]
DTYPES = [torch.bfloat16, torch.float32]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HIDDEN, HQ, HKV, DH, INTER, VOCAB = 1024, 16, 8, 128, 3072, 151936
# (K, N) of qwen3-0.6b's projections: q, k (= v), o, gate (= up), down, lm head
LINEAR_SHAPES = {
    "q": (1024, 2048),
    "k_v": (1024, 1024),
    "o": (2048, 1024),
    "gate_up": (1024, 3072),
    "down": (3072, 1024),
    "lm_head": (1024, VOCAB),
}
DEV = "cuda"


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=gen(seed), device=DEV) * scale).to(dtype)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_rows_invariant(fn, full_inputs, row_args, name):
    """fn(*inputs) on the first m rows equals the first m rows of fn on all 300 rows, for every m in SWEEP."""
    full = fn(*full_inputs)
    bad = []
    for m in SWEEP:
        inputs = [t[:m] if i in row_args else t for i, t in enumerate(full_inputs)]
        part = fn(*inputs)
        parts = part if isinstance(part, tuple) else (part,)
        fulls = full if isinstance(full, tuple) else (full,)
        if not all(torch.equal(p, f[:m]) for p, f in zip(parts, fulls)):
            bad.append(m)
    assert not bad, f"{name}: rows of an m-row call differ from the 300-row call for m in {bad}"
    return full


# ------------------------------------------------------------------------------------------------------------
# Row-invariance sweeps
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(LINEAR_SHAPES))
def test_linear_sweep(dtype, name):
    K, N = LINEAR_SHAPES[name]
    x = randn(300, K, dtype=dtype, seed=1)
    w = randn(N, K, dtype=dtype, scale=K**-0.5, seed=2)
    full = assert_rows_invariant(ops.linear, [x, w], {0}, f"linear {name}")
    idx = torch.randperm(300, generator=gen(3), device=DEV)[:64]
    ref = x[idx].double() @ w.double().T
    assert rel_err(full[idx], ref) < TOL[dtype] / 2
    perm = torch.randperm(300, generator=gen(4), device=DEV)
    assert torch.equal(ops.linear(x[perm], w), full[perm]), "a row's bits depend on its position in the call"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [(2048, 1024, 1024), (3072, 3072)], ids=["qkv", "gate_up"])
def test_packed_linear_equals_parts(dtype, parts):
    """The model's packed q/k/v and gate/up weights: each part's columns of the packed matmul have the bits of
    the part's own matmul, at every M tried (the fixed tile reduces an element over K the same way for any N)."""
    ws = [randn(n, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5, seed=40 + i) for i, n in enumerate(parts)]
    packed = torch.cat(ws)
    x = randn(300, HIDDEN, dtype=dtype, seed=45)
    for m in (1, 7, 256, 300):
        outs = ops.linear(x[:m], packed).split(list(parts), dim=-1)
        assert all(torch.equal(o, ops.linear(x[:m], w)) for o, w in zip(outs, ws)), f"M={m}"


@pytest.mark.parametrize("parts", [(2048, 1024, 1024), (3072, 3072)], ids=["qkv", "gate_up"])
def test_packed_linear_backward(parts):
    """The packed projection's backward: dX from one GEMM over the parts' gradients as K segments has the bits
    of the GEMM over their concatenation; dX, dW, dBias against float64; an unused part counts as zero."""
    from exactrl.ops.triton.matmul import _segmented_dx, matmul

    dtype, T = torch.bfloat16, 1000
    x = randn(T, HIDDEN, dtype=dtype, seed=50)
    w = randn(sum(parts), HIDDEN, dtype=dtype, scale=HIDDEN**-0.5, seed=51)
    b = randn(sum(parts), dtype=dtype, seed=52)
    grads = [randn(T, n, dtype=dtype, seed=53 + i) for i, n in enumerate(parts)]
    seg = _segmented_dx(grads, w)
    assert seg is not None and torch.equal(seg, matmul(torch.cat(grads, -1), w.t()))
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    outs = ops.packed_linear(*leaves, list(parts))
    used = len(parts) - 1  # the last part's output unused: its gradient is zero
    torch.autograd.backward(outs[:used], grads[:used])
    refs = [t.double().requires_grad_(True) for t in (x, w, b)]
    y = F.linear(*refs)
    g_ref = torch.cat(
        [g.double() for g in grads[:used]] + [torch.zeros(T, parts[-1], device=DEV).double()], -1
    )
    y.backward(g_ref)
    for name, got, ref in zip(("dx", "dw", "db"), leaves, refs):
        assert rel_err(got.grad, ref.grad) < TOL[dtype], name


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_bias_sweep(dtype):
    x, w, b = (
        randn(300, 1024, dtype=dtype, seed=5),
        randn(1024, 1024, dtype=dtype, scale=1 / 32, seed=6),
        randn(1024, dtype=dtype, seed=7),
    )
    full = assert_rows_invariant(ops.linear, [x, w, b], {0}, "linear+bias")
    assert rel_err(full, x.double() @ w.double().T + b.double()) < TOL[dtype] / 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_sweep(dtype):
    w = (1 + 0.1 * randn(HIDDEN, seed=8)).to(dtype)
    x = randn(300, HIDDEN, dtype=dtype, seed=9)
    full = assert_rows_invariant(lambda a, b: ops.rms_norm(a, b, 1e-6), [x, w], {0}, "rms_norm")
    assert rel_err(full, rms_norm_torch(x.double(), w.double(), 1e-6)) < TOL[dtype]
    wh = (1 + 0.1 * randn(DH, seed=10)).to(dtype)
    xh = randn(300, HQ, DH, dtype=dtype, seed=11)
    assert_rows_invariant(lambda a, b: ops.rms_norm(a, b, 1e-6), [xh, wh], {0}, "rms_norm per head")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_silu_sweep(dtype):
    ang = torch.arange(4096, device=DEV)[:, None] * (1e6 ** (-torch.arange(DH // 2, device=DEV) / (DH // 2)))
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1).float()
    pos = torch.randint(0, 4096, (300,), generator=gen(12), device=DEV)
    x = randn(300, HQ, DH, dtype=dtype, seed=13)
    full = assert_rows_invariant(lambda a, p: ops.rope(a, p, cos_sin), [x, pos], {0, 1}, "rope")
    assert rel_err(full, rope_torch(x.double(), pos, cos_sin.double())) < TOL[dtype]
    g, u = randn(300, INTER, dtype=dtype, seed=14), randn(300, INTER, dtype=dtype, seed=15)
    full = assert_rows_invariant(ops.silu_mul, [g, u], {0, 1}, "silu_mul")
    assert rel_err(full, silu_mul_torch(g.double(), u.double())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rope_sweep(dtype):
    """Qwen3's q/k norm + RoPE in one pass: row-invariant, the bits of rms_norm then rope (q: 16 heads, k: 8),
    gradients against float64 and deterministic."""
    ang = torch.arange(4096, device=DEV)[:, None] * (1e6 ** (-torch.arange(DH // 2, device=DEV) / (DH // 2)))
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1).float()
    pos = torch.randint(0, 4096, (300,), generator=gen(16), device=DEV)
    w = (1 + 0.1 * randn(DH, seed=17)).to(dtype)
    for heads in (HQ, HKV):
        x = randn(300, heads, DH, dtype=dtype, seed=18 + heads)
        fn = lambda a, p: ops.rms_norm_rope(a, w, 1e-6, p, cos_sin)  # noqa: E731
        full = assert_rows_invariant(fn, [x, pos], {0, 1}, f"rms_norm_rope ({heads} heads)")
        unfused = ops.rope(ops.rms_norm(x, w, 1e-6), pos, cos_sin)
        assert torch.equal(full, unfused), (
            f"fused differs from rms_norm + rope: {(full - unfused).abs().max()}"
        )
    if dtype == torch.bfloat16:  # negative control: without the rounding between the two ops, other bits
        skipped = ops.rope(ops.rms_norm(x.float(), w.float(), 1e-6), pos, cos_sin).to(dtype)
        assert not torch.equal(skipped, full)
    gy = randn(300, HKV, DH, dtype=dtype, seed=30)
    grads = []
    for _ in range(2):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ops.rms_norm_rope(xl, wl, 1e-6, pos, cos_sin).backward(gy)
        grads.append((xl.grad, wl.grad))
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    rope_torch(rms_norm_torch(xr, wr, 1e-6), pos, cos_sin.double()).backward(gy.double())
    assert rel_err(grads[0][0], xr.grad) < TOL[dtype] and rel_err(grads[0][1], wr.grad) < TOL[dtype]
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "backward is not deterministic"


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_sweep(dtype):
    h = randn(300, HIDDEN, dtype=dtype, seed=16)
    w = randn(VOCAB, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5 * 2, seed=17)
    targets = torch.randint(0, VOCAB, (300,), generator=gen(18), device=DEV)
    lp, ent = assert_rows_invariant(
        lambda a, t: ops.logprobs(a, w, t, 0.7, with_entropy=True), [h, targets], {0, 1}, "logprobs"
    )
    z = ops.logits(h, w, 0.7)
    lin = ops.linear(h, w)
    # logits() = the linear's output in fp32 divided by T with IEEE division (the CPU's fp32 division is IEEE).
    assert torch.equal(z.cpu(), lin.float().cpu() / torch.full(lin.shape, 0.7)), "logits() is not linear / T"
    # One lm-head matmul serves the sampler and the recorded logprob: the logprob kernel on the linear's output
    # (the same kernel, on the same dtype, as inside ops.logprobs) gives the trainer's bits.
    assert torch.equal(logprobs_from_logits(lin, targets, 0.7)[0], lp)
    assert_rows_invariant(lambda a: ops.logits(a, w, 0.7), [h], {0}, "logits")
    logp = torch.log_softmax(z.double(), -1)
    assert rel_err(lp, logp.gather(1, targets[:, None])[:, 0]) < 1e-5
    assert rel_err(ent, -(logp.exp() * logp).sum(-1)) < 1e-5


# ------------------------------------------------------------------------------------------------------------
# RMSNorm and the fused residual add + RMSNorm at training shapes
# ------------------------------------------------------------------------------------------------------------

# (D, rows): the hidden norms of an 8 x 1024-token step, and Qwen3's per-head q/k norms over ~100k head rows.
# Neither row count is a multiple of the kernel's ROWS.
NORM_SHAPES = {"hidden": (HIDDEN, 8 * 1024 + 13), "head": (DH, 100_003)}


def norm_row_failures(fn, inputs, seed=0):
    """norm_invariance.norm_row_failures at the GPU sweep: m-row prefixes over SWEEP, 300-row windows."""
    return _norm_row_failures(
        fn,
        inputs,
        randn=randn,
        prefixes=lambda rows, R: SWEEP,
        window=300,
        last_after=lambda rows: 1000,
        seed=seed,
    )


def norm_inputs(shape, dtype, seed):
    D, R = NORM_SHAPES[shape]
    x, r = randn(R, D, dtype=dtype, seed=seed), randn(R, D, dtype=dtype, scale=4.0, seed=seed + 1)
    return x, r, (1 + 0.1 * randn(D, seed=seed + 2)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(NORM_SHAPES))
def test_norm_rows_invariant(dtype, shape):
    x, r, w = norm_inputs(shape, dtype, seed=70)
    assert x.shape[0] % norm_config(x.shape[1])[1], "R must not be a multiple of ROWS"
    assert norm_row_failures(lambda a: (ops.rms_norm(a, w, 1e-6),), [x], seed=73) == []
    assert norm_row_failures(lambda a, b: ops.add_rms_norm(a, b, w, 1e-6), [x, r], seed=74) == []
    if shape == "head":  # the model's call: [T, H, Dh], each head a row
        T = x.shape[0] // HQ
        heads = ops.rms_norm(x[: T * HQ].view(T, HQ, DH), w, 1e-6)
        assert torch.equal(heads.view(-1, DH), ops.rms_norm(x, w, 1e-6)[: T * HQ])


def test_norm_row_check_negative_control():
    """The same check finds the rows of a norm whose reduction order depends on the number of rows: calls of fewer
    than 64 rows split each row's sum of squares into 4 partial sums, as a kernel that splits rows across
    programs to fill the GPU on small batches would."""

    def split_rms_norm_when_small(x, w, eps):
        xf = x.float()
        parts = 4 if x.shape[0] < 64 else 1
        ss = sum(c.pow(2).sum(-1) for c in xf.chunk(parts, dim=-1))
        return ((xf * torch.rsqrt(ss / x.shape[-1] + eps)[:, None]).to(x.dtype) * w,)

    x, _, w = norm_inputs("hidden", torch.float32, seed=75)
    assert norm_row_failures(lambda a: split_rms_norm_when_small(a, w, 1e-6), [x], seed=76)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(NORM_SHAPES))
def test_add_rms_norm_equals_unfused(dtype, shape):
    x, r, w = norm_inputs(shape, dtype, seed=80)
    normed, summed = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r), "summed is not torch's x + residual"
    assert torch.equal(normed, ops.rms_norm(x + r, w, 1e-6)), "fused norm differs from rms_norm(x + residual)"
    assert rel_err(normed, rms_norm_torch((x + r).double(), w.double(), 1e-6)) < TOL[dtype]
    if dtype == torch.bfloat16:
        # Negative control: normalising the unrounded fp32 sum (a fused kernel that skips rounding `summed` to
        # x.dtype), rounded at the end, gives other bits: the equality above can fail.
        unrounded = ops.rms_norm(x.float() + r.float(), w.float(), 1e-6).to(dtype)
        assert not torch.equal(unrounded, normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(NORM_SHAPES))
def test_norm_grads(dtype, shape):
    """rms_norm and add_rms_norm gradients against float64 autograd, and the same bits on a second run."""
    x, r, w = norm_inputs(shape, dtype, seed=90)
    g_normed, g_summed = randn(*x.shape, dtype=dtype, seed=93), randn(*x.shape, dtype=dtype, seed=94)

    def run(fused):
        leaves = [t.clone().requires_grad_(True) for t in ((x, r, w) if fused else (x, w))]
        if fused:
            normed, summed = ops.add_rms_norm(*leaves, 1e-6)
            torch.autograd.backward((normed, summed), (g_normed, g_summed))
        else:
            ops.rms_norm(*leaves, 1e-6).backward(g_normed)
        return [t.grad for t in leaves]

    def reference(fused):
        leaves = [t.double().requires_grad_(True) for t in ((x, r, w) if fused else (x, w))]
        summed = leaves[0] + leaves[1] if fused else leaves[0]
        loss = (rms_norm_torch(summed, leaves[-1], 1e-6) * g_normed.double()).sum()
        if fused:
            loss = loss + (summed * g_summed.double()).sum()
        loss.backward()
        return [t.grad for t in leaves]

    for fused in (False, True):
        got = run(fused)
        errs = [rel_err(a, b) for a, b in zip(got, reference(fused))]
        assert all(e < TOL[dtype] for e in errs), (fused, errs)
        assert all(torch.equal(a, b) for a, b in zip(run(fused), got)), (
            f"backward not deterministic ({fused=})"
        )


# ------------------------------------------------------------------------------------------------------------
# Attention: decode / prefill / training
# ------------------------------------------------------------------------------------------------------------


class PagedCache:
    def __init__(self, num_blocks, block_size, dtype, seed):
        self.block_size = block_size
        self.k = torch.full((num_blocks, block_size, HKV, DH), float("nan"), dtype=dtype, device=DEV)
        self.v = torch.full_like(self.k, float("nan"))
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def table(self, n_tokens):
        nb = -(-n_tokens // self.block_size)
        t, self.free = self.free[:nb], self.free[nb:]
        return t


def run_paged(q, k, v, lens, schedule, block_size=16, seed=0):
    cache = PagedCache(sum(-(-n // block_size) for n in lens) + 4, block_size, q.dtype, seed)
    tables = [cache.table(n) for n in lens]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    out = torch.full_like(q, float("nan"))
    cached, step = [0] * len(lens), 0
    while any(c < n for c, n in zip(cached, lens)):
        active, new = [], []
        for b, n in enumerate(lens):
            take = min(schedule(step, b, cached[b], n), n - cached[b])
            if take > 0:
                active.append(b)
                new.append(take)
        step += 1
        if not active:
            continue
        rows = torch.cat(
            [torch.arange(offsets[b] + cached[b], offsets[b] + cached[b] + t) for b, t in zip(active, new)]
        )
        rows = rows.to(DEV)
        batch = AttentionBatch.paged(
            [cached[b] for b in active], new, [tables[b] for b in active], block_size, DEV
        )
        out[rows] = ops.attention(q[rows], k[rows], v[rows], batch, kv_cache=(cache.k, cache.v))
        for b, t in zip(active, new):
            cached[b] += t
    return out


SCHEDULES = {
    "whole_prefill": lambda step, b, c, n: n,
    "chunks_37": lambda step, b, c, n: 37,
    "chunks_64": lambda step, b, c, n: 64,
    "prefill_1_then_decode": lambda step, b, c, n: 1,
    "prefill_100_then_decode": lambda step, b, c, n: 100 if c == 0 else 1,
    "staggered": lambda step, b, c, n: (13 if c == 0 else 1) if step >= 5 * b else 0,
}


def qkv(lens, dtype, seed):
    T = sum(lens)
    return (
        randn(T, HQ, DH, dtype=dtype, seed=seed),
        randn(T, HKV, DH, dtype=dtype, seed=seed + 1),
        randn(T, HKV, DH, dtype=dtype, seed=seed + 2),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_prefill_equal_training(dtype):
    lens = [300, 17, 129, 64, 1, 65]
    q, k, v = qkv(lens, dtype, seed=20)
    train = ops.attention(q, k, v, AttentionBatch.packed(lens, device=DEV))
    ref = attention_reference(q.double(), k.double(), v.double(), AttentionBatch.packed(lens, device=DEV))
    assert rel_err(train, ref) < TOL[dtype]
    bad = []
    for i, (name, sched) in enumerate(SCHEDULES.items()):
        got = run_paged(q, k, v, lens, sched, seed=i)
        if not torch.equal(got, train):
            bad.append((name, (got.float() - train.float()).abs().max().item()))
    # Each sequence alone (a training batch of one) equals its rows in the packed batch.
    at = 0
    for n in lens:
        s = slice(at, at + n)
        if not torch.equal(ops.attention(q[s], k[s], v[s], AttentionBatch.packed([n], device=DEV)), train[s]):
            bad.append((f"alone[{n}]", None))
        at += n
    assert not bad, f"rollout/training attention differ: {bad}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_split_decode_long_contexts(dtype):
    """Contexts of up to eight key chunks (ATTN_SPLIT_KEYS): decode rows at and around chunk edges, computed
    split-KV and in one program, equal training's rows; chunks of another size give other bits (control)."""
    from exactrl.ops.triton.attention import ATTN_SPLIT_KEYS

    lens = [2048, 700, 257, 1500]
    q, k, v = qkv(lens, dtype, seed=28)
    train = ops.attention(q, k, v, AttentionBatch.packed(lens, device=DEV))
    S = ATTN_SPLIT_KEYS
    picks = sorted({0, 1, 63, 64, S - 1, S, S + 1, 2 * S, 3 * S - 7, 699, 1023, 1024, 1499, 2047})
    rows, dec = decode_rows(lens, picks, DEV)
    for split in (True, False):
        got = attention_fwd(q[rows], k, v, dec, split=split)[0]
        assert torch.equal(got, train[rows]), (
            f"split={split}: {(got.float() - train[rows].float()).abs().max()}"
        )
    other = attention_fwd(q[rows], k, v, dec, split=True, split_keys=2 * S)[0]
    assert not torch.equal(other, train[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_sweep(dtype):
    """A decode step of m sequences equals the first m sequences of a 300-sequence decode step."""
    block_size = 16
    ctx = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(21)).tolist()
    cache = PagedCache(sum(-(-(c + 1) // block_size) for c in ctx) + 4, block_size, dtype, seed=22)
    tables = [cache.table(c + 1) for c in ctx]
    # Fill the cached context with random keys/values through prefill steps of the same kernel.
    kc, vc = randn(*cache.k.shape, dtype=dtype, seed=23), randn(*cache.v.shape, dtype=dtype, seed=24)
    cache.k.copy_(kc)
    cache.v.copy_(vc)
    q, k, v = (
        randn(300, HQ, DH, dtype=dtype, seed=25),
        randn(300, HKV, DH, dtype=dtype, seed=26),
        randn(300, HKV, DH, dtype=dtype, seed=27),
    )

    def step(qm, km, vm):
        m = qm.shape[0]
        batch = AttentionBatch.paged(ctx[:m], [1] * m, tables[:m], block_size, DEV)
        return ops.attention(qm, km, vm, batch, kv_cache=(cache.k, cache.v))

    full = assert_rows_invariant(step, [q, k, v], {0, 1, 2}, "attention decode")
    batch = AttentionBatch.paged(ctx, [1] * 300, tables, block_size, DEV)
    kf, vf = cache.k.view(-1, HKV, DH), cache.v.view(-1, HKV, DH)
    ref = attention_reference(q.double(), k.double(), v.double(), batch, kf.double(), vf.double())
    assert rel_err(full, ref) < TOL[dtype]


@pytest.mark.parametrize("hq,hkv", [(HQ, HKV), (32, 4)])  # GQA groups of 2 (qwen3-0.6b) and 8 (qwen3-30b-a3b)
@pytest.mark.parametrize("c,lo,hi", [(1, 128, 384), (64, 128, 384), (256, 128, 384), (64, 1024, 2048)])
def test_attention_query_tiles_equal(c, lo, hi, hq, hkv):
    """A decode step's 16-row query tile (`_fwd_config`) and other tiles give every row the bits of training's
    64-row tile, split-KV or not, at decode geometries where a layout-ordered row sum gave some rows other bits
    (64 and 256 sequences of 128-384 keys, a shuffled paged cache, keys with outlier channels). Negative control:
    another key-chunk size (a different fold order) changes some row, so the comparison can fail. That the
    geometries catch the hazard itself (a `tl.sum` row sum, whose order follows the tile's layout) was shown by
    benchmarks/probe_decode_attn.py with the kernel switched back (H200, 2026-11-26: 16- and 32-row tiles differ at
    64 and 256 sequences; benchmarks/results/probe-attn-rowsum-NVIDIA-H200.jsonl): re-run both after a Triton
    upgrade, the equality being the compiler's and the hardware's."""
    from exactrl.ops.triton.attention import ATTN_ROWS, DECODE_LAUNCH, _fwd_config

    gen_py = torch.Generator().manual_seed(c * 31 + lo)
    ctx = torch.randint(lo, hi + 1, (c,), generator=gen_py).tolist()
    page = 16
    pages = [-(-n // page) for n in ctx]
    ids = torch.randperm(sum(pages) + 8, generator=gen_py).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(ids[at : at + n])
        at += n
    slots = len(ids) * page
    k = randn(slots, hkv, DH, scale=0.5, seed=c + 1)
    k[:, :, :4] *= 8.0  # outlier channels, as real keys have
    k = k.bfloat16()
    v = randn(slots, hkv, DH, dtype=torch.bfloat16, seed=c + 2)
    q = randn(c, hq, DH, dtype=torch.bfloat16, scale=0.7, seed=c + 3)
    batch = AttentionBatch.paged([n - 1 for n in ctx], [1] * c, tables, page, device=DEV)
    assert _fwd_config(torch.bfloat16, batch, hq // hkv)[0] == DECODE_LAUNCH[0]
    train_tile = (ATTN_ROWS, 64, 4, 3)
    ref = attention_fwd(q, k, v, batch, config=train_tile, split=False)[0]
    for cfg in [
        train_tile,
        (DECODE_LAUNCH[0], 64, *DECODE_LAUNCH[1:]),
        (16, 64, 1, 3),
        (32, 64, 2, 3),
        (64, 64, 8, 3),
    ]:
        for split in (False, True):
            out = attention_fwd(q, k, v, batch, config=cfg, split=split)[0]
            assert torch.equal(out, ref), (
                f"tile {cfg}, split {split}: some row differs from the training tile"
            )
    assert torch.equal(attention_fwd(q, k, v, batch)[0], ref)  # the tile and split the exact ops pick
    other = attention_fwd(q, k, v, batch, config=train_tile, split=False, split_keys=128)[0]
    assert not torch.equal(other, ref), "negative control: another fold order should change some row"


# ------------------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_grad(dtype):
    lens = [300, 77, 129, 1]
    q, k, v = qkv(lens, dtype, seed=30)
    gy = randn(sum(lens), HQ, DH, dtype=dtype, seed=33)
    batch = AttentionBatch.packed(lens, device=DEV)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ops.attention(*leaves, batch).backward(gy)
    refs = [t.double().requires_grad_(True) for t in (q, k, v)]
    attention_reference(*refs, batch).backward(gy.double())
    errs = {n: rel_err(a.grad, b.grad) for n, a, b in zip("qkv", leaves, refs)}
    assert all(e < TOL[dtype] for e in errs.values()), errs
    again = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ops.attention(*again, batch).backward(gy)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(again, leaves)), (
        "attention backward not deterministic"
    )


# Backward tiles (dK/dV, dQ) from the benchmark sweep: the dK/dV kernel is keys-major when block_n >= 16 *
# num_warps, rows-major otherwise. The default runs on GQA groups 1, 2 and 4, the others on Qwen3's 2.
BWD_TILES = {
    "keys_major_8_warps": ((32, 128, 8, 3), (128, 32, 8, 3)),
    "keys_major_4_warps": ((64, 64, 4, 2), (64, 64, 4, 3)),
    "rows_major_32_keys": ((128, 32, 8, 2), (256, 32, 8, 2)),
}
BWD_CASES = [("default", 8, 8), ("default", 16, 8), ("default", 16, 4)] + [(t, HQ, HKV) for t in BWD_TILES]


@pytest.mark.parametrize("tiles,hq,hkv", BWD_CASES)
def test_attention_bwd_tiles(tiles, hq, hkv):
    """bf16 gradients under each tile pair against float64, run twice for determinism. Sequences that are and
    are not multiples of the tiles and a 1-token one: masked diagonal tiles, unmasked tiles, partial last tiles."""
    lens = [300, 64, 129, 1, 77, 256]
    T, dtype = sum(lens), torch.bfloat16
    q, gy = randn(T, hq, DH, dtype=dtype, seed=34), randn(T, hq, DH, dtype=dtype, seed=35)
    k, v = randn(T, hkv, DH, dtype=dtype, seed=36), randn(T, hkv, DH, dtype=dtype, seed=37)
    batch = AttentionBatch.packed(lens, device=DEV)
    out, lse = attention_fwd(q, k, v, batch)
    config = AttnBwdConfig(*BWD_TILES[tiles]) if tiles in BWD_TILES else None
    grads = attention_bwd(gy, q, k, v, out, lse, batch, config=config)
    refs = [t.double().requires_grad_(True) for t in (q, k, v)]
    attention_reference(*refs, batch).backward(gy.double())
    errs = {n: rel_err(a, b.grad) for n, a, b in zip("qkv", grads, refs)}
    assert all(e < TOL[dtype] for e in errs.values()), errs
    again = attention_bwd(gy, q, k, v, out, lse, batch, config=config)
    assert all(torch.equal(a, b) for a, b in zip(again, grads)), "attention backward not deterministic"


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_grads(dtype):
    x, w = randn(257, 1024, dtype=dtype, seed=40), randn(3072, 1024, dtype=dtype, scale=1 / 32, seed=41)
    gy = randn(257, 3072, dtype=dtype, seed=42)
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ops.linear(xl, wl).backward(gy)
    assert rel_err(xl.grad, gy.double() @ w.double()) < TOL[dtype]
    assert rel_err(wl.grad, gy.double().T @ x.double()) < TOL[dtype]

    nw = (1 + 0.1 * randn(1024, seed=43)).to(dtype)
    xl, wl = x.clone().requires_grad_(True), nw.clone().requires_grad_(True)
    g2 = randn(257, 1024, dtype=dtype, seed=44)
    ops.rms_norm(xl, wl, 1e-6).backward(g2)
    xr, wr = x.double().requires_grad_(True), nw.double().requires_grad_(True)
    rms_norm_torch(xr, wr, 1e-6).backward(g2.double())
    assert rel_err(xl.grad, xr.grad) < TOL[dtype] and rel_err(wl.grad, wr.grad) < TOL[dtype]

    g, u = randn(257, 3072, dtype=dtype, seed=45), randn(257, 3072, dtype=dtype, seed=46)
    gl, ul = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    ops.silu_mul(gl, ul).backward(gy)
    gr, ur = g.double().requires_grad_(True), u.double().requires_grad_(True)
    silu_mul_torch(gr, ur).backward(gy.double())
    assert rel_err(gl.grad, gr.grad) < TOL[dtype] and rel_err(ul.grad, ur.grad) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_grad(dtype):
    T, temp = 96, 0.8
    h = randn(T, HIDDEN, dtype=dtype, seed=50)
    w = randn(VOCAB, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5 * 2, seed=51)
    targets = torch.randint(0, VOCAB, (T,), generator=gen(52), device=DEV)
    g_lp, g_ent = randn(T, seed=53), randn(T, seed=54)
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = ops.logprobs(hl, wl, targets, temp, with_entropy=True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    logp = torch.log_softmax((hr @ wr.T) / temp, -1)
    rlp, rent = logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    ((rlp * g_lp.double()).sum() + (rent * g_ent.double()).sum()).backward()
    assert rel_err(hl.grad, hr.grad) < TOL[dtype] and rel_err(wl.grad, wr.grad) < TOL[dtype]


# ------------------------------------------------------------------------------------------------------------
# Negative control
# ------------------------------------------------------------------------------------------------------------


def test_negative_control_cublas_is_not_batch_invariant():
    """The same sweep applied to F.linear (cuBLAS) finds a shape where a row's bits change with the batch size:
    proof that the sweep can fail. Shapes with large K and small N push cuBLAS towards split-K for small M."""
    found = []
    for dtype in DTYPES:
        for K, N in [(1024, 1024), (3072, 1024), (8192, 256), (16384, 128), (4096, 4096), (1023, 1000)]:
            x = randn(300, K, dtype=dtype, seed=60)
            w = randn(N, K, dtype=dtype, scale=K**-0.5, seed=61)
            full = F.linear(x, w)
            ms = [m for m in SWEEP if not torch.equal(F.linear(x[:m], w), full[:m])]
            if ms:
                found.append((str(dtype), K, N, ms))
    print("cuBLAS rows that change with the batch:", found)
    assert found, "cuBLAS was batch-invariant for every tried shape; the negative control needs another shape"
    # ... while the Triton kernel is invariant on the very same shapes.
    for dtype_name, K, N, _ in found[:2]:
        dtype = getattr(torch, dtype_name.split(".")[-1])
        x = randn(300, K, dtype=dtype, seed=60)
        w = randn(N, K, dtype=dtype, scale=K**-0.5, seed=61)
        assert_rows_invariant(ops.linear, [x, w], {0}, f"linear {K}x{N}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "K,N,bias", [(1024, 1024, False), (1000, 4096, True), (3072, 1000, False), (2048, 12288, True)]
)
def test_tile_family_equal_training_tile(dtype, K, N, bias):
    """The 16-bit GEMM picks a tile per call (64-row tiles for decode and mid-size calls, with K steps of 128 or
    256 at most 64 rows, the training tile for large ones); every tile of the family gives a row the bits the
    training tile gives it in a 300-row call (odd K, bias included). Negative control: the same rows with the K
    order reversed differ, so the check can fail."""
    from exactrl.ops.triton.matmul import (
        _DECODE_FAMILY,
        _MID_K,
        _TILE_FAMILY,
        MATMUL_CONFIGS,
        MatmulConfig,
        matmul,
        tile_config,
    )

    x = randn(300, K, dtype=dtype, seed=70)
    w = randn(N, K, dtype=dtype, scale=K**-0.5, seed=71)
    b = randn(N, dtype=dtype, seed=72) if bias else None
    full = matmul(x, w, b, config=MATMUL_CONFIGS[dtype])
    tiles = [(bm, bn, 64, 5) for bm, bn in _TILE_FAMILY] + list(_DECODE_FAMILY)
    tiles += [(bm, bn, *_MID_K[bn]) for bm, bn in _TILE_FAMILY]
    for bm, bn, bk, stages in tiles:
        cfg = MatmulConfig(bm, bn, bk, 8, 4, stages)
        for m, off in ((1, 0), (1, 211), (5, 37), (64, 236), (200, 100)):
            y = matmul(x[off : off + m], w, b, config=cfg)
            assert torch.equal(y, full[off : off + m]), f"tile {bm}x{bn}x{bk}: rows {off}..{off + m} differ"
    picked = {
        (tile_config(m, N, 132, dtype).block_m, tile_config(m, N, 132, dtype).block_n) for m in (1, 64, 256)
    }
    assert picked <= set(_TILE_FAMILY) | {(128, 128)}
    for m in (1, 3, 64, 100, 256, 300):  # the selection the exact ops make, whatever tile it picks here
        assert torch.equal(ops.linear(x[:m], w, b), full[:m])
    flipped = matmul(x[:64].flip(1).contiguous(), w.flip(1).contiguous(), b, config=MATMUL_CONFIGS[dtype])
    assert not torch.equal(flipped, full[:64]), "negative control: another K order should change some bits"
