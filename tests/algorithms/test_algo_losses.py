"""Policy/value losses and aggregation against plain Python loops in float64, plus gradient properties:
microbatch invariance of the accumulated gradient, GSPO/PPO gradients vs finite differences, grad_divisor."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from exactrl.algorithms import AGGREGATIONS, aggregate, policy_loss, value_loss

F64 = torch.float64


def random_mask(gen: torch.Generator, b: int, t: int, holes: bool = True) -> torch.Tensor:
    """[b, t] bool: random-length prefixes (row 0 has 1 valid token, row 1 none, row 2 two), optional holes."""
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0], lengths[1], lengths[2] = 1, 0, 2
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if holes:
        mask &= (torch.rand(b, t, generator=gen) > 0.2) | (torch.arange(t)[None, :] == 0)
    return mask


def make_batch(seed: int, b: int = 8, t: int = 7, spread: float = 0.4, seq_adv: bool = True):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, b, t)
    old = -torch.rand(b, t, generator=gen, dtype=F64) * 3 - 0.05
    logp = old + spread * torch.randn(b, t, generator=gen, dtype=F64)
    adv = torch.randn(b, generator=gen, dtype=F64) if seq_adv else torch.randn(b, t, generator=gen, dtype=F64)
    # Padding holds garbage that must never be read.
    logp = torch.where(mask, logp, torch.tensor(-math.inf, dtype=F64))
    old = torch.where(mask, old, torch.tensor(math.nan, dtype=F64))
    return logp, old, adv, mask


# ------------------------------------------------------------------------------------------- loop references


def token_weights(mask: list[list[bool]], mode: str, divisor: float | None, norm_constant: float | None):  # type: ignore[no-untyped-def]
    """Weight of each token in the aggregated loss (loss = sum_{i,t valid} w_it * loss_it)."""
    n = [sum(row) for row in mask]
    total_tokens = sum(n)
    num_seqs = sum(1 for k in n if k > 0)
    t_len = len(mask[0])
    w = []
    for row, k in zip(mask, n):
        out = []
        for valid in row:
            if not valid:
                out.append(0.0)
            elif mode == "token-mean":
                out.append(1.0 / (divisor if divisor is not None else max(total_tokens, 1)))
            else:
                den = divisor if divisor is not None else max(num_seqs, 1)
                if mode == "seq-mean-token-mean":
                    out.append(1.0 / (k * den))
                elif mode == "seq-mean-token-sum":
                    out.append(1.0 / den)
                else:
                    c = norm_constant if norm_constant is not None else t_len
                    out.append(1.0 / (c * den))
        w.append(out)
    return w


def ref_policy(
    logp, old, adv, mask, kind, eps_low, eps_high, dual_clip, c_hi, c_lo, mode, divisor, norm_constant
):  # type: ignore[no-untyped-def]
    """Returns (loss, d loss / d logp, metrics, unweighted per-token losses) computed token by token."""
    b, t = len(mask), len(mask[0])
    w = token_weights(mask, mode, divisor, norm_constant)
    loss, grad = 0.0, [[0.0] * t for _ in range(b)]
    tok_losses = [[0.0] * t for _ in range(b)]
    ratios, low, high, dual, kls = [], 0, 0, 0, []
    for i in range(b):
        valid = [k for k in range(t) if mask[i][k]]
        a_row = adv[i] if not isinstance(adv[i], list) else None
        seq_ratio = None
        if kind == "gspo" and valid:
            seq_ratio = math.exp(sum(logp[i][k] - old[i][k] for k in valid) / len(valid))
        for k in valid:
            a = a_row if a_row is not None else adv[i][k]
            r = seq_ratio if kind == "gspo" else math.exp(logp[i][k] - old[i][k])
            ratios.append(r)
            kls.append(math.exp(logp[i][k] - old[i][k]) - 1 - (logp[i][k] - old[i][k]))
            if kind == "cispo":
                lo = 1 - c_lo if c_lo is not None else -math.inf
                wgt = min(max(r, lo), 1 + c_hi)
                tok_loss, tok_grad = -wgt * a * logp[i][k], -wgt * a
                high += r > 1 + c_hi
                low += r < lo
            else:
                clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
                unclipped_active = -a * r >= -a * clipped_r
                tok_loss = max(-a * r, -a * clipped_r)
                tok_grad = -a * r if unclipped_active else 0.0  # d(r)/d(logp) = r for ppo and gspo alike
                high += a > 0 and r > 1 + eps_high
                low += a < 0 and r < 1 - eps_low
                if dual_clip is not None and a < 0 and tok_loss > -a * dual_clip:
                    tok_loss, tok_grad = -a * dual_clip, 0.0
                    dual += 1
            loss += w[i][k] * tok_loss
            tok_losses[i][k] = tok_loss
            # GSPO-token: d s_i,t / d logp_t = s_i and 0 for the row's other tokens (the stop-gradient form), so
            # the gradient lands on the token's own position, as for PPO. With an advantage constant over the row
            # this equals the gradient of the sequence-level objective (checked by gradcheck below).
            grad[i][k] += w[i][k] * tok_grad
    n = len(ratios)
    metrics = {
        "pg_loss": loss,
        "ratio/mean": sum(ratios) / n if n else 0.0,
        "ratio/min": min(ratios) if n else math.inf,
        "ratio/max": max(ratios) if n else -math.inf,
        "ratio/sum": sum(ratios),
        "ratio/sum_sq": sum(r * r for r in ratios),
        "clip_frac": (low + high) / n if n else 0.0,
        "clip_frac/low": low / n if n else 0.0,
        "clip_frac/high": high / n if n else 0.0,
        "dual_clip_frac": dual / n if n else 0.0,
        "cov_select_frac": 0.0,
        "kl_new_old": sum(kls) / n if n else 0.0,
        "num_tokens": float(n),
        "num_seqs": float(sum(1 for row in mask if any(row))),
    }
    return loss, grad, metrics, tok_losses


CASES = [
    # kind, eps_low, eps_high, dual_clip, spread
    ("ppo", 0.2, 0.2, None, 0.4),
    ("ppo", 0.2, 0.28, None, 0.4),  # clip-higher
    ("ppo", 0.2, 0.28, 1.5, 0.8),  # dual clip, wide ratios so it binds
    ("gspo", 3e-2, 4e-2, None, 0.15),
    ("gspo", 3e-2, 4e-2, 1.1, 0.4),
    ("cispo", 0.2, 0.2, None, 0.4),
]


@pytest.mark.parametrize("kind,eps_low,eps_high,dual_clip,spread", CASES)
@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seq_adv", [True, False])
def test_policy_loss_matches_loops(kind, eps_low, eps_high, dual_clip, spread, mode, seq_adv) -> None:  # type: ignore[no-untyped-def]
    logp, old, adv, mask = make_batch(
        zlib.crc32(repr((kind, eps_high, dual_clip, mode, seq_adv)).encode()), spread=spread, seq_adv=seq_adv
    )
    c_lo = 0.5 if kind == "cispo" and seq_adv else None
    logp = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        logp, old, adv, mask, kind=kind, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
        cispo_eps_high=0.3, cispo_eps_low=c_lo, aggregation=mode,
    )  # fmt: skip
    loss.backward()
    want_loss, want_grad, want_metrics, _ = ref_policy(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), kind, eps_low, eps_high, dual_clip,
        0.3, c_lo, mode, None, None,
    )  # fmt: skip
    assert math.isclose(loss.item(), want_loss, rel_tol=1e-12, abs_tol=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(want_grad, dtype=F64), rtol=1e-10, atol=1e-12)
    assert set(metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        assert math.isclose(metrics[k], v, rel_tol=1e-10, abs_tol=1e-12), (k, metrics[k], v)


def test_clip_higher_and_dual_clip_are_hit() -> None:
    # One sequence per token so advantages are per row: a hand-made table of (A, ratio) cases.
    cases = [  # (advantage, ratio, expected per-token loss)
        (1.0, 1.25, -1.25),  # inside [0.8, 1.28]: unclipped (symmetric 0.2 would clip it)
        (1.0, 1.40, -1.28),  # clipped high
        (-1.0, 0.70, 0.80),  # clipped low
        (-1.0, 1.50, 1.50),  # above 1 + eps_high, A < 0: unclipped, below the dual cap 2.0
        (-2.0, 3.00, 4.00),  # dual clip binds: min(6.0, 2 * 2.0)
        (0.0, 5.00, 0.0),  # zero advantage: nothing counts as clipped
    ]
    adv = torch.tensor([c[0] for c in cases], dtype=F64)
    old = torch.full((len(cases), 1), -1.0, dtype=F64)
    logp = (old + torch.log(torch.tensor([[c[1]] for c in cases], dtype=F64))).requires_grad_(True)
    mask = torch.ones(len(cases), 1, dtype=torch.bool)
    loss, m = policy_loss(
        logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=2.0, aggregation="seq-mean-token-sum"
    )
    loss.backward()
    want = sum(c[2] for c in cases) / len(cases)
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    n = len(cases)
    assert m["clip_frac/high"] == pytest.approx(1 / n)
    assert m["clip_frac/low"] == pytest.approx(1 / n)
    assert m["clip_frac"] == pytest.approx(2 / n)
    assert m["dual_clip_frac"] == pytest.approx(1 / n)
    grad = logp.grad.squeeze(-1).tolist()  # type: ignore[union-attr]
    assert grad[1] == 0.0 and grad[2] == 0.0 and grad[4] == 0.0  # clipped tokens carry no gradient
    assert grad[0] == pytest.approx(-1.25 / n) and grad[3] == pytest.approx(1.5 / n)


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_microbatch_gradient_is_identical(kind: str, mode: str) -> None:
    """One step as one batch, or as microbatches (each cut to its own padded length) with grads accumulated,
    gives the same gradient when the step's global divisor is passed."""
    logp, old, adv, mask = make_batch(7, b=10, t=9, seq_adv=False)
    eps = (3e-2, 4e-2) if kind == "gspo" else (0.2, 0.28)
    common = dict(kind=kind, eps_low=eps[0], eps_high=eps[1], aggregation=mode, norm_constant=16.0)
    if mode == "token-mean":
        divisor = float(mask.sum())
    else:
        divisor = float((mask.sum(-1) > 0).sum())

    full = logp.clone().requires_grad_(True)
    loss_full, _ = policy_loss(full, old, adv, mask, loss_divisor=divisor, **common)  # type: ignore[arg-type]
    loss_full.backward()

    micro = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for rows in ([0, 1, 2], [3, 4], [5, 6, 7, 8, 9]):
        idx = torch.tensor(rows)
        length = int(mask[idx].any(0).nonzero().max()) + 1 if mask[idx].any() else 1
        part, _ = policy_loss(
            micro[idx, :length], old[idx, :length], adv[idx, :length], mask[idx, :length],
            loss_divisor=divisor, **common,  # type: ignore[arg-type]
        )  # fmt: skip
        part.backward()
        total = total + part.detach()
    assert torch.allclose(micro.grad, full.grad, rtol=0, atol=1e-12)  # type: ignore[arg-type]
    assert torch.allclose(total, loss_full.detach(), rtol=0, atol=1e-12)
    # Padding positions receive exactly zero gradient.
    assert (full.grad[~mask] == 0).all()  # type: ignore[index]


