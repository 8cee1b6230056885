"""KL estimators, rollout correction and mismatch metrics against plain Python loops in float64."""

from __future__ import annotations

import math

import pytest
import torch

from exactrl.algorithms import CORRECTION_MODES, kl_estimate, mismatch_metrics, rollout_correction

F64 = torch.float64


def random_mask(gen: torch.Generator, b: int, t: int) -> torch.Tensor:
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0], lengths[1] = 1, 0
    return (torch.arange(t)[None, :] < lengths[:, None]) & (torch.rand(b, t, generator=gen) > 0.15)


def ref_kl(lp: float, ref: float, kind: str) -> float:
    lr = lp - ref
    if kind == "k1":
        return lr
    if kind == "k2":
        return 0.5 * lr * lr
    c = min(max(lr, -20.0), 20.0)
    return min(max(math.exp(-c) - 1.0 + c, -10.0), 10.0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_matches_loops(kind: str) -> None:
    gen = torch.Generator().manual_seed(1)
    lp = -torch.rand(5, 7, generator=gen, dtype=F64) * 4
    ref = lp + torch.randn(5, 7, generator=gen, dtype=F64)
    # Include the clamp regimes: |log r| > 20 and k3 > 10 (log r = -12.5 -> exp(12.5) huge).
    lp[0, 0], ref[0, 0] = -1.0, -30.0
    lp[0, 1], ref[0, 1] = -30.0, -1.0
    lp[0, 2], ref[0, 2] = -13.5, -1.0
    got = kl_estimate(lp, ref, kind)  # type: ignore[arg-type]
    want = [[ref_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)
    if kind == "k3":
        assert got[0, 1].item() == 10.0 and got[0, 2].item() == 10.0
        assert (got >= 0).all()


def test_kl_k3_gradient_and_validation() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.2, -1.5, -0.5], dtype=F64)
    assert torch.autograd.gradcheck(lambda x: kl_estimate(x, ref, "k3"), (lp,))
    with pytest.raises(ValueError, match="kind"):
        kl_estimate(lp, ref, "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_estimate(lp, ref[:2], "k1")


def ref_correction(old, roll, mask, mode, threshold, low):  # type: ignore[no-untyped-def]
    """(weights or None, new_mask, metrics) by loops; ratios from exp of (clamped) log ratios."""
    b, t = len(mask), len(mask[0])
    low = 1.0 / threshold if low is None else low
    seq = mode in ("seq-tis", "seq-mis")
    weights = [[0.0] * t for _ in range(b)]
    new_mask = [list(row) for row in mask]
    unit_ratios, clipped = [], 0
    for i in range(b):
        valid = [k for k in range(t) if mask[i][k]]
        seq_lr = sum(old[i][k] - roll[i][k] for k in valid)
        if seq and valid:
            unit_ratios.append(math.exp(min(max(seq_lr, -20), 20)))
        for k in valid:
            lr = seq_lr if seq else old[i][k] - roll[i][k]
            rho = math.exp(min(max(lr, -20), 20))
            if not seq:
                unit_ratios.append(rho)
            if mode in ("token-tis", "seq-tis"):
                weights[i][k] = min(rho, threshold)
                if not seq or k == valid[0]:
                    clipped += rho > threshold
            elif mode is not None:
                if low <= rho <= threshold:
                    weights[i][k] = rho
                else:
                    new_mask[i][k] = False
    n_tok = sum(sum(row) for row in mask)
    dropped = sum(1 for i in range(b) for k in range(t) if mask[i][k] and not new_mask[i][k])
    non_empty = [i for i in range(b) if any(mask[i])]
    seq_dropped = sum(1 for i in non_empty if any(mask[i][k] and not new_mask[i][k] for k in range(t)))
    n = len(unit_ratios)
    metrics = {
        "rollout_corr/ratio_mean": sum(unit_ratios) / n,
        "rollout_corr/ratio_min": min(unit_ratios),
        "rollout_corr/ratio_max": max(unit_ratios),
        "rollout_corr/clipped_frac": clipped / n,
        "rollout_corr/masked_frac": dropped / n_tok,
        "rollout_corr/masked_seq_frac": seq_dropped / len(non_empty),
    }
    return (None if mode is None else weights), new_mask, metrics


CORRECTION_CASES = [(mode, th, None) for mode in CORRECTION_MODES for th in (2.0, 1.3)] + [
    (mode, th, low) for mode in ("token-mis", "seq-mis", "icepop") for th, low in ((1.5, 0.0), (3.0, 0.9))
]


@pytest.mark.parametrize("mode,threshold,low", CORRECTION_CASES)
def test_rollout_correction_matches_loops(mode: str | None, threshold: float, low: float | None) -> None:
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(gen, 9, 6)
    roll = -torch.rand(9, 6, generator=gen, dtype=F64) * 3
    # Token log ratios of about +-0.45 so token modes clip/mask some tokens; sequence products spread further.
    old = roll + 0.45 * torch.randn(9, 6, generator=gen, dtype=F64)
    old[~mask] = math.nan  # padding is never read
    got_w, got_mask, got_m = rollout_correction(
        old,
        roll,
        mask.float(),
        mode=mode,
        threshold=threshold,
        low_threshold=low,  # type: ignore[arg-type]
    )
    want_w, want_mask, want_m = ref_correction(
        old.tolist(), roll.tolist(), mask.tolist(), mode, threshold, low
    )
    assert got_mask.dtype == torch.float32
    assert got_mask.bool().tolist() == want_mask
    if mode is None:
        assert got_w is None
    else:
        assert got_w is not None and not got_w.requires_grad
        torch.testing.assert_close(got_w, torch.tensor(want_w, dtype=F64), rtol=1e-12, atol=1e-12)
    assert set(got_m) == set(want_m)
    for k, v in want_m.items():
        assert math.isclose(got_m[k], v, rel_tol=1e-12, abs_tol=1e-12), (k, got_m[k], v)
    # The random data is not trivially inside the bounds.
    if mode is not None:
        assert got_m["rollout_corr/clipped_frac"] + got_m["rollout_corr/masked_frac"] > 0


def test_rollout_correction_hits_every_branch() -> None:
    # Token ratios e^0 = 1, e^1, e^-1 in one row; thresholds 2 / 0.5.
    roll = torch.zeros(2, 3, dtype=F64)
    old = torch.tensor([[0.0, 1.0, -1.0], [0.1, 0.1, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, _, m = rollout_correction(old, roll, mask, mode="token-tis", threshold=2.0)
    assert w is not None and w[0].tolist() == [1.0, 2.0, math.exp(-1)]  # truncated at 2, never raised
    assert m["rollout_corr/clipped_frac"] == pytest.approx(1 / 5) and m["rollout_corr/masked_frac"] == 0
    for mode in ("token-mis", "icepop"):
        w, nm, m = rollout_correction(old, roll, mask, mode=mode, threshold=2.0)  # type: ignore[arg-type]
        assert nm.tolist() == [[1, 0, 0], [1, 1, 0]] and nm.dtype == mask.dtype
        assert w is not None and w[0].tolist() == [1.0, 0.0, 0.0]
        assert m["rollout_corr/masked_frac"] == pytest.approx(2 / 5)
        assert m["rollout_corr/masked_seq_frac"] == pytest.approx(1 / 2)
    # Sequence level: row 0's product is e^0 = 1 (kept), row 1's is e^0.2.
    w, nm, _ = rollout_correction(old, roll, mask, mode="seq-mis", threshold=1.2)
    assert nm.tolist() == [[1, 1, 1], [0, 0, 0]]
    w, nm, m = rollout_correction(old, roll, mask, mode="seq-tis", threshold=1.2)
    assert w is not None and w[1, :2].tolist() == [1.2, 1.2] and m["rollout_corr/clipped_frac"] == 0.5


def test_rollout_correction_validation() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(x, x, x, mode="tis")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold"):
        rollout_correction(x, x, x, threshold=0.5)
    with pytest.raises(ValueError, match="low_threshold"):
        rollout_correction(x, x, x, mode="token-tis", low_threshold=0.5)
    with pytest.raises(ValueError, match="low_threshold"):
        rollout_correction(x, x, x, mode="token-mis", low_threshold=1.5)
    with pytest.raises(ValueError, match="mask"):
        rollout_correction(x, x, torch.zeros(2, 4))


MISMATCH_KEYS = {
    "mismatch/num_tokens",
    "mismatch/num_mismatched_tokens",
    "mismatch/logprob_abs_diff_max",
    "mismatch/logprob_abs_diff_mean",
    "mismatch/token_mult_prob_error",
    "mismatch/kl_k3",
}


def test_mismatch_metrics_matches_loops() -> None:
    gen = torch.Generator().manual_seed(9)
    mask = random_mask(gen, 6, 8)
    roll = -torch.rand(6, 8, generator=gen) * 5
    # Equal, one-ulp-apart and clearly different values side by side.
    choice = torch.randint(0, 3, (6, 8), generator=gen)
    ulp = torch.nextafter(roll, torch.full_like(roll, -math.inf))
    train = torch.where(
        choice == 0, roll, torch.where(choice == 1, ulp, roll + 0.05 * torch.randn(6, 8, generator=gen))
    )
    train[~mask] = math.nan  # padding differs but must not count
    got = mismatch_metrics(roll, train, mask)
    assert set(got) == MISMATCH_KEYS
    r, t, m = roll.tolist(), train.tolist(), mask.tolist()
    pairs = [(r[i][k], t[i][k]) for i in range(6) for k in range(8) if m[i][k]]
    diffs = [abs(b - a) for a, b in pairs]
    want = {
        "mismatch/num_tokens": float(len(pairs)),
        "mismatch/num_mismatched_tokens": float(sum(1 for a, b in pairs if a != b)),
        "mismatch/logprob_abs_diff_max": max(diffs),
        "mismatch/logprob_abs_diff_mean": sum(diffs) / len(diffs),
        "mismatch/token_mult_prob_error": sum(math.exp(d) for d in diffs) / len(diffs),
        "mismatch/kl_k3": sum(math.exp(b - a) - 1 - (b - a) for a, b in pairs) / len(pairs),
    }
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-12, abs_tol=1e-15), (k, got[k], v)
    assert 0 < got["mismatch/num_mismatched_tokens"] < got["mismatch/num_tokens"]


def test_mismatch_metrics_exact_and_empty() -> None:
    x = -torch.rand(3, 4)
    got = mismatch_metrics(x, x.clone(), torch.ones(3, 4))
    assert got["mismatch/num_tokens"] == 12 and got["mismatch/num_mismatched_tokens"] == 0
    assert got["mismatch/logprob_abs_diff_max"] == 0 and got["mismatch/kl_k3"] == 0
    assert got["mismatch/token_mult_prob_error"] == 1.0
    empty = mismatch_metrics(x, x + 1, torch.zeros(3, 4))
    assert set(empty) == MISMATCH_KEYS
    assert empty["mismatch/num_tokens"] == 0 and empty["mismatch/token_mult_prob_error"] == 1.0
    with pytest.raises(ValueError, match="mask"):
        mismatch_metrics(x, x, torch.ones(3, 5))
