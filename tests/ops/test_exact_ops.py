"""Row-invariance of every exact op on this machine: rows of an m-row call must be bitwise equal (torch.equal)
to the same rows computed inside a 300-row call, wherever they sit. Each sweep has a negative control."""

import pytest
import torch

from exactrl.ops import BLOCK_N, AttentionBatch
from exactrl.ops.torch_ops import ExactTorchOps, FastOps, attention_reference

MS = [1, 2, 3, 5, 7, 8, 15, 16, 17, 64, 255, 256, 300]
FULL = 300
ops = ExactTorchOps()
fast = FastOps()
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(128, 384), (1024, 3072), (3072, 1024), (128, 259)])
def test_linear_rows_invariant(dtype, k, n):
    x = _rand(FULL, k, dtype=dtype)
    w = _rand(n, k, dtype=dtype, seed=1) * 0.05
    b = _rand(n, dtype=dtype, seed=2)
    full = ops.linear(x, w, b)
    for m in MS:
        assert torch.equal(ops.linear(x[:m], w, b), full[:m]), m
        # the same rows at another place in the call (a decode row vs a row deep inside a training batch)
        off = FULL - m
        assert torch.equal(ops.linear(x[off:], w, b), full[off:]), (m, "offset")


def test_linear_large_call_matches_small_calls():
    x = _rand(2048 + 5, 256)
    w = _rand(512, 256, seed=1)
    big = ops.linear(x, w)
    for s in (0, 7, 1000, 2050):
        assert torch.equal(ops.linear(x[s : s + 3], w), big[s : s + 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,sizes", [(64, [64, 32, 32]), (1024, [2048, 1024, 1024]), (1024, [3072, 3072])])
def test_packed_linear_equals_parts(dtype, k, sizes):
    """The model's packed q/k/v and gate/up weights: each part of the packed call has the bits of the part's own
    linear, at several row counts (an empirical fact of the CPU GEMM, guarded here)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(300, k, generator=g).to(dtype)
    w = (torch.randn(sum(sizes), k, generator=g) * k**-0.5).to(dtype)
    for m in (1, 3, 17, 300):
        outs = ops.packed_linear(x[:m], w, None, sizes)
        assert all(torch.equal(o, ops.linear(x[:m], ws)) for o, ws in zip(outs, w.split(sizes))), m


def test_linear_negative_control_fp32():
    """The default fp32 GEMM changes a row's bits with the number of rows (measured on these machines)."""
    x = _rand(FULL, 1024)
    w = _rand(3072, 1024, seed=1) * 0.05
    full = fast.linear(x, w)
    differs = [m for m in MS if not torch.equal(fast.linear(x[:m], w), full[:m])]
    assert differs, "F.linear was row-invariant for every m: the exactness sweep could not fail here"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rope_silu_rows_invariant(dtype):
    x = _rand(FULL, 4, 32, dtype=dtype)
    w = 1 + 0.1 * _rand(32, dtype=dtype, seed=3)
    pos = torch.randint(0, 500, (FULL,), generator=torch.Generator().manual_seed(4))
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    fr = torch.arange(512, dtype=torch.float64)[:, None] * inv
    cs = torch.cat((fr.cos(), fr.sin()), -1).float()
    g, u = _rand(FULL, 96, dtype=dtype, seed=5), _rand(FULL, 96, dtype=dtype, seed=6)
    full = (ops.rms_norm(x, w, 1e-6), ops.rope(x, pos, cs), ops.silu_mul(g, u))
    for m in MS:
        assert torch.equal(ops.rms_norm(x[:m], w, 1e-6), full[0][:m])
        assert torch.equal(ops.rope(x[:m], pos[:m], cs), full[1][:m])
        assert torch.equal(ops.silu_mul(g[:m], u[:m]), full[2][:m])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", [ops, fast], ids=["exact", "fast"])
def test_add_rms_norm_is_add_then_norm(dtype, backend):
    """The fused op is `x + residual` (one rounding) and rms_norm of that, in every backend; rows invariant."""
    x, r = _rand(FULL, 64, dtype=dtype), _rand(FULL, 64, dtype=dtype, seed=7)
    w = 1 + 0.1 * _rand(64, dtype=dtype, seed=8)
    normed, summed = backend.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r) and torch.equal(normed, backend.rms_norm(x + r, w, 1e-6))
    for m in MS:
        off = FULL - m
        for sl in (slice(0, m), slice(off, FULL)):
            part = backend.add_rms_norm(x[sl], r[sl], w, 1e-6)
            assert torch.equal(part[0], normed[sl]) and torch.equal(part[1], summed[sl]), (m, sl)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_rows_invariant(dtype):
    h = _rand(FULL, 128, dtype=dtype)
    w = _rand(259, 128, dtype=dtype, seed=1) * 0.1
    t = torch.randint(0, 259, (FULL,), generator=torch.Generator().manual_seed(2))
    for temp in (1.0, 0.7):
        lp, ent = ops.logprobs(h, w, t, temp, True)
        z = ops.logits(h, w, temp)
        assert torch.equal(torch.log_softmax(z, -1).gather(1, t[:, None])[:, 0], lp)
        for m in MS:
            lpm, entm = ops.logprobs(h[:m], w, t[:m], temp, True)
            assert torch.equal(lpm, lp[:m]) and torch.equal(entm, ent[:m]), m
            assert torch.equal(ops.logits(h[-m:], w, temp), z[-m:]), m


def _seqs(lens, hq=4, hkv=2, dh=32, dtype=torch.float32, seed=0):
    T = sum(lens)
    return (
        _rand(T, hq, dh, dtype=dtype, seed=seed),
        _rand(T, hkv, dh, dtype=dtype, seed=seed + 1),
        _rand(T, hkv, dh, dtype=dtype, seed=seed + 2),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_packed_rows_invariant(dtype):
    """A sequence's outputs do not depend on the other sequences packed with it."""
    lens = [FULL, 37, 5, 130]
    q, k, v = _seqs(lens, dtype=dtype)
    full = ops.attention(q, k, v, AttentionBatch.packed(lens))
    alone = ops.attention(q[:FULL], k[:FULL], v[:FULL], AttentionBatch.packed([FULL]))
    assert torch.equal(alone, full[:FULL])
    for m in MS:  # a sequence of m tokens alone vs packed with a 300-token one
        qm, km, vm = _seqs([m], dtype=dtype, seed=9)
        one = ops.attention(qm, km, vm, AttentionBatch.packed([m]))
        both = ops.attention(
            torch.cat((q[:FULL], qm)),
            torch.cat((k[:FULL], km)),
            torch.cat((v[:FULL], vm)),
            AttentionBatch.packed([FULL, m]),
        )
        assert torch.equal(one, both[FULL:]), m


def _paged_run(q, k, v, length, chunks, block_size=32, num_blocks=64, perm_seed=0):
    """Feed one sequence through the paged cache in the given chunks; blocks are scattered at random."""
    dh, hkv = k.shape[-1], k.shape[1]
    kc = torch.zeros(num_blocks, block_size, hkv, dh, dtype=k.dtype)
    vc = torch.zeros_like(kc)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(perm_seed))[
        : -(-length // block_size)
    ].tolist()
    outs, done = [], 0
    for c in chunks:
        b = AttentionBatch.paged([done], [c], [table], block_size)
        outs.append(ops.attention(q[done : done + c], k[done : done + c], v[done : done + c], b, (kc, vc)))
        done += c
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_equals_prefill_rows(dtype):
    L = 100
    q, k, v = _seqs([L], dtype=dtype, seed=3)
    packed = ops.attention(q, k, v, AttentionBatch.packed([L]))
    for chunks in ([L], [1] * L, [17, 1, 1, 50, 31], [64, 36], [3, 97]):
        assert torch.equal(_paged_run(q, k, v, L, chunks, perm_seed=len(chunks)), packed), chunks


def test_attention_paged_batch_composition():
    """Decode rows of many sequences in one step equal each sequence run alone."""
    lens = [40, 3, 77, 16]
    bs, nb = 16, 64
    seqs = [_seqs([n], seed=10 * i) for i, n in enumerate(lens)]
    alone = [ops.attention(q, k, v, AttentionBatch.packed([len(q)])) for q, k, v in seqs]
    kc = torch.zeros(nb, bs, 2, 32)
    vc = torch.zeros_like(kc)
    tables, nxt = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(list(range(nxt, nxt + need))[::-1])  # non-contiguous order on purpose
        nxt += need
    # prefill all but the last token of each, together
    pre = AttentionBatch.paged([0] * 4, [n - 1 for n in lens], tables, bs)
    ops.attention(
        torch.cat([s[0][:-1] for s in seqs]),
        torch.cat([s[1][:-1] for s in seqs]),
        torch.cat([s[2][:-1] for s in seqs]),
        pre,
        (kc, vc),
    )
    dec = AttentionBatch.paged([n - 1 for n in lens], [1] * 4, tables, bs)
    out = ops.attention(
        torch.cat([s[0][-1:] for s in seqs]),
        torch.cat([s[1][-1:] for s in seqs]),
        torch.cat([s[2][-1:] for s in seqs]),
        dec,
        (kc, vc),
    )
    for i in range(4):
        assert torch.equal(out[i], alone[i][-1])


def test_attention_negative_control():
    """The default (matmul + softmax) attention changes bits between a decode step and the packed rows."""
    L = 100
    q, k, v = _seqs([L], seed=3)
    b = AttentionBatch.packed([L])
    packed = fast.attention(q, k, v, b)
    kc = torch.zeros(8, 32, 2, 32)
    vc = torch.zeros_like(kc)
    fast.attention(q[:-1], k[:-1], v[:-1], AttentionBatch.paged([0], [L - 1], [[0, 1, 2, 3]], 32), (kc, vc))
    step = fast.attention(
        q[-1:], k[-1:], v[-1:], AttentionBatch.paged([L - 1], [1], [[0, 1, 2, 3]], 32), (kc, vc)
    )
    full = fast.attention(
        torch.cat([q] * 5), torch.cat([k] * 5), torch.cat([v] * 5), AttentionBatch.packed([L] * 5)
    )
    assert not (torch.equal(step[0], packed[-1]) and torch.equal(full[:L], packed))


def test_fully_masked_tile_is_a_no_op():
    """Walking through extra all-masked tiles (a longer neighbour in the batch) leaves results unchanged."""
    q, k, v = _seqs([BLOCK_N + 1])
    alone = ops.attention(q, k, v, AttentionBatch.packed([BLOCK_N + 1]))
    q2, k2, v2 = _seqs([20 * BLOCK_N], seed=7)
    both = ops.attention(
        torch.cat((q, q2)),
        torch.cat((k, k2)),
        torch.cat((v, v2)),
        AttentionBatch.packed([BLOCK_N + 1, 20 * BLOCK_N]),
    )
    assert torch.equal(both[: BLOCK_N + 1], alone)


def test_attention_matches_reference_values():
    lens = [33, 7, 64]
    q, k, v = _seqs(lens)
    b = AttentionBatch.packed(lens)
    torch.testing.assert_close(
        ops.attention(q, k, v, b), attention_reference(q, k, v, b), rtol=1e-5, atol=1e-5
    )


# ----------------------------------------------------------------------------------------------------------
# Gradients of the custom autograd ops against plain PyTorch references (float64 inputs are not used by the
# kernels; fp32 with a tight tolerance is the contract).
# ----------------------------------------------------------------------------------------------------------


def test_attention_gradients_match_reference():
    lens = [20, 9, 33]
    q, k, v = (t.requires_grad_(True) for t in _seqs(lens))
    b = AttentionBatch.packed(lens)
    go = _rand(sum(lens), 4, 32, seed=11)
    g1 = torch.autograd.grad(ops.attention(q, k, v, b), (q, k, v), go)
    g2 = torch.autograd.grad(attention_reference(q, k, v, b), (q, k, v), go)
    for a, r in zip(g1, g2):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprobs_gradients_match_reference(with_entropy, monkeypatch):
    import exactrl.ops.torch_ops as to

    monkeypatch.setattr(to, "LOGPROB_CHUNK_ROWS", 7)  # several chunks
    h = _rand(30, 16, seed=1).requires_grad_(True)
    w = (_rand(50, 16, seed=2) * 0.3).requires_grad_(True)
    t = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(3))
    gl, ge = _rand(30, seed=4), _rand(30, seed=5)
    lp, ent = ops.logprobs(h, w, t, 0.7, with_entropy)
    loss = (lp * gl).sum() + ((ent * ge).sum() if with_entropy else 0)
    ga = torch.autograd.grad(loss, (h, w))
    z = (h @ w.t()) / 0.7
    logp = torch.log_softmax(z, -1)
    ref = (logp.gather(1, t[:, None])[:, 0] * gl).sum()
    if with_entropy:
        ref = ref + (-(logp.exp() * logp).sum(-1) * ge).sum()
    gr = torch.autograd.grad(ref, (h, w))
    for a, r in zip(ga, gr):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_linear_and_norm_gradients_match_reference():
    x = _rand(5, 24, seed=1).requires_grad_(True)
    w = _rand(40, 24, seed=2).requires_grad_(True)
    nw = (1 + _rand(40, seed=3) * 0.1).requires_grad_(True)
    out = ops.rms_norm(ops.linear(x, w), nw, 1e-6)
    g = torch.autograd.grad(out.sum(), (x, w, nw))
    y = x @ w.t()
    ref = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    gr = torch.autograd.grad(ref.sum(), (x, w, nw))
    for a, r in zip(g, gr):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_bad_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        ops.logprobs(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), 0.0)
