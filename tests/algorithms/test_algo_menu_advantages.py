"""The menu's advantage estimators (REINFORCE++, REINFORCE++-baseline, ReMax, GPG, OPO), the token-weighted
whitening, the `compute_advantages` dispatch and the adaptive KL controller, against plain float64 loops."""

from __future__ import annotations

import json
import math

import pytest
import torch

from exactrl.algorithms import (
    SEQUENCE_ESTIMATORS,
    KLController,
    compute_advantages,
    gae,
    gae_advantages,
    gpg_advantages,
    masked_whiten,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    weighted_whiten,
)

F64 = torch.float64


def batch(seed: int, groups: int = 6, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards [groups * size] with binary, continuous and all-equal groups; lengths [N] with a zero."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, (groups, size), generator=gen).to(F64)
    r[: groups // 2] += torch.rand(groups // 2, size, generator=gen, dtype=F64)
    r[-1] = 0.1  # equal values whose float mean is not exactly 0.1
    r[-2] = 1.0
    lengths = torch.randint(1, 40, (groups * size,), generator=gen)
    lengths[3] = 0
    return r.reshape(-1), lengths


# ------------------------------------------------------------------------------------------- loop references


def ref_whiten(xs: list[float], ws: list[int]) -> list[float]:
    tokens = [x for x, w in zip(xs, ws) for _ in range(w)]
    if not tokens or max(tokens) == min(tokens):
        return [0.0] * len(xs)
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / max(len(tokens) - 1, 1)
    return [(x - mean) / math.sqrt(var + 1e-8) if w > 0 else 0.0 for x, w in zip(xs, ws)]


def groups_of(xs: list[float], g: int) -> list[list[float]]:
    return [xs[i : i + g] for i in range(0, len(xs), g)]


def ref_centred(r: list[float], g: int) -> list[float]:
    out = []
    for grp in groups_of(r, g):
        mean = sum(grp) / g
        out += [0.0 if max(grp) == min(grp) else x - mean for x in grp]
    return out


def ref_flat(r: list[float], g: int) -> list[bool]:
    return [max(grp) == min(grp) for grp in groups_of(r, g) for _ in grp]


def ref_rpp_baseline(r: list[float], g: int, lens: list[int]) -> list[float]:
    white = ref_whiten(ref_centred(r, g), lens)
    return [0.0 if f else a for a, f in zip(white, ref_flat(r, g))]


def ref_gpg(r: list[float], g: int) -> list[float]:
    n = len(r)
    m = sum(ref_flat(r, g))
    alpha = n / (n - m) if n > m else 1.0
    return [alpha * c for c in ref_centred(r, g)]


def ref_opo(r: list[float], g: int, lens: list[int]) -> list[float]:
    out = []
    for k, grp in enumerate(groups_of(r, g)):
        ls = lens[k * g : (k + 1) * g]
        tot = sum(ls)
        b = sum(l_ * x for l_, x in zip(ls, grp)) / tot if tot else sum(grp) / g
        out += [0.0 if max(grp) == min(grp) else x - b for x in grp]
    return out


def close(got: torch.Tensor, want: list[float]) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ estimators


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_whiten_matches_loops_and_masked_whiten(seed: int) -> None:
    r, lens = batch(seed)
    close(weighted_whiten(r, lens), ref_whiten(r.tolist(), lens.tolist()))
    close(weighted_whiten(r), ref_whiten(r.tolist(), [1] * len(r)))
    # The same as whitening the [N, T] tensor that repeats each value over its response's tokens.
    mask = torch.arange(int(lens.max()))[None, :] < lens[:, None]
    expanded = masked_whiten(r[:, None].expand_as(mask), mask)
    got = weighted_whiten(r, lens)
    torch.testing.assert_close(expanded, torch.where(mask, got[:, None], 0.0), rtol=1e-12, atol=1e-12)


def test_weighted_whiten_all_equal_is_exactly_zero() -> None:
    x = torch.full((7,), 0.1, dtype=torch.float32)
    assert torch.equal(weighted_whiten(x), torch.zeros(7))
    # A response without tokens does not count: the others are all equal, so everything is 0.
    lens = torch.tensor([0, 3, 3, 3, 3, 3, 3])
    x2 = torch.tensor([5.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])  # the odd one out has no tokens: still all-equal
    assert torch.equal(weighted_whiten(x2, lens), torch.zeros(7))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_estimators_match_loops(seed: int, group_size: int) -> None:
    r, lens = batch(seed, groups=24 // group_size, size=group_size)
    rl, ll = r.tolist(), lens.tolist()
    close(reinforce_plus_plus_advantages(r, lens), ref_whiten(rl, ll))
    close(reinforce_plus_plus_baseline_advantages(r, group_size, lens), ref_rpp_baseline(rl, group_size, ll))
    close(gpg_advantages(r, group_size), ref_gpg(rl, group_size))
    close(opo_advantages(r, group_size, lens), ref_opo(rl, group_size, ll))
    base = torch.linspace(0, 1, len(r) // group_size, dtype=F64)
    close(
        remax_advantages(r, base, group_size), [x - base.tolist()[i // group_size] for i, x in enumerate(rl)]
    )


def test_flat_groups_give_exactly_zero() -> None:
    r, lens = batch(5)
    flat = torch.tensor(ref_flat(r.tolist(), 4))
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "opo"):
        for whiten in (False, True):
            adv, _ = compute_advantages(name, r, 4, lengths=lens, whiten=whiten)
            assert torch.equal(adv[flat], torch.zeros(int(flat.sum()), dtype=F64)), (name, whiten)
            assert bool((adv[~flat] != 0).any()), name


def test_gpg_alpha_is_the_share_of_informative_responses() -> None:
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # second group flat: M = 4, alpha = 8 / 4
    adv, metrics = compute_advantages("gpg", r, 4)
    assert metrics["advantages/gpg_alpha"] == 2.0
    assert adv.tolist() == [0.5, -1.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_opo_baseline_is_length_weighted() -> None:
    r = torch.tensor([1.0, 0.0], dtype=F64)
    adv = opo_advantages(r, 2, torch.tensor([1, 3]))  # b = (1 * 1 + 3 * 0) / 4 = 0.25
    assert adv.tolist() == [0.75, -0.25]


def test_remax_metrics_and_shapes() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv, metrics = compute_advantages("remax", r, 2, baseline_rewards=torch.tensor([0.0, 1.0]))
    assert adv.tolist() == [1.0, 0.0, -1.0, -1.0]
    assert metrics == {"remax/baseline_reward_mean": 0.5, "remax/above_baseline_frac": 0.25}
    with pytest.raises(ValueError, match="one greedy reward per prompt"):
        remax_advantages(r, torch.zeros(4), 2)
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantages("remax", r, 2)


def test_dispatch_names_and_errors() -> None:
    r, lens = batch(3)
    base = torch.zeros(len(r) // 4, dtype=F64)
    for name in SEQUENCE_ESTIMATORS:
        adv, _ = compute_advantages(name, r, 4, lengths=lens, baseline_rewards=base)
        assert adv.shape == r.shape and bool(torch.isfinite(adv).all()), name
    # grpo honours adv_scale; dr_grpo is grpo without the division.
    g_none, _ = compute_advantages("grpo", r, 4, adv_scale="none")
    dr, _ = compute_advantages("dr_grpo", r, 4)
    assert torch.equal(g_none, dr)
    with pytest.raises(ValueError, match="gae_advantages"):
        compute_advantages("gae", r, 4)
    with pytest.raises(ValueError, match="advantage must be one of"):
        compute_advantages("ppo", r, 4)
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages("opo", r, 4)
    with pytest.raises(ValueError, match="lengths must be"):
        compute_advantages("reinforce_plus_plus", r, 4, lengths=lens[:-1])


def test_whiten_flag_normalises_over_tokens() -> None:
    r, lens = batch(4)
    adv, _ = compute_advantages("rloo", r, 4, lengths=lens, whiten=True)
    raw, _ = compute_advantages("rloo", r, 4, lengths=lens)
    want = ref_whiten(raw.tolist(), lens.tolist())
    flat = ref_flat(r.tolist(), 4)
    close(adv, [0.0 if f else w for w, f in zip(want, flat)])
    # The reinforce_plus_plus estimators are normalised already: whiten changes nothing.
    a1, _ = compute_advantages("reinforce_plus_plus", r, 4, lengths=lens, whiten=True)
    assert torch.equal(a1, reinforce_plus_plus_advantages(r, lens))


def test_gae_advantages_whiten_policy_targets_not_returns() -> None:
    gen = torch.Generator().manual_seed(0)
    rew, val = torch.randn(4, 6, generator=gen, dtype=F64), torch.randn(4, 6, generator=gen, dtype=F64)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 3, 1, 4])[:, None]
    a0, ret0 = gae(rew, val, mask, 1.0, 0.95)
    a1, ret1 = gae_advantages(rew, val, mask, 1.0, 0.95, whiten=True)
    assert torch.equal(ret0, ret1)
    assert torch.equal(a1, masked_whiten(a0, mask))
    assert torch.equal(gae_advantages(rew, val, mask, 1.0, 0.95, whiten=False)[0], a0)


# ------------------------------------------------------------------------------------------ KL controller


def test_adaptive_kl_controller_matches_the_paper_rule() -> None:
    ctl = KLController("adaptive", 0.05, target=0.1, horizon=1000)
    beta = 0.05
    for kl, n in [(0.3, 64), (0.12, 64), (0.0, 32), (0.1, 64), (0.05, 128)]:
        error = min(max(kl / 0.1 - 1.0, -0.2), 0.2)
        beta = beta * (1.0 + error * n / 1000)
        assert ctl.update(kl, n) == pytest.approx(beta, rel=1e-15)
    assert ctl.value > 0
    before = ctl.value
    assert ctl.update(float("nan"), 64) == before  # a skipped step leaves beta alone


def test_fixed_kl_controller_never_moves() -> None:
    ctl = KLController("fixed", 0.05)
    for kl in (10.0, 0.0, 0.3):
        assert ctl.update(kl, 1000) == 0.05


def test_kl_controller_state_roundtrip_through_json() -> None:
    a = KLController("adaptive", 0.05, target=0.1, horizon=100)
    a.update(1.0, 50)
    state = json.loads(json.dumps(a.state_dict()))
    b = KLController("adaptive", 0.05, target=0.1, horizon=100)
    b.load_state_dict(state)
    assert b.value == a.value != 0.05
    assert b.update(0.5, 10) == a.update(0.5, 10)
    with pytest.raises(ValueError, match="kind"):
        KLController("fixed", 0.05).load_state_dict(state)
    with pytest.raises(ValueError, match="init_coef > 0"):
        KLController("adaptive", 0.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        KLController("pid", 0.1)
