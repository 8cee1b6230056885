"""GRPO / Dr.GRPO / RLOO / GAE against plain Python loops in float64."""

from __future__ import annotations

import math

import pytest
import torch

from exactrl.algorithms import gae, grpo_advantages, rloo_advantages


def random_mask(gen: torch.Generator, b: int, t: int, holes: bool) -> torch.Tensor:
    """[b, t] bool: each row a random-length prefix (rows 0 and 1 forced to 1 and 0 valid tokens), with optional
    interior holes (e.g. tool output between turns)."""
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0], lengths[1] = 1, 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(b, t, generator=gen) > 0.25
    return mask


def grouped_rewards(gen: torch.Generator, groups: int, size: int) -> torch.Tensor:
    """Random rewards with some all-equal groups (binary rewards, plus one constant real-valued group)."""
    r = torch.randint(0, 2, (groups, size), generator=gen).double()
    r[: groups // 2] += torch.rand(groups // 2, size, generator=gen, dtype=torch.float64)  # continuous groups
    r[-1] = 0.1  # equal values whose float mean is not exactly 0.1
    return r.reshape(-1)


def ref_std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def ref_grpo(rewards: list[float], g: int, scale: str, eps: float) -> list[float]:
    batch_std = ref_std(rewards) if len(rewards) > 1 else 0.0
    out = []
    for start in range(0, len(rewards), g):
        grp = rewards[start : start + g]
        mean = sum(grp) / g
        for x in grp:
            if g == 1 or max(grp) == min(grp):
                out.append(0.0)
            elif scale == "group":
                out.append((x - mean) / (ref_std(grp) + eps))
            elif scale == "batch":
                out.append((x - mean) / (batch_std + eps))
            else:
                out.append(x - mean)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("group_size", [1, 2, 5, 8])
def test_grpo_matches_loops(scale: str, group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    r = grouped_rewards(gen, 6, group_size)
    got = grpo_advantages(r, group_size, scale=scale)  # type: ignore[arg-type]
    want = torch.tensor(ref_grpo(r.tolist(), group_size, scale, 1e-6), dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == r.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if group_size == 1:
        assert (got == 0).all()
    # The constant group gets exactly 0, not residue / eps.
    assert (got[-group_size:] == 0).all()


def test_grpo_float32_and_int_inputs() -> None:
    r = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1])
    got = grpo_advantages(r, 4)
    assert got.dtype == torch.float32
    want = ref_grpo([float(x) for x in r.tolist()], 4, "group", 1e-6)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))
    assert (got[4:] == 0).all()
    # Unbiased std of [1, 0, 0, 0] is 0.5: the winner gets 0.75 / 0.5 = 1.5.
    assert abs(got[0].item() - 1.5) < 1e-5


def test_grpo_eps_is_added_to_std() -> None:
    r = torch.tensor([0.0, 2.0], dtype=torch.float64)  # mean 1, unbiased std sqrt(2)
    got = grpo_advantages(r, 2, eps=0.5)
    torch.testing.assert_close(got, torch.tensor([-1.0, 1.0], dtype=torch.float64) / (math.sqrt(2) + 0.5))


@pytest.mark.parametrize("group_size", [1, 2, 3, 7])
def test_rloo_matches_loops(group_size: int) -> None:
    gen = torch.Generator().manual_seed(10 + group_size)
    r = grouped_rewards(gen, 5, group_size)
    vals = r.tolist()
    want = []
    for start in range(0, len(vals), group_size):
        grp = vals[start : start + group_size]
        for i, x in enumerate(grp):
            others = grp[:i] + grp[i + 1 :]
            want.append(0.0 if not others else x - sum(others) / len(others))
    got = rloo_advantages(r, group_size)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert (got[-group_size:] == 0).all()


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages])
def test_group_validation(fn) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"N=10.*group_size=4"):
        fn(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="group_size"):
        fn(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="rewards"):
        fn(torch.zeros(2, 4), 4)


def test_grpo_validation() -> None:
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(torch.zeros(4), 2, scale="global")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(torch.zeros(4), 2, eps=-1.0)


def ref_gae(
    rewards: list[list[float]], values: list[list[float]], mask: list[list[bool]], gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    advs, rets = [], []
    for r, v, m in zip(rewards, values, mask):
        adv = [0.0] * len(r)
        ret = [0.0] * len(r)
        next_v, next_a = 0.0, 0.0
        for t in reversed([t for t in range(len(r)) if m[t]]):
            delta = r[t] + gamma * next_v - v[t]
            adv[t] = delta + gamma * lam * next_a
            ret[t] = adv[t] + v[t]
            next_v, next_a = v[t], adv[t]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_loops(gamma: float, lam: float, holes: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    b, t = 7, 9
    mask = random_mask(gen, b, t, holes)
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    # Garbage at masked positions must not be read.
    rewards = torch.where(mask, rewards, torch.tensor(float("nan"), dtype=torch.float64))
    values = torch.where(mask, values, torch.tensor(float("inf"), dtype=torch.float64))
    adv, ret = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_gamma_lam_one_is_monte_carlo() -> None:
    # With gamma = lam = 1 the advantage telescopes to (sum of rewards from t on) - V_t.
    gen = torch.Generator().manual_seed(4)
    mask = random_mask(gen, 5, 8, holes=False)
    rewards = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    r = torch.where(mask, rewards, 0.0)
    to_go = r.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, torch.where(mask, to_go - values, 0.0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(mask, to_go, 0.0), rtol=1e-12, atol=1e-12)


def test_gae_validation_and_no_grad() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        gae(z, z, z, 1.5, 0.9)
    with pytest.raises(ValueError, match="lam"):
        gae(z, z, z, 0.9, -0.1)
    with pytest.raises(ValueError, match="mask"):
        gae(z, z, torch.zeros(2, 4), 0.9, 0.9)
    v = torch.zeros(2, 3, requires_grad=True)
    adv, ret = gae(z, v, torch.ones(2, 3), 0.9, 0.9)
    assert not adv.requires_grad and not ret.requires_grad
