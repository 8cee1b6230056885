"""The logprob kernel's vocabulary chunks: the split form (one program per (row, chunk) + a combine kernel), the
unsplit form (one program per row) and the training path (`logprobs`, autograd, kept or recomputed logits) give
every row the same logprob and entropy bits (exactrl/ops/triton/logprobs.py).

Runs everywhere: without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before the
kernels are first imported), on small vocabularies with a small slice and chunk passed in so that a row spans
several chunks and the last one is partial. The `gpu` test repeats the comparison at the real vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import triton_device

DEVICE = triton_device()

from exactrl.ops.triton import common  # noqa: E402
from exactrl.ops.triton import logprobs as lpm  # noqa: E402

# Slice and chunk for the interpreter: 64-wide slices, chunks of 3 slices; V = 424 is not a multiple of the chunk
# (2 full chunks of 192 and a last one of 40 columns, less than a slice): several chunks, the last one partial, are
# what the comparisons need; the interpreter's cost is per slice of every row (V = 1000, 5 full chunks: the module
# took 21 s on one thread of a 2-core CPU machine, 13 s with 424; 2026-11-29). The masked vocabulary below needs
# more chunks: V_MASKED.
BLOCK_V, SPLIT_COLS, V, D = 64, 192, 424, 64
V_MASKED = 1000  # 5 full chunks and a partial one: a dropped chunk, finite ones after it, a -inf tail of two
TEMP = 0.7


def _head(rows: int, vocab: int, dim: int, dtype: torch.dtype, seed: int, device: str = DEVICE):
    """(hidden [rows, dim], weight [vocab, dim]) like a trained LM head's: hidden states share a direction (as
    post-norm states do) and a handful of tokens point along it, so their logits stand up to ~20 above the bulk
    (std ~2), one of them in the last, partial chunk. How far along it varies by row: confident rows and flat ones."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(dim, generator=g)
    shared /= shared.norm()
    hidden = torch.randn(rows, dim, generator=g) + 3.0 * torch.rand(rows, 1, generator=g) * shared
    weight = torch.randn(vocab, dim, generator=g) * (2.0 / dim**0.5)
    hot = torch.cat([torch.randint(0, vocab, (5,), generator=g), torch.tensor([vocab - 3])])
    weight[hot] += 6.0 * shared
    return hidden.to(dtype).to(device), weight.to(dtype).to(device), hot


def _targets(rows: int, vocab: int, chunk: int, hot: torch.Tensor, seed: int, device: str = DEVICE):
    """Targets at the chunk edges (first and last column of chunks, the last partial chunk, V - 1), at the favoured
    tokens, and at random columns."""
    edges = [
        0,
        chunk - 1,
        chunk,
        2 * chunk - 1,
        2 * chunk,
        min((vocab // chunk) * chunk, vocab - 1),
        vocab - 1,
    ]
    g = torch.Generator().manual_seed(seed)
    pool = torch.cat([torch.tensor(edges), hot, torch.randint(0, vocab, (rows,), generator=g)])
    return pool[:rows].to(device) if rows <= len(pool) else pool.repeat(rows)[:rows].to(device)


def _forms(raw: torch.Tensor, targets: torch.Tensor, split: bool | None, **kw):
    lp, ent, _ = lpm.logprobs_from_logits(
        raw, targets, TEMP, split, split_cols=kw.get("split_cols", SPLIT_COLS), block_v=BLOCK_V
    )
    return lp, ent


@pytest.fixture
def small_chunks(monkeypatch):
    """The module's slice and chunk set to the test's, so the training path (which passes none) uses them."""
    monkeypatch.setattr(lpm, "_BLOCK_V", BLOCK_V)
    monkeypatch.setattr(lpm, "LOGPROB_SPLIT_COLS", SPLIT_COLS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.extended)])
def test_split_unsplit_and_training_path_give_the_same_bits(dtype, small_chunks, monkeypatch):
    """24 rows (every chunk-edge and favoured target among them): split == unsplit == `logprobs` without grad, with
    grad keeping the logits, and with grad recomputing them in row chunks of 16 (the last one partial); the rows of
    1-, 2- and 7-row calls of either form equal the 24-row call's."""
    R = 24  # the interpreter's cost is per (row, chunk) program: 40 rows took 14 s of make test
    hidden, weight, hot = _head(R, V, D, dtype, seed=1)
    targets = _targets(R, V, SPLIT_COLS, hot, seed=2)
    raw = lpm.matmul(
        hidden, weight
    )  # the LM head's GEMM, as the engine's decode step and the kept path run it
    lp_u, ent_u = _forms(raw, targets, split=False)
    lp_s, ent_s = _forms(raw, targets, split=True)
    assert torch.equal(lp_s, lp_u) and torch.equal(ent_s, ent_u)
    with torch.no_grad():
        lp_t, ent_t = lpm.logprobs(hidden, weight, targets, TEMP, with_entropy=True)
    assert torch.equal(lp_t, lp_u) and torch.equal(ent_t, ent_u)
    h = hidden.clone().requires_grad_(True)
    lp_k, ent_k = lpm.logprobs(h, weight, targets, TEMP, with_entropy=True)  # small: keeps its logits
    assert lp_k.requires_grad and torch.equal(lp_k.detach(), lp_u) and torch.equal(ent_k.detach(), ent_u)
    monkeypatch.setattr(lpm, "LOGPROB_KEEP_BYTES", 0)
    lp_r, ent_r = lpm.logprobs(h, weight, targets, TEMP, with_entropy=True, chunk_rows=16)
    assert torch.equal(lp_r.detach(), lp_u) and torch.equal(ent_r.detach(), ent_u)
    for m in (1, 2, 7):
        for split in (True, False):
            lp_m, ent_m = _forms(raw[:m], targets[:m], split=split)
            assert torch.equal(lp_m, lp_u[:m]) and torch.equal(ent_m, ent_u[:m]), (m, split)


