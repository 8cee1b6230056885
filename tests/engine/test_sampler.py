import math

import pytest
import torch

from exactrl.engine.sampler import (
    SamplingParams,
    apply_temperature,
    find_stop_string,
    gumbel_noise,
    noise_key,
    noise_keys,
    sample,
)


def _keys(seed: int, rows: int, request_id: int = 0) -> torch.Tensor:
    return noise_keys(seed, request_id, 0, torch.arange(rows))


def test_noise_keys_match_the_scalar_version():
    req = torch.tensor([0, 1, 7, 2**40, 3])
    smp = torch.tensor([0, 0, 3, 1, 2**33])
    pos = torch.tensor([0, 5, 9, 2**31 + 5, 1])
    for seed in (0, 1, 2**62 + 12345):
        keys = noise_keys(seed, req, smp, pos)
        assert keys.dtype == torch.int64
        expect = [noise_key(seed, int(r), int(s), int(p)) for r, s, p in zip(req, smp, pos)]
        assert keys.tolist() == expect
        assert all(0 <= k < 2**62 for k in expect)


def test_noise_keys_do_not_collide_on_a_grid():
    r, s, p = torch.meshgrid(torch.arange(20), torch.arange(8), torch.arange(64), indexing="ij")
    keys = torch.cat([noise_keys(seed, r.flatten(), s.flatten(), p.flatten()) for seed in (0, 1, 2)])
    assert keys.unique().numel() == keys.numel()


def test_noise_key_validates():
    with pytest.raises(ValueError, match="position"):
        noise_key(0, 0, 0, -1)
    with pytest.raises(ValueError, match="seed"):
        noise_key(2**63, 0, 0, 0)
    with pytest.raises(ValueError, match="request_id"):
        noise_keys(0, torch.tensor([-1]), 0, 0)


def test_gumbel_noise_moments():
    g = gumbel_noise(_keys(3, 4), 50_000)
    assert g.dtype == torch.float32 and g.shape == (4, 50_000)
    assert abs(float(g.mean()) - 0.5772156649) < 0.01
    assert abs(float(g.std()) - math.pi / math.sqrt(6)) < 0.01
    assert not torch.equal(g[0], g[1])


def _random_setup(rows: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::17, 5] = float("-inf")  # some masked vocab entries
    logits[::13, :] = torch.round(logits[::13, :])  # many exact ties
    keys = _keys(seed, rows)
    top_k = torch.randint(0, 20, (rows,), generator=gen) * (torch.rand(rows, generator=gen) < 0.5)
    top_p = torch.where(
        torch.rand(rows, generator=gen) < 0.5, torch.rand(rows, generator=gen) * 0.9 + 0.05, 1.0
    )
    greedy = torch.rand(rows, generator=gen) < 0.2
    return logits, keys, top_k, top_p, greedy


def test_row_result_does_not_depend_on_the_batch():
    logits, keys, top_k, top_p, greedy = _random_setup(301, 1000)
    full = sample(logits, keys, top_k=top_k, top_p=top_p, greedy=greedy)
    chunked = sample(logits, keys, top_k=top_k, top_p=top_p, greedy=greedy, max_chunk_elements=7000)
    assert torch.equal(full, chunked)
    perm = torch.randperm(301, generator=torch.Generator().manual_seed(1))
    permuted = sample(logits[perm], keys[perm], top_k=top_k[perm], top_p=top_p[perm], greedy=greedy[perm])
    assert torch.equal(permuted, full[perm])
    for r in range(0, 301, 3):
        sl = slice(r, r + 1)
        alone = sample(logits[sl], keys[sl], top_k=top_k[sl], top_p=top_p[sl], greedy=greedy[sl])
        assert torch.equal(alone, full[sl]), r
    # Rows without filtering give the same token whether or not other rows of the call filter.
    plain = (top_k == 0) & (top_p == 1) & ~greedy
    assert torch.equal(sample(logits[plain], keys[plain]), full[plain])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


def test_gumbel_max_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 60_000
    tokens = sample(logits.expand(n, -1).contiguous(), _keys(11, n))
    counts = torch.bincount(tokens, minlength=6).double()
    # df = 5: P(chi2 > 25) ~ 1.4e-4, a loose bound that still catches a biased sampler.
    assert _chi_square(counts, torch.softmax(logits.double(), 0)) < 25


def test_top_k_and_top_p_renormalise():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    rows = logits.expand(n, -1).contiguous()
    tokens = sample(rows, _keys(5, n), top_k=torch.full((n,), 3))
    probs = torch.softmax(logits.double(), 0)
    probs[3:] = 0
    assert _chi_square(torch.bincount(tokens, minlength=6).double(), probs / probs.sum()) < 20
    # softmax = [.57, .21, .13, .08, ...]: top_p = 0.8 keeps the first three tokens.
    tokens = sample(rows, _keys(6, n), top_p=torch.full((n,), 0.8))
    assert _chi_square(torch.bincount(tokens, minlength=6).double(), probs / probs.sum()) < 20


