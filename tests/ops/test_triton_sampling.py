"""The fused Gumbel-max kernel (`exactrl.ops.triton.sampling`) against the torch sampler, bit for bit.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU) on small shapes;
the tests marked `gpu` run the compiled kernels at serving shapes (256 rows x 151,936 vocab).
The strongest check is `test_gumbel_transform_exhaustive`: the hash gives h >> 9 in [0, 2**23), so the whole
uniform -> Gumbel map (both logarithms) is compared with the torch code on every input it can ever see.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_mode import triton_device

DEVICE = triton_device()

from exactrl.engine import sampler  # noqa: E402
from exactrl.ops.triton.sampling import (  # noqa: E402
    _gumbel_of_all_uniforms,
    fused_sampling_supported,
    gumbel_argmax,
    gumbel_noise_triton,
)

QWEN_VOCAB = 151936


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_keys(rows: int, seed: int) -> torch.Tensor:
    """Keys over the whole 62-bit range, with small ones, ones just above 2**32 and ones near 2**62."""
    g = gen(seed)
    special = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**32 + 7, 2**62 - 1, 2**62 - 2**31, 2**63 - 1])
    rand = torch.randint(0, 2**62, (rows,), generator=g, dtype=torch.int64)
    keys = torch.cat([special, rand])[torch.randperm(rows + len(special), generator=g)[:rows]]
    return keys.to(DEVICE)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=gen(seed)) * scale).to(DEVICE)


def reference(logits: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
    return sampler.sample(logits, keys, greedy=greedy)


# ------------------------------------------------------------------------------------------------------------
# The noise
# ------------------------------------------------------------------------------------------------------------


def test_gumbel_transform_exhaustive():
    """Every value u = ((h >> 9) + 0.5) * 2**-23 the hash can produce, through both logarithms."""
    got = _gumbel_of_all_uniforms(DEVICE)
    i = torch.arange(1 << 23, dtype=torch.int64, device=DEVICE)
    u = (i.to(torch.float32) + 0.5) * 2.0**-23
    # exact: u is (2i + 1) / 2**24, strictly inside (0, 1)
    assert torch.equal(u.double() * 2.0**24, (2 * i + 1).double()) and float(u.max()) < 1.0
    ref = -sampler._log(-sampler._log(u))
    assert torch.equal(got, ref), f"{int((got != ref).sum())} of 2**23 noise values differ"


def test_noise_matches_gumbel_noise_full_vocab():
    keys = torch.tensor([2**32 + 12345, 2**62 - 3], dtype=torch.int64, device=DEVICE)
    got = gumbel_noise_triton(keys, QWEN_VOCAB)
    assert got.dtype == torch.float32 and got.shape == (2, QWEN_VOCAB)
    assert torch.equal(got, sampler.gumbel_noise(keys, QWEN_VOCAB))


def test_noise_matches_gumbel_noise_many_keys():
    keys = random_keys(24, seed=1)
    assert torch.equal(gumbel_noise_triton(keys, 3001), sampler.gumbel_noise(keys, 3001))
    assert gumbel_noise_triton(keys, 0).shape == (24, 0)


def test_negative_control_noise():
    """The bitwise check is able to fail: a plausible other implementation differs in the last bits."""
    keys = random_keys(4, seed=2)
    ref = sampler.gumbel_noise(keys, 20000)
    assert torch.equal(gumbel_noise_triton(keys, 20000), ref)
    # torch.log instead of the IEEE-op logarithm
    h = ((torch.arange(20000, device=DEVICE) * 2654435761) & 0xFFFFFFFF) >> 9
    u = (h.to(torch.float32) + 0.5) * 2.0**-23
    assert not torch.equal(-torch.log(-torch.log(u)), -sampler._log(-sampler._log(u)))
    # the polynomial contracted into FMAs (one rounding per p * z + c; float64 models the single rounding)
    assert not torch.equal(-_log_fma(-_log_fma(u)), -sampler._log(-sampler._log(u)))
    # other keys, other noise
    assert not torch.equal(sampler.gumbel_noise(keys + 1, 20000), ref)


def _log_fma(x: torch.Tensor) -> torch.Tensor:
    """sampler._log for float32 with every a * b + c rounded once, as with FMA contraction."""
    m, e = torch.frexp(x)
    small = m < math.sqrt(0.5)
    m = torch.where(small, m * 2.0, m)
    e = e.to(x.dtype) - small.to(x.dtype)
    s = (m - 1.0) / (m + 1.0)
    z = (s * s).double()
    p = torch.full_like(x, 1.0 / 11)
    for k in range(4, -1, -1):
        p = (p.double() * z + torch.tensor(1.0 / (2 * k + 1)).float().double()).float()
    ln2 = torch.tensor(math.log(2.0)).float().double()
    return (e.double() * ln2 + ((s * p) * 2.0).double()).float()


# ------------------------------------------------------------------------------------------------------------
# Tokens
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows,vocab,block_v",
    # 5003, 300, 8193: a partial last slice
    [(5, 1000, None), (7, 5003, 1024), (3, 300, 16), (6, 8193, None)],
)
def test_matches_sample(rows, vocab, block_v):
    logits = random_logits(rows, vocab, seed=rows * vocab)
    keys = random_keys(rows, seed=vocab)
    assert torch.equal(gumbel_argmax(logits, keys, block_v=block_v), reference(logits, keys))
    greedy = torch.arange(rows, device=DEVICE) % 3 == 1
    got = gumbel_argmax(logits, keys, greedy, block_v=block_v)
    assert torch.equal(got, reference(logits, keys, greedy))
    assert torch.equal(got[greedy], logits[greedy].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_raw_logits_with_temperature(dtype):
    """Raw LM-head logits and a temperature (the decode graphs' form): the tokens of the pre-scaled fp32 path,
    `scaled_logits` then gumbel_argmax, bit for bit; the temperature does change them."""
    from exactrl.ops.triton.logprobs import scaled_logits

    rows, vocab = 9, 3001
    raw = random_logits(rows, vocab, seed=11, scale=0.5).to(dtype)
    keys = random_keys(rows, seed=12)
    greedy = torch.arange(rows, device=DEVICE) % 4 == 2
    got = {}
    for t in (0.7, 1.3):
        got[t] = gumbel_argmax(raw, keys, greedy, temperature=t)
        assert torch.equal(got[t], gumbel_argmax(scaled_logits(raw, t), keys, greedy)), t
    assert not torch.equal(got[0.7], got[1.3])  # negative control: the kernel does divide by T
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        gumbel_argmax(raw, keys, temperature=0.0)
    with pytest.raises(ValueError, match="logits must be torch.float32, got torch.float16"):
        gumbel_argmax(raw.to(torch.float16), keys)  # pre-scaled logits (no temperature) must be fp32


def test_many_keys_small_vocab():
    """Many rows with nearly flat logits: the token is decided by the noise, often by small differences."""
    rows, vocab = 64, 50
    logits = random_logits(rows, vocab, seed=3, scale=1e-3)
    keys = random_keys(rows, seed=4)
    greedy = torch.rand(rows, generator=gen(5)).to(DEVICE) < 0.25
    assert torch.equal(gumbel_argmax(logits, keys, greedy, block_v=32), reference(logits, keys, greedy))


def test_ties_and_special_values():
    vocab, block = 300, 64
    rows = []
    # constant: greedy takes index 0, sampling takes the noise's argmax
    rows.append(torch.full((vocab,), 0.25))
    r = torch.randn(vocab, generator=gen(6))
    r[[5, 69, 133, 200]] = 9.0  # the max tied in four lanes / slices: greedy takes 5
    rows.append(r)
    r = torch.randn(vocab, generator=gen(7))
    r[[70, 6]] = 50.0  # tie in the same lane of two slices, the later slice listed first
    rows.append(r)
    rows.append(torch.full((vocab,), float("-inf")))  # all -inf: index 0, noise or not
    r = torch.full((vocab,), -1e30)
    r[[150, 3]] = float("inf")  # +inf tied: lowest index
    rows.append(r)
    r = torch.randn(vocab, generator=gen(8))
    r[[250, 77]] = float("nan")  # NaN is the maximum for torch.argmax: the first NaN
    rows.append(r)
    r = torch.randn(vocab, generator=gen(9)) * 1e30  # huge spread: noise below the logits' ulp
    r[:10] = 3.0e38
    r[111] = 3.4e38
    rows.append(r)
    logits = torch.stack(rows).to(DEVICE)
    n = logits.shape[0]
    keys = random_keys(n, seed=10)
    for greedy in (None, torch.ones(n, dtype=torch.bool), torch.arange(n) % 2 == 0):
        greedy = None if greedy is None else greedy.to(DEVICE)
        got = gumbel_argmax(logits, keys, greedy, block_v=block)
        ref = reference(logits, keys, greedy)
        assert torch.equal(got, ref), (greedy, got, ref)
    greedy_tokens = gumbel_argmax(logits, keys, torch.ones(n, dtype=torch.bool, device=DEVICE), block_v=block)
    assert greedy_tokens.tolist()[:6] == [0, 5, 6, 0, 3, 77]


def test_vocab_split_gives_the_same_tokens(monkeypatch):
    """A few rows are cut into vocabulary slices (one program each, then `_argmax_combine_kernel`): ties across
    slices, -inf, +inf, NaN and every split from 2 slices to one per block give the reference's tokens."""
    from exactrl.ops.triton import sampling

    vocab, block = 300, 16
    r = torch.randn(6, vocab, generator=gen(20))
    r[1, [5, 69, 133, 200]] = 9.0  # the max tied in several slices: greedy takes 5
    r[2, [290, 7]] = 50.0  # a tie, the later slice first in the list
    r[3] = float("-inf")
    r[4, [150, 3]] = float("inf")
    r[5, [250, 77]] = float("nan")  # the first NaN, in a later slice than other large values
    logits = r.to(DEVICE)
    keys = random_keys(6, seed=21)
    chosen = []
    real = sampling._vocab_split
    blocks = -(-vocab // block)
    for per_row in (2, 3, 5, blocks):
        chunk = -(-blocks // per_row) * block

        def forced(rows, v, b, device, chunk=chunk):
            chosen.append(real(rows, v, b, device))
            return -(-v // chunk), chunk

        monkeypatch.setattr(sampling, "_vocab_split", forced)
        for greedy in (
            None,
            torch.arange(6, device=DEVICE) % 2 == 0,
            torch.ones(6, dtype=torch.bool, device=DEVICE),
        ):
            got = gumbel_argmax(logits, keys, greedy, block_v=block)
            assert torch.equal(got, reference(logits, keys, greedy)), (per_row, greedy, got)
    monkeypatch.setattr(sampling, "_vocab_split", real)
    greedy_tokens = gumbel_argmax(logits, keys, torch.ones(6, dtype=torch.bool, device=DEVICE), block_v=block)
    assert greedy_tokens.tolist()[1:] == [5, 7, 0, 3, 77]
    # The rule: few rows are split into whole blocks, enough rows are not.
    dev = torch.device(DEVICE)
    want = sampling._PROGRAMS_PER_SM * sampling.num_programs_cap(dev)
    assert real(want, 151936, 2048, dev) == (1, 151936)
    splits, chunk = real(1, 151936, 2048, dev)
    assert splits > 1 and chunk % 2048 == 0 and (splits - 1) * chunk < 151936 <= splits * chunk


def test_independent_of_block_rows_and_layout():
    rows, vocab = 9, 700
    logits = random_logits(rows, vocab, seed=11)
    keys = random_keys(rows, seed=12)
    greedy = torch.arange(rows, device=DEVICE) % 4 == 0
    full = gumbel_argmax(logits, keys, greedy)
    assert torch.equal(full, reference(logits, keys, greedy))
    for block in (64, 256, 1024):
        assert torch.equal(gumbel_argmax(logits, keys, greedy, block_v=block), full)
    perm = torch.randperm(rows, generator=gen(13)).to(DEVICE)
    assert torch.equal(gumbel_argmax(logits[perm], keys[perm], greedy[perm]), full[perm])
    assert torch.equal(gumbel_argmax(logits[2:5], keys[2:5], greedy[2:5]), full[2:5])
    wide = torch.zeros(rows, vocab + 37, device=DEVICE)
    wide[:, :vocab] = logits
    assert torch.equal(gumbel_argmax(wide[:, :vocab], keys, greedy), full)  # row stride != vocab
    assert torch.equal(gumbel_argmax(logits.t().contiguous().t(), keys, greedy), full)  # column-major


def test_negative_control_tokens():
    """Other keys give other tokens, so agreeing with the reference is not trivial."""
    rows, vocab = 16, 1000
    logits = torch.zeros(rows, vocab, device=DEVICE)
    keys = random_keys(rows, seed=14)
    got = gumbel_argmax(logits, keys)
    assert torch.equal(got, reference(logits, keys))
    assert not torch.equal(gumbel_argmax(logits, keys ^ 1), got)
    assert not torch.equal(reference(logits, keys ^ (1 << 40)), got)


def test_empty_and_single():
    keys = random_keys(3, seed=15)
    assert gumbel_argmax(torch.zeros(0, 10, device=DEVICE), keys[:0]).shape == (0,)
    one = random_logits(3, 1, seed=16)
    assert gumbel_argmax(one, keys).tolist() == [0, 0, 0]


def test_validation():
    logits = random_logits(2, 10, seed=17)
    keys = random_keys(2, seed=18)
    with pytest.raises(ValueError, match="2-D"):
        gumbel_argmax(logits[0], keys)
    with pytest.raises(ValueError, match="float32"):
        gumbel_argmax(logits.double(), keys)
    with pytest.raises(ValueError, match="empty vocab"):
        gumbel_argmax(logits[:, :0], keys)
    with pytest.raises(ValueError, match="shape"):
        gumbel_argmax(logits, keys[:1])
    with pytest.raises(ValueError, match="int64"):
        gumbel_argmax(logits, keys.to(torch.int32))
    with pytest.raises(ValueError, match="non-negative"):
        gumbel_argmax(logits, torch.tensor([1, -1], device=DEVICE))
    with pytest.raises(ValueError, match="greedy"):
        gumbel_argmax(logits, keys, torch.tensor([1, 0], device=DEVICE))
    with pytest.raises(ValueError, match="greedy"):
        gumbel_argmax(logits, keys, torch.tensor([True], device=DEVICE))
    with pytest.raises(ValueError, match="block_v"):
        gumbel_argmax(logits, keys, block_v=100)
    with pytest.raises(ValueError, match="non-negative"):
        gumbel_noise_triton(torch.tensor([-5], device=DEVICE), 10)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="keys are on"):
            gumbel_argmax(logits, keys.cpu())
    assert fused_sampling_supported(logits)
    assert not fused_sampling_supported(logits.double())
    assert not fused_sampling_supported(logits[0])


# ------------------------------------------------------------------------------------------------------------
# GPU, serving shapes
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("greedy_every", [0, 3])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_gpu_serving_shape(greedy_every, scale):
    rows = 256
    gen_cuda = torch.Generator(device="cuda").manual_seed(int(scale) + greedy_every)
    logits = torch.randn(rows, QWEN_VOCAB, generator=gen_cuda, device="cuda") * scale
    ids = torch.arange(rows, device="cuda")
    keys = sampler.noise_keys(7, ids, 0, ids + 100)
    keys[:3] = torch.tensor([0, 2**32, 2**62 - 1], device="cuda")
    greedy = None if not greedy_every else torch.arange(rows, device="cuda") % greedy_every == 0
    got = gumbel_argmax(logits, keys, greedy)
    assert torch.equal(got, reference(logits, keys, greedy))
    # the same bits as the CPU reference, and independent of the other rows
    greedy_cpu = None if greedy is None else greedy.cpu()
    assert torch.equal(got.cpu(), reference(logits.cpu(), keys.cpu(), greedy_cpu))
    one = None if greedy is None else greedy[5:6]
    assert torch.equal(gumbel_argmax(logits[5:6], keys[5:6], one), got[5:6])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_noise_full_vocab():
    keys = sampler.noise_keys(3, torch.arange(8, device="cuda"), 1, 5)
    got = gumbel_noise_triton(keys, QWEN_VOCAB)
    assert torch.equal(got, sampler.gumbel_noise(keys, QWEN_VOCAB))
    assert torch.equal(got.cpu(), sampler.gumbel_noise(keys.cpu(), QWEN_VOCAB))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ties_at_serving_shape():
    rows = 256
    logits = torch.zeros(rows, QWEN_VOCAB, device="cuda")
    logits[:, 150_000] = 5.0
    logits[:, 70_000] = 5.0
    logits[:, 99_999] = 5.0
    keys = sampler.noise_keys(11, torch.arange(rows, device="cuda"), 0, 0)
    greedy = torch.arange(rows, device="cuda") % 2 == 0
    got = gumbel_argmax(logits, keys, greedy)
    assert torch.equal(got, reference(logits, keys, greedy))
    assert bool((got[greedy] == 70_000).all())


def test_key_parts_equal_precomputed_keys():
    """The kernel's own noise_key from (seed, request_id, sample_index, position) gives the tokens of the keys
    noise_keys computes; a different sample index gives other tokens (the check can fail)."""
    rows, vocab = 6, 3001
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, vocab, generator=g).to(DEVICE)
    parts = torch.stack(
        [
            torch.tensor([0, 1, 2**40 + 3, 5, 2**62, 2**63 - 1]),
            torch.tensor([0, 7, 123456789012, 3, 1, 2**33]),
            torch.tensor([0, 0, 1, 2**31, 4, 9]),
            torch.tensor([1, 17, 2**35, 64, 0, 4095]),
        ]
    ).to(DEVICE)
    keys = sampler.noise_keys(parts[0], parts[1], parts[2], parts[3])
    want = gumbel_argmax(logits, keys)
    assert torch.equal(gumbel_argmax(logits, None, key_parts=parts), want)
    assert torch.equal(want, sampler.sample(logits, keys))
    other = parts.clone()
    other[2] += 1
    assert not torch.equal(gumbel_argmax(logits, None, key_parts=other), want)
    with pytest.raises(ValueError, match="key_parts must be an int64 tensor"):
        gumbel_argmax(logits, None, key_parts=parts[:3])
    with pytest.raises(ValueError, match="not both"):
        gumbel_argmax(logits, keys, key_parts=parts)