def test_microbatch_without_global_divisor_differs() -> None:
    # Sanity check that the invariance test above is not vacuous.
    logp, old, adv, mask = make_batch(8, b=10, t=9)
    full = logp.clone().requires_grad_(True)
    policy_loss(full, old, adv, mask)[0].backward()
    micro = logp.clone().requires_grad_(True)
    for rows in ([0, 1, 2], [3, 4, 5, 6, 7, 8, 9]):
        idx = torch.tensor(rows)
        (policy_loss(micro[idx], old[idx], adv[idx], mask[idx])[0] / 2).backward()
    assert not torch.allclose(micro.grad, full.grad, rtol=0, atol=1e-6)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_gspo_gradcheck(mode: str) -> None:
    gen = torch.Generator().manual_seed(11)
    mask = random_mask(gen, 6, 5)
    old = -torch.rand(6, 5, generator=gen, dtype=F64) * 2 - 0.1
    # Mean log ratios of a few 1e-3: some sequences inside GSPO's [1 - 3e-4, 1 + 4e-4] band, most clipped.
    logp = (old + 1e-3 * torch.randn(6, 5, generator=gen, dtype=F64)).requires_grad_(True)
    adv = torch.randn(6, generator=gen, dtype=F64)

    def f(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(lp, old, adv, mask, kind="gspo", eps_low=3e-4, eps_high=4e-4, aggregation=mode)[0]

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-7, atol=1e-9, rtol=1e-6)
    # And with no clipping active at all (wide band), so every row contributes a gradient.
    assert torch.autograd.gradcheck(
        lambda lp: policy_loss(lp, old, adv, mask, kind="gspo", eps_low=0.5, eps_high=0.5, aggregation=mode)[
            0
        ],
        (logp,),
        eps=1e-7,
        atol=1e-9,
        rtol=1e-6,
    )


