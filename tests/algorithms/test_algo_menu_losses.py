"""The menu's policy losses (SAPO, Clip-Cov, KL-Cov, GMPO) against plain float64 loops: loss value, gradient with
respect to the current log-probs, and the metrics that tell which tokens were clipped or selected."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from exactrl.algorithms import AGGREGATIONS, policy_loss
from exactrl.algorithms.losses import _token_hash

F64 = torch.float64


def make_batch(seed: int, b: int = 8, t: int = 9, spread: float = 0.3, seq_adv: bool = True):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0], lengths[1] = 1, 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(b, t, generator=gen, dtype=F64) * 4 - 0.05
    logp = old + spread * torch.randn(b, t, generator=gen, dtype=F64)
    shape = (b,) if seq_adv else (b, t)
    adv = 3 * torch.randn(*shape, generator=gen, dtype=F64)
    logp = torch.where(mask, logp, torch.tensor(-math.inf, dtype=F64))  # padding must never be read
    old = torch.where(mask, old, torch.tensor(math.nan, dtype=F64))
    return logp, old, adv, mask


def weights(mask: list[list[bool]], mode: str) -> list[list[float]]:
    """Weight of each token in the aggregated loss: loss = sum over valid (i, t) of w_it * loss_it."""
    n = [sum(row) for row in mask]
    total, seqs, width = sum(n), sum(1 for k in n if k), len(mask[0])
    w = []
    for row, k in zip(mask, n):
        w.append([
            0.0 if not v
            else 1 / total if mode == "token-mean"
            else 1 / (k * seqs) if mode == "seq-mean-token-mean"
            else 1 / seqs if mode == "seq-mean-token-sum"
            else 1 / (width * seqs)
            for v in row
        ])  # fmt: skip
    return w


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def ref_loss(kind: str, logp, old, adv, mask, mode: str, opts: dict, pick_key=None):  # type: ignore[no-untyped-def]
    """(loss, d loss / d logp [B][T], selected-token count, clipped-token count), written token by token."""
    b, t = len(mask), len(mask[0])
    a = [[adv[i] if isinstance(adv[i], float) else adv[i][k] for k in range(t)] for i in range(b)]
    w = weights(mask, mode)
    valid = [(i, k) for i in range(b) for k in range(t) if mask[i][k]]
    lr = {(i, k): logp[i][k] - old[i][k] for i, k in valid}
    loss, grad = 0.0, [[0.0] * t for _ in range(b)]
    picked = clipped = 0

    def cov_terms() -> dict:
        mean_a = sum(a[i][k] for i, k in valid) / len(valid)
        mean_l = sum(logp[i][k] for i, k in valid) / len(valid)
        return {(i, k): (a[i][k] - mean_a) * (logp[i][k] - mean_l) for i, k in valid}

    k_sel = max(1, math.floor(opts.get("ratio", 0) * len(valid)))
    chosen: set = set()
    if kind == "kl_cov":
        cov = cov_terms()
        order = sorted(valid, key=lambda ik: (-cov[ik], ik[0] * t + ik[1]))
        chosen = set(order[:k_sel])
    if kind == "clip_cov":
        cov = cov_terms()
        eps_l, eps_h = opts["eps_low"], opts["eps_high"]
        cands = []
        for i, k in valid:
            r = math.exp(lr[i, k])
            was_clipped = (a[i][k] > 0 and r > 1 + eps_h) or (a[i][k] < 0 and r < 1 - eps_l)
            if not was_clipped and opts["lb"] < cov[i, k] < opts["ub"]:
                cands.append((i, k))
        order = sorted(cands, key=lambda ik: (-pick_key[ik[0]][ik[1]], ik[0] * t + ik[1]))
        chosen = set(order[:k_sel])

    if kind == "gmpo":
        for i in range(b):
            toks = [k for k in range(t) if mask[i][k]]
            if not toks:
                continue
            a_i = sum(a[i][k] for k in toks) / len(toks)
            terms, live = [], []
            for k in toks:
                x = lr[i, k]
                if a_i > 0 and x > opts["eps_high"]:
                    terms.append(opts["eps_high"])
                    live.append(0.0)
                    clipped += 1
                elif a_i < 0 and x < -opts["eps_low"]:
                    terms.append(-opts["eps_low"])
                    live.append(0.0)
                    clipped += 1
                else:
                    terms.append(x if a_i != 0 else 0.0)
                    live.append(1.0 if a_i != 0 else 0.0)
            rho = math.exp(sum(terms) / len(toks))
            row_loss = -a_i * rho
            row_w = sum(w[i][k] for k in toks)
            loss += row_w * row_loss
            for k, d in zip(toks, live):
                grad[i][k] = row_w * (-a_i * rho * d / len(toks))
        return loss, grad, 0, clipped

    for i, k in valid:
        r, x, ak = math.exp(lr[i, k]), lr[i, k], a[i][k]
        if kind == "sapo":
            tau = opts["tau_pos"] if ak > 0 else opts["tau_neg"]
            s = sigmoid(tau * (r - 1))
            tok, d = -ak * 4 / tau * s, -ak * 4 * s * (1 - s) * r
        elif kind == "kl_cov":
            tok, d = -ak * r, -ak * r
            if (i, k) in chosen:
                tok += opts["coef"] * abs(x)
                d += opts["coef"] * (1.0 if x > 0 else -1.0 if x < 0 else 0.0)
                picked += 1
        else:  # clip_cov: PPO-clip, the chosen tokens detached
            lo, hi = 1 - opts["eps_low"], 1 + opts["eps_high"]
            unclipped, clip_val = -ak * r, -ak * min(max(r, lo), hi)
            tok = max(unclipped, clip_val)
            is_clipped = (ak > 0 and r > hi) or (ak < 0 and r < lo)
            clipped += is_clipped
            d = 0.0 if is_clipped else -ak * r
            if (i, k) in chosen:
                d = 0.0
                picked += 1
        loss += w[i][k] * tok
        grad[i][k] = w[i][k] * d
    return loss, grad, picked, clipped


def check(kind: str, mode: str, seq_adv: bool, kwargs: dict, opts: dict, spread: float = 0.3) -> dict:
    logp, old, adv, mask = make_batch(
        zlib.crc32(repr((kind, mode, seq_adv)).encode()), spread=spread, seq_adv=seq_adv
    )
    key = _token_hash(torch.where(mask, old, 0.0)).tolist() if kind == "clip_cov" else None
    lp = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old, adv, mask, kind=kind, aggregation=mode, **kwargs)
    loss.backward()
    want, want_grad, picked, clipped = ref_loss(
        kind, logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), mode, opts, key
    )
    assert math.isclose(loss.item(), want, rel_tol=1e-12, abs_tol=1e-12), (loss.item(), want)
    grad = torch.where(mask, lp.grad, 0.0)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=F64), rtol=1e-10, atol=1e-12)
    n = int(mask.sum())
    assert metrics["cov_select_frac"] == pytest.approx(picked / n, abs=1e-15)
    assert metrics["clip_frac"] == pytest.approx(clipped / n, abs=1e-15)
    return {"picked": picked, "clipped": clipped, "n": n}


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seq_adv", [True, False])
def test_sapo_matches_loops(mode: str, seq_adv: bool) -> None:
    check("sapo", mode, seq_adv, dict(sapo_tau_pos=1.0, sapo_tau_neg=1.7), dict(tau_pos=1.0, tau_neg=1.7))


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seq_adv", [True, False])
def test_gmpo_matches_loops(mode: str, seq_adv: bool) -> None:
    got = check(
        "gmpo", mode, seq_adv, dict(eps_low=0.2, eps_high=0.3), dict(eps_low=0.2, eps_high=0.3), spread=0.4
    )
    assert 0 < got["clipped"] < got["n"]  # the clip is exercised on both sides of the test


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seq_adv", [True, False])
def test_kl_cov_matches_loops(mode: str, seq_adv: bool) -> None:
    got = check("kl_cov", mode, seq_adv, dict(kl_cov_ratio=0.2, kl_cov_coef=0.7), dict(ratio=0.2, coef=0.7))
    assert got["picked"] == max(1, math.floor(0.2 * got["n"]))


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seq_adv", [True, False])
def test_clip_cov_matches_loops(mode: str, seq_adv: bool) -> None:
    kwargs = dict(eps_low=0.2, eps_high=0.28, clip_cov_ratio=0.1, clip_cov_lb=0.3, clip_cov_ub=4.0)
    opts = dict(eps_low=0.2, eps_high=0.28, ratio=0.1, lb=0.3, ub=4.0)
    got = check("clip_cov", mode, seq_adv, kwargs, opts)
    assert 0 < got["picked"] and got["clipped"] > 0


def test_clip_cov_choice_follows_the_data_not_the_position() -> None:
    """The pseudo-random order is keyed on the old log-probs: other data, other order (a fixed positional order
    would always favour the same positions)."""
    logp, old, adv, mask = make_batch(7)
    old0 = torch.where(mask, old, 0.0)
    k1, k2 = _token_hash(old0), _token_hash(old0 + 1e-3)
    assert not torch.equal(k1.argsort(), k2.argsort())
    assert torch.equal(k1, _token_hash(old0.clone()))  # and it is a function: same data, same choice
    assert int(k1.min()) >= 0 and int(k1.max()) < 2**32


def test_new_losses_on_policy_gradient_is_the_policy_gradient() -> None:
    """At ratio 1 (the first minibatch in exact mode) SAPO and GMPO (with a sequence advantage) give the plain
    policy gradient -A * grad(logp) weighted by the aggregation."""
    logp, _, adv, mask = make_batch(3)
    old = logp.detach().clone()
    for kind in ("sapo", "gmpo"):
        lp = torch.where(mask, logp, 0.0).clone().requires_grad_(True)
        loss, _ = policy_loss(lp, old, adv, mask, kind=kind, aggregation="seq-mean-token-mean")
        loss.backward()
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        want = torch.where(mask, -adv[:, None] / n / int((mask.sum(-1) > 0).sum()), 0.0)
        torch.testing.assert_close(torch.where(mask, lp.grad, 0.0), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kind": "sapo", "dual_clip": 3.0}, "dual_clip"),
        ({"kind": "gmpo", "dual_clip": 3.0}, "dual_clip"),
        ({"kind": "sapo", "sapo_tau_neg": 0.0}, "sapo_tau_neg"),
        ({"kind": "clip_cov", "clip_cov_ratio": 0.0}, "clip_cov_ratio"),
        ({"kind": "kl_cov", "kl_cov_ratio": 1.5}, "kl_cov_ratio"),
        ({"kind": "clip_cov", "clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "clip_cov_lb"),
        ({"kind": "kl_cov", "kl_cov_coef": -1.0}, "kl_cov_coef"),
        ({"kind": "geo_mean"}, "kind"),
    ],
)
def test_bad_options_are_refused_by_name(kwargs: dict, match: str) -> None:
    logp, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match=match):
        policy_loss(logp, old, adv, mask, **kwargs)


def test_ppo_is_an_alias_of_ppo_clip() -> None:
    logp, old, adv, mask = make_batch(1)
    a, ma = policy_loss(logp, old, adv, mask, kind="ppo")
    b, mb = policy_loss(logp, old, adv, mask, kind="ppo_clip")
    assert torch.equal(a, b) and ma == mb