def test_filters_only_pick_allowed_tokens():
    logits, keys, _, _, _ = _random_setup(400, 300, seed=2)
    gen = torch.Generator().manual_seed(3)
    top_k = torch.randint(1, 30, (400,), generator=gen)
    top_p = torch.rand(400, generator=gen) * 0.95 + 0.01
    probs = torch.softmax(logits.double(), -1)
    srt = torch.sort(logits, -1, descending=True).values
    tok_k = sample(logits, keys, top_k=top_k)
    tok_p = sample(logits, keys, top_p=top_p)
    for r in range(400):
        kth = srt[r, top_k[r] - 1]
        assert logits[r, tok_k[r]] >= kth
        # Mass strictly above the chosen token's value must be below p (else it was outside the nucleus).
        above = probs[r][logits[r] > logits[r, tok_p[r]]].sum()
        assert above < top_p[r] + 1e-9
    # top_k = 1 and tiny top_p keep only the largest value (all tokens tied with it, which the noise picks from).
    best = logits.max(-1).values
    for tok in (
        sample(logits, keys, top_k=torch.ones(400, dtype=torch.long)),
        sample(logits, keys, top_p=torch.full((400,), 1e-6)),
    ):
        assert torch.equal(logits.gather(1, tok[:, None])[:, 0], best)


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits, keys, _, _, _ = _random_setup(50, 100)
    logits[0] = 0.0
    logits[0, 7] = logits[0, 42] = 5.0
    greedy = torch.ones(50, dtype=torch.bool)
    out = sample(logits, keys, greedy=greedy)
    assert torch.equal(out, logits.argmax(-1)) and out[0] == 7


def test_seeds():
    logits = torch.zeros(500, 1000)
    a = sample(logits, _keys(1, 500))
    assert torch.equal(a, sample(logits, _keys(1, 500)))
    b = sample(logits, _keys(2, 500))
    assert (a != b).float().mean() > 0.95
    c = sample(logits, _keys(1, 500, request_id=1))
    assert (a != c).float().mean() > 0.95
    assert len(set(a.tolist())) > 300  # uniform logits spread over the vocab


def test_apply_temperature():
    logits = torch.tensor([[2.0, 4.0], [1.0, 3.0]])
    out = apply_temperature(logits, torch.tensor([2.0, 0.0]))
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [1.0, 3.0]]))
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(logits, torch.tensor([-1.0, 1.0]))


def test_sample_validates_arguments():
    logits = torch.zeros(2, 5)
    keys = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, keys, top_p=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, keys, top_p=torch.tensor([1.5, 1.0]))
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, keys, top_k=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, keys, top_k=torch.tensor([3]))
    with pytest.raises(ValueError, match="keys"):
        sample(logits, torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="greedy"):
        sample(logits, keys, greedy=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="logits"):
        sample(logits.half(), keys)
    assert sample(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("top_k", 2.5),
        ("max_tokens", 0),
        ("stop_token_ids", [-3]),
        ("stop", [""]),
        ("stop", "abc"),
        ("seed", -1),
        ("n", 0),
    ],
)
def test_sampling_params_validate_names_the_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        params.validate()


def test_sampling_params_defaults():
    p = SamplingParams().validate()
    fields = (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop_token_ids, p.stop, p.seed, p.n)
    assert fields == (1.0, 1.0, 0, 64, [], [], 0, 1)
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_find_stop_string():
    stops = ["</answer>", "\n\n"]
    text = ""
    found = None
    for piece in ["The answer", " is 4</ans", "wer> and more"]:
        start = len(text)
        text += piece
        found = find_stop_string(text, stops, start)
        if found is not None:
            break
    assert found == text.index("</answer>") == 15
    # Only matches ending in the new tail count; the earliest one wins.
    assert find_stop_string("ab\n\nxy</answer>", stops, 0) == 2
    assert find_stop_string("ab\n\nxy", stops, 5) is None
    assert find_stop_string("ab\n\nxy\n\n", stops, 7) == 6
    assert find_stop_string("anything", [], 0) is None
    with pytest.raises(ValueError):
        find_stop_string("x", [""], 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_and_cuda_draw_the_same_tokens():
    logits, keys, top_k, top_p, greedy = _random_setup(257, 3000, seed=4)
    cpu = sample(logits, keys, top_k=top_k, top_p=top_p, greedy=greedy)
    gpu = sample(logits.cuda(), keys.cuda(), top_k=top_k.cuda(), top_p=top_p.cuda(), greedy=greedy.cuda())
    assert torch.equal(cpu, gpu.cpu())
    assert torch.equal(gumbel_noise(keys, 3000), gumbel_noise(keys.cuda(), 3000).cpu())