def test_ppo_gradcheck_with_dual_clip() -> None:
    logp, old, adv, mask = make_batch(12, b=6, t=5, spread=0.6)
    old = torch.where(mask, old, 0.0)
    lp = torch.where(mask, logp, 0.0).requires_grad_(True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            x, old, adv, mask, eps_high=0.28, dual_clip=1.5, aggregation="seq-mean-token-mean"
        )[0]

    assert torch.autograd.gradcheck(f, (lp,), eps=1e-7, atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_grad_divisor_scales_gradient_not_value(kind: str, mode: str) -> None:
    logp, old, adv, mask = make_batch(13)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    common = dict(kind=kind, aggregation=mode, loss_divisor=10.0)
    loss_a, ma = policy_loss(a, old, adv, mask, **common)  # type: ignore[arg-type]
    loss_b, mb = policy_loss(b, old, adv, mask, grad_divisor=40.0, **common)  # type: ignore[arg-type]
    loss_a.backward()
    loss_b.backward()
    assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-14, abs=1e-15)
    assert mb["pg_loss"] == pytest.approx(ma["pg_loss"], rel=1e-14, abs=1e-15)
    torch.testing.assert_close(b.grad, a.grad / 4, rtol=1e-13, atol=1e-15)  # type: ignore[operator]