def test_close_to_float64_and_gradient_unchanged(small_chunks, monkeypatch):
    """Accuracy (not exactness): logprob, entropy and lse near a float64 log_softmax; the backward, which reads the
    chunked forward's lse, gives gradients near float64 autograd's, with kept and with recomputed logits."""
    R = 24
    hidden, weight, hot = _head(R, V, D, torch.float32, seed=3)
    targets = _targets(R, V, SPLIT_COLS, hot, seed=4)
    raw = lpm.matmul(hidden, weight)
    z = raw.double() / TEMP
    logp = torch.log_softmax(z, -1)
    ref_lp, ref_ent = logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    for split in (True, False):
        lp, ent, lse = lpm.logprobs_from_logits(
            raw, targets, TEMP, split, split_cols=SPLIT_COLS, block_v=BLOCK_V
        )
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-5)
        torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), rtol=0, atol=2e-5)
    g_lp = torch.randn(R, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    g_ent = torch.randn(R, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    hr, wr = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp = torch.log_softmax((hr @ wr.T) / TEMP, -1)
    r_lp, r_ent = logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    ((r_lp * g_lp.double()).sum() + (r_ent * g_ent.double()).sum()).backward()
    for keep_bytes in (lpm.LOGPROB_KEEP_BYTES, 0):
        monkeypatch.setattr(lpm, "LOGPROB_KEEP_BYTES", keep_bytes)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = lpm.logprobs(h, w, targets, TEMP, with_entropy=True, chunk_rows=8)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        for got, ref in ((h.grad, hr.grad), (w.grad, wr.grad)):
            err = ((got.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (keep_bytes, err)


def test_another_chunk_size_gives_other_bits():
    """Negative control: the comparisons above can see a change of the chunked arithmetic. A chunk of 2 slices
    instead of 3 (the same slices, another grouping) gives rows other bits, in both forms. It shows in the entropy
    (lse - SZ / S carries the chunk sums' rounding); a logprob, zt - lse, mostly absorbs a last-bit change of the
    sum S into lse's rounding, which is why every exactness check here compares both."""
    R = 24
    hidden, weight, hot = _head(R, V, D, torch.bfloat16, seed=1)
    targets = _targets(R, V, SPLIT_COLS, hot, seed=2)
    raw = lpm.matmul(hidden, weight)
    lp, ent = _forms(raw, targets, split=False)
    for split in (True, False):
        other_lp, other_ent = _forms(raw, targets, split=split, split_cols=2 * BLOCK_V)
        assert not torch.equal(other_ent, ent), split
        torch.testing.assert_close(other_lp, lp, rtol=0, atol=1e-5)  # the same numbers up to rounding
        torch.testing.assert_close(other_ent, ent, rtol=0, atol=1e-5)


def test_long_chunks_loop_with_the_same_bits():
    """A chunk of more slices than are unrolled (_UNROLL_SLICES) walks them in a loop: both forms agree there too,
    and with one chunk covering the whole row (the kernel before the chunks) as well."""
    R = 7
    hidden, weight, hot = _head(R, V, D, torch.bfloat16, seed=13)
    targets = _targets(R, V, 5 * BLOCK_V, hot, seed=14)
    raw = lpm.matmul(hidden, weight)
    assert 5 > lpm._UNROLL_SLICES.value
    for chunk in (5 * BLOCK_V, 16 * BLOCK_V):
        lp_s, ent_s = _forms(raw, targets, split=True, split_cols=chunk)
        lp_u, ent_u = _forms(raw, targets, split=False, split_cols=chunk)
        assert torch.equal(lp_s, lp_u) and torch.equal(ent_s, ent_u), chunk


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("dropped", [0, 1])
def test_chunks_of_minus_inf_are_exact_no_ops(split, dropped):
    """A masked vocabulary (-inf logits): a chunk with no finite entry, first or later, leaves the row's total bit
    for bit as it was (the logits with that chunk and the -inf tail cut out, the other chunk boundaries unmoved,
    give the same bits), and a -inf logit inside a chunk gives no NaN (entropy included)."""
    R, cut = 6, 4 * SPLIT_COLS
    hidden, weight, _ = _head(R, V_MASKED, D, torch.float32, seed=7)
    raw = lpm.matmul(hidden, weight)
    lo, hi = dropped * SPLIT_COLS, (dropped + 1) * SPLIT_COLS
    masked = raw.clone()
    masked[:, lo:hi] = float("-inf")
    masked[:, cut:] = float("-inf")  # chunk 4 and the partial chunk 5 hold no finite logit either
    inside = 2 * SPLIT_COLS + 7
    masked[:, inside] = float("-inf")  # and one -inf inside a chunk that has finite ones
    kept = torch.cat([torch.arange(0, lo), torch.arange(hi, cut)]).to(DEVICE)
    g = torch.Generator().manual_seed(8)
    at = torch.randint(0, len(kept), (R,), generator=g).to(DEVICE)
    at[0], at[1] = 0, len(kept) - 1  # the first and the last finite column
    at[kept[at] == inside] += 1  # not the -inf column: its logprob is -inf
    lp, ent = _forms(masked, kept[at], split=split)
    lp_cut, ent_cut = _forms(masked[:, kept].contiguous(), at, split=split)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.equal(lp, lp_cut) and torch.equal(ent, ent_cut)


def test_automatic_choice_splits_rows_of_several_chunks(monkeypatch):
    """split=None runs the split form (its combine kernel launches) for rows of more than one chunk, few rows or
    many, and the unsplit form when the row is one chunk; the same bits either way (above)."""
    launches: list[int] = []
    real = lpm._logprob_combine_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid[0])
            return real[grid]

    monkeypatch.setattr(lpm, "_logprob_combine_kernel", Counting())
    cap = common.num_programs_cap(torch.device(DEVICE))
    hidden, weight, hot = _head(cap, V, D, torch.bfloat16, seed=9)
    raw = lpm.matmul(hidden, weight)
    targets = _targets(cap, V, SPLIT_COLS, hot, seed=10)
    few = 3
    lp_few, _ = _forms(raw[:few], targets[:few], split=None)
    lp_all, _ = _forms(raw, targets, split=None)
    assert launches == [few, cap]
    _forms(
        raw[:1, :SPLIT_COLS].contiguous(), targets[:1] % SPLIT_COLS, split=None
    )  # one chunk: nothing to split
    assert launches == [few, cap] and torch.equal(lp_few, lp_all[:few])


def test_chunk_must_be_whole_slices():
    raw = torch.zeros(2, 300, device=DEVICE)
    targets = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"vocabulary chunk \(100\) must be a multiple of the slice \(64\)"):
        lpm.logprobs_from_logits(raw, targets, 1.0, split_cols=100, block_v=64)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        lpm.logprobs_from_logits(raw, targets, 1.0, split_cols=96, block_v=48)


# ------------------------------------------------------------------------------------------------------------
# GPU: the real vocabulary and slice
# ------------------------------------------------------------------------------------------------------------

VOCAB, HIDDEN = 151936, 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_real_vocabulary_split_unsplit_training_path():
    """qwen3's vocabulary with the module's slice and chunk (19 chunks, the last partial): bf16 raw logits of a
    random LM head; for 1, 2, 7, 64 and 300 rows the split form, the unsplit form and the training path
    (`logprobs`, no grad and keeping its logits under autograd) give equal logprobs and entropies, and equal the
    300-row call's rows. Negative control: a chunk one slice longer gives some row another entropy."""
    from exactrl.ops import set_exact_environment

    set_exact_environment(True)
    R = 300
    hidden, weight, hot = _head(R, VOCAB, HIDDEN, torch.bfloat16, seed=11, device="cuda")
    chunk = lpm.LOGPROB_SPLIT_COLS
    targets = _targets(R, VOCAB, chunk, hot, seed=12, device="cuda")
    raw = lpm.matmul(hidden, weight)
    full_lp, full_ent, _ = lpm.logprobs_from_logits(raw, targets, TEMP, False)
    for m in (1, 2, 7, 64, R):
        for split in (True, False, None):
            lp, ent, _ = lpm.logprobs_from_logits(raw[:m], targets[:m], TEMP, split)
            assert torch.equal(lp, full_lp[:m]) and torch.equal(ent, full_ent[:m]), (m, split)
        with torch.no_grad():
            lp_t, ent_t = lpm.logprobs(hidden[:m], weight, targets[:m], TEMP, with_entropy=True)
        assert torch.equal(lp_t, full_lp[:m]) and torch.equal(ent_t, full_ent[:m]), m
        h = hidden[:m].clone().requires_grad_(True)
        lp_k, ent_k = lpm.logprobs(h, weight, targets[:m], TEMP, with_entropy=True)
        assert torch.equal(lp_k.detach(), full_lp[:m]) and torch.equal(ent_k.detach(), full_ent[:m]), m
    for split in (True, False):  # the entropy shows it (see test_another_chunk_size_gives_other_bits)
        _, other, _ = lpm.logprobs_from_logits(raw, targets, TEMP, split, split_cols=chunk + lpm._BLOCK_V)
        assert not torch.equal(other, full_ent), split
    ref = torch.log_softmax(raw.double() / TEMP, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(full_lp.double(), ref, rtol=0, atol=1e-4)
