"""Masked helpers and logged metrics against plain Python loops in float64."""

from __future__ import annotations

import math

import pytest
import torch

import exactrl.algorithms as algorithms
from exactrl.algorithms import (
    advantage_metrics,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_length_metrics,
    reward_metrics,
    scalars_to_floats,
)

F64 = torch.float64


def random_mask(gen: torch.Generator, b: int, t: int) -> torch.Tensor:
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0], lengths[1] = 1, 0
    return (torch.arange(t)[None, :] < lengths[:, None]) & (torch.rand(b, t, generator=gen) > 0.2)


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, 6, 7)
    x = torch.randn(6, 7, generator=gen, dtype=F64)
    return torch.where(mask, x, torch.tensor(-math.inf, dtype=F64)), mask


def ref_stats(xs: list[float], unbiased: bool = True) -> tuple[float, float, float]:
    """(sum, mean, var) with the helpers' empty conventions."""
    n = len(xs)
    total = sum(xs)
    mean = total / n if n else 0.0
    denom = n - 1 if unbiased else n
    var = sum((x - mean) ** 2 for x in xs) / denom if denom > 0 else 0.0
    return total, mean, var


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_reductions_match_loops(dim: int | None, unbiased: bool) -> None:
    x, mask = data()
    vals, m = x.tolist(), mask.tolist()
    if dim is None:
        groups = [[v for rv, rm in zip(vals, m) for v, k in zip(rv, rm) if k]]
    elif dim == 0:
        groups = [[vals[i][j] for i in range(6) if m[i][j]] for j in range(7)]
    else:
        groups = [[v for v, k in zip(rv, rm) if k] for rv, rm in zip(vals, m)]
    stats = [ref_stats(g, unbiased) for g in groups]
    shape = () if dim is None else (len(groups),)
    for fn, col in ((masked_sum, 0), (masked_mean, 1)):
        got = fn(x, mask, dim)
        torch.testing.assert_close(got, torch.tensor([s[col] for s in stats], dtype=F64).reshape(shape))
    got = masked_var(x, mask, dim, unbiased=unbiased)
    torch.testing.assert_close(got, torch.tensor([s[2] for s in stats], dtype=F64).reshape(shape))


def test_masked_helpers_accept_float_masks_and_keep_gradients_finite() -> None:
    x, mask = data(1)
    x = x.clone().requires_grad_(True)
    masked_mean(x, mask.double()).backward()
    assert torch.isfinite(x.grad).all()  # type: ignore[arg-type]
    assert (x.grad[~mask] == 0).all()  # type: ignore[index]


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loops(shift_mean: bool) -> None:
    x, mask = data(2)
    vals = [v for rv, rm in zip(x.tolist(), mask.tolist()) for v, k in zip(rv, rm) if k]
    _, mean, var = ref_stats(vals)
    got = masked_whiten(x, mask, shift_mean=shift_mean)
    for i in range(6):
        for j in range(7):
            if mask[i, j]:
                want = (x[i, j].item() - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
                assert math.isclose(got[i, j].item(), want, rel_tol=1e-12, abs_tol=1e-12)
            else:
                assert got[i, j].item() == 0.0


def test_advantage_metrics_token_and_sequence_shapes() -> None:
    x, mask = data(3)
    vals = [v for rv, rm in zip(x.tolist(), mask.tolist()) for v, k in zip(rv, rm) if k]
    _, mean, var = ref_stats(vals)
    got = advantage_metrics(x, mask)
    want = {"advantages/mean": mean, "advantages/std": math.sqrt(var), "advantages/min": min(vals)}
    want["advantages/max"] = max(vals)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-12), k
    # [B] advantages are broadcast over each row's valid tokens.
    seq = torch.arange(6, dtype=F64)
    tok = [float(i) for i in range(6) for j in range(7) if mask[i, j]]
    got = advantage_metrics(seq, mask)
    assert math.isclose(got["advantages/mean"], sum(tok) / len(tok), rel_tol=1e-12)
    assert got["advantages/min"] == min(tok) and got["advantages/max"] == max(tok)


def test_reward_metrics_match_loops() -> None:
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.2, 0.3], dtype=torch.float32)
    acc = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    got = reward_metrics(r, 3, {"acc": acc, "fmt": torch.ones(9)})
    _, mean, var = ref_stats([float(v) for v in r.tolist()])
    _, amean, avar = ref_stats(acc.tolist())
    assert got.keys() == {
        "reward/mean", "reward/std", "reward/acc/mean", "reward/acc/std", "reward/fmt/mean", "reward/fmt/std",
        "groups/zero_std_frac",
    }  # fmt: skip
    assert math.isclose(got["reward/mean"], mean, rel_tol=1e-7)
    assert math.isclose(got["reward/std"], math.sqrt(var), rel_tol=1e-7)
    assert math.isclose(got["reward/acc/mean"], amean) and math.isclose(
        got["reward/acc/std"], math.sqrt(avar)
    )
    assert got["reward/fmt/std"] == 0.0
    assert got["groups/zero_std_frac"] == pytest.approx(2 / 3)
    assert reward_metrics(torch.rand(4), 1)["groups/zero_std_frac"] == 1.0  # groups of one never have signal
    with pytest.raises(ValueError, match="group_size"):
        reward_metrics(torch.rand(5), 2)
    with pytest.raises(ValueError, match="acc"):
        reward_metrics(torch.rand(4), 2, {"acc": torch.rand(3)})


def test_response_length_metrics() -> None:
    lengths = torch.tensor([3, 10, 7, 10])
    truncated = torch.tensor([False, True, False, True])
    got = response_length_metrics(lengths, truncated)
    assert got == {
        "response_length/mean": 7.5,
        "response_length/min": 3.0,
        "response_length/max": 10.0,
        "response_length/truncated_frac": 0.5,
    }
    assert (
        response_length_metrics(torch.zeros(0), torch.zeros(0, dtype=torch.bool))["response_length/mean"]
        == 0.0
    )
    with pytest.raises(ValueError, match="truncated"):
        response_length_metrics(lengths, truncated[:2])


def test_scalars_to_floats_keeps_order_and_types() -> None:
    got = scalars_to_floats({"a": torch.tensor(2), "b": 1.5, "c": torch.tensor(0.25, dtype=torch.float32)})
    assert list(got) == ["a", "b", "c"] and got == {"a": 2.0, "b": 1.5, "c": 0.25}
    assert all(type(v) is float for v in got.values())


def test_package_reexports_everything() -> None:
    for name in algorithms.__all__:
        assert hasattr(algorithms, name), name
    for name in ("grpo_advantages", "rloo_advantages", "gae", "kl_estimate", "policy_loss", "value_loss",
                 "aggregate", "rollout_correction", "mismatch_metrics", "masked_mean", "masked_sum", "masked_var",
                 "masked_whiten", "advantage_metrics", "reward_metrics", "response_length_metrics"):  # fmt: skip
        assert name in algorithms.__all__, name