def test_tensor_divisor_and_is_weights() -> None:
    """is_weights multiply each token's loss; a 0-d tensor divisor acts like the number."""
    logp, old, adv, mask = make_batch(14)
    w = torch.where(mask, torch.rand(mask.shape, dtype=F64) * 2, torch.tensor(math.nan, dtype=F64))
    lp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, loss_divisor=torch.tensor(12.0), is_weights=w)
    loss.backward()
    _, want_grad, _, tok_losses = ref_policy(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), "ppo", 0.2, 0.2, None, 0.0, None, "token-mean",
        1.0, None,
    )  # fmt: skip
    # With divisor 1 the reference gives plain per-token losses and gradients; weight them by w / 12.
    scale = torch.where(mask, w, 0.0) / 12.0
    want_loss = (torch.tensor(tok_losses, dtype=F64) * scale).sum()
    assert math.isclose(loss.item(), want_loss.item(), rel_tol=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(want_grad, dtype=F64) * scale, rtol=1e-12, atol=1e-14)


def test_empty_mask_gives_zero_loss_and_identity_extrema() -> None:
    logp, old, adv, _ = make_batch(15)
    mask = torch.zeros_like(logp, dtype=torch.bool)
    lp = logp.clone().requires_grad_(True)
    for mode in AGGREGATIONS:
        loss, m = policy_loss(lp, old, adv, mask, aggregation=mode)  # type: ignore[arg-type]
        assert loss.item() == 0.0
        assert m["num_tokens"] == 0 and m["num_seqs"] == 0
        assert m["ratio/min"] == math.inf and m["ratio/max"] == -math.inf
        loss.backward()
    assert (lp.grad == 0).all()  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("divisor", [None, 3.0])
def test_aggregate_matches_loops(mode: str, divisor: float | None) -> None:
    gen = torch.Generator().manual_seed(16)
    mask = random_mask(gen, 6, 5)
    x = torch.randn(6, 5, generator=gen, dtype=F64)
    w = token_weights(mask.tolist(), mode, divisor, 7.0 if mode == "seq-mean-token-sum-norm" else None)
    want = sum(wi * xi for wr, xr in zip(w, x.tolist()) for wi, xi in zip(wr, xr))
    got = aggregate(x, mask, mode, divisor=divisor, norm_constant=7.0 if mode.endswith("norm") else None)  # type: ignore[arg-type]
    assert math.isclose(got.item(), want, rel_tol=1e-12, abs_tol=1e-14)
    if mode == "seq-mean-token-sum-norm":
        # Default constant is T, the padded length.
        w_t = token_weights(mask.tolist(), mode, divisor, None)
        want_t = sum(wi * xi for wr, xr in zip(w_t, x.tolist()) for wi, xi in zip(wr, xr))
        assert math.isclose(aggregate(x, mask, mode, divisor=divisor).item(), want_t, rel_tol=1e-12)  # type: ignore[arg-type]


def ref_value(v, old, ret, mask, clip):  # type: ignore[no-untyped-def]
    losses, clipped, vs, rs, res = [], 0, [], [], []
    for i in range(len(mask)):
        for k in range(len(mask[0])):
            if not mask[i][k]:
                continue
            e1 = (v[i][k] - ret[i][k]) ** 2
            if clip is None:
                e = e1
            else:
                vc = old[i][k] + min(max(v[i][k] - old[i][k], -clip), clip)
                e2 = (vc - ret[i][k]) ** 2
                clipped += e2 > e1
                e = max(e1, e2)
            losses.append(0.5 * e)
            vs.append(v[i][k])
            rs.append(ret[i][k])
            res.append(ret[i][k] - v[i][k])
    n = len(losses)

    def var(xs: list[float]) -> float:
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / len(xs)

    return sum(losses) / n, {
        "vf_loss": sum(losses) / n,
        "vf_clip_frac": clipped / n,
        "explained_variance": 1 - var(res) / var(rs),
        "values/mean": sum(vs) / n,
    }


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_loops(clip: float | None) -> None:
    gen = torch.Generator().manual_seed(17)
    mask = random_mask(gen, 8, 6)
    old = torch.randn(8, 6, generator=gen, dtype=F64)
    v = (old + 0.5 * torch.randn(8, 6, generator=gen, dtype=F64)).requires_grad_(True)
    ret = torch.randn(8, 6, generator=gen, dtype=F64)
    loss, m = value_loss(v, old, ret, mask, clip=clip)
    want_loss, want_m = ref_value(v.tolist(), old.tolist(), ret.tolist(), mask.tolist(), clip)
    assert math.isclose(loss.item(), want_loss, rel_tol=1e-12)
    for k, val in want_m.items():
        assert math.isclose(m[k], val, rel_tol=1e-10, abs_tol=1e-12), k
    if clip is not None:
        assert 0 < m["vf_clip_frac"] < 1
    assert torch.autograd.gradcheck(
        lambda x: value_loss(x, old, ret, mask, clip=clip, aggregation="seq-mean-token-mean")[0],
        (v,),
        eps=1e-7,
        atol=1e-9,
    )


def test_value_loss_explained_variance_degenerate() -> None:
    ret = torch.ones(2, 3, dtype=F64)
    _, m = value_loss(torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=F64), ret, torch.ones(2, 3))
    assert m["explained_variance"] == 0.0
    _, m = value_loss(
        ret.clone() * torch.tensor([[1.0, 2.0, 3.0]]), ret, ret * torch.tensor([[1, 2, 3]]), ret
    )
    assert m["explained_variance"] == 1.0


BAD_POLICY_ARGS = [
    ({"kind": "ppo2"}, "kind"),
    ({"aggregation": "mean"}, "aggregation"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"dual_clip": 0.5}, "dual_clip"),
    ({"kind": "cispo", "dual_clip": 3.0}, "dual_clip"),
    ({"eps_low": -0.1}, "eps_low"),
    ({"eps_high": -0.1}, "eps_high"),
    ({"cispo_eps_high": -1.0}, "cispo_eps_high"),
    ({"cispo_eps_low": -1.0}, "cispo_eps_low"),
    ({"loss_divisor": 0}, "loss_divisor"),
    ({"loss_divisor": -3.0}, "loss_divisor"),
    ({"loss_divisor": torch.ones(2)}, "loss_divisor"),
    ({"grad_divisor": 0.0}, "grad_divisor"),
    ({"norm_constant": 0.0}, "norm_constant"),
    ({"is_weights": torch.ones(3, 3)}, "is_weights"),
]


@pytest.mark.parametrize("kwargs,name", BAD_POLICY_ARGS)
def test_policy_loss_rejects_bad_arguments(kwargs: dict, name: str) -> None:
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=name):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 4), **kwargs)


def test_shape_errors_name_the_tensor() -> None:
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(x, torch.zeros(2, 5), torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, torch.zeros(2), torch.ones(3, 4))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="returns"):
        value_loss(x, x, torch.zeros(2, 5), torch.ones(2, 4))
    with pytest.raises(ValueError, match="clip"):
        value_loss(x, x, x, torch.ones(2, 4), clip=0.0)
    with pytest.raises(ValueError, match="mode"):
        aggregate(x, torch.ones(2, 4), "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisor"):
        aggregate(x, torch.ones(2, 4), divisor=0)
