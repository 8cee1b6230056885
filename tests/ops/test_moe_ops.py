"""The MoE ops on the CPU: a token's routing and expert output keep their bits whatever else is in the call.

For several batch compositions (m rows, uneven expert loads, the same token at other places in its expert's
group), every row of the exact backend equals (torch.equal) the same row computed alone and in a 300-row call;
the fast backend, run through the same checks, differs somewhere (the checks can fail). Also: the lowest-id tie
rule, the rank-order fp32 combine as the interface defines it, and gradients (right and deterministic)."""

import pytest
import torch
import torch.nn.functional as F

from exactrl.ops.torch_ops import ExactTorchOps, FastOps

D, E, INTER = 128, 8, 64
POOL = 300
SIZES = (1, 2, 3, 5, 8, 17, 64, 255, 300)


def _weights(dtype: torch.dtype, seed: int = 0):
    """Trained-looking weights: heavy-tailed entries, each expert and each output row at its own scale (not one
    randn), and a router that prefers some experts (skewed column norms, a bias along the hidden states' common
    direction) so that expert loads are uneven."""
    g = torch.Generator().manual_seed(seed)

    def heavy(*shape):  # Student's t with 4 degrees of freedom: normal / sqrt(chi2_4 / 4)
        chi2 = torch.randn(4, *shape, generator=g).pow(2).sum(0)
        return torch.randn(*shape, generator=g) / (chi2 / 4).sqrt()

    expert_scale = torch.rand(E, 1, 1, generator=g) * 0.06 + 0.01
    row_scale = torch.rand(E, 2 * INTER, 1, generator=g) + 0.5
    gate_up = heavy(E, 2 * INTER, D) * expert_scale * row_scale
    down = heavy(E, D, INTER) * expert_scale * (torch.rand(E, D, 1, generator=g) + 0.5)
    router = torch.randn(E, D, generator=g) * 0.05
    common = torch.randn(D, generator=g)
    router += torch.linspace(0.3, -0.3, E)[:, None] * common / common.norm()  # expert 0 popular, 7 rare
    return router.to(dtype), gate_up.to(dtype), down.to(dtype), common


def _tokens(common: torch.Tensor, dtype: torch.dtype, n: int = POOL, seed: int = 1) -> torch.Tensor:
    """Hidden states as a norm leaves them: unit RMS, a shared direction, a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g) + 2.0 * common / common.norm() * D**0.5 / 4
    x[:, [3, 77]] *= 6.0
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    return x.to(dtype)


def _moe(ops, x, router, gate_up, down, top_k, norm):
    weights, ids = ops.moe_route(ops.linear(x, router), top_k, norm)
    return ops.moe_experts(x, gate_up, down, weights, ids), weights, ids


def _differences(ops, dtype, top_k, norm) -> list[str]:
    """Every (composition, row) whose routing or output differs from the 300-row call's."""
    router, gate_up, down, common = _weights(dtype)
    x = _tokens(common, dtype)
    ref, ref_w, ref_ids = _moe(ops, x, router, gate_up, down, top_k, norm)
    loads = torch.bincount(ref_ids.flatten(), minlength=E)
    assert loads.max() >= 3 * max(loads.min().item(), 1), f"expert loads not uneven enough: {loads.tolist()}"
    bad: list[str] = []

    def check(name, rows, out, w, ids):
        for j, i in enumerate(rows):
            if not (
                torch.equal(out[j], ref[i])
                and torch.equal(w[j], ref_w[i])
                and torch.equal(ids[j], ref_ids[i])
            ):
                bad.append(f"{name} row {i}")

    for m in SIZES:
        check(f"first {m}", range(m), *_moe(ops, x[:m], router, gate_up, down, top_k, norm))
    for i in range(0, POOL, 7):  # alone: a group of one row per expert
        check("alone", [i], *_moe(ops, x[i : i + 1], router, gate_up, down, top_k, norm))
    # Reversed and interleaved: every token sits elsewhere in its experts' groups, with other neighbours.
    rev = list(range(POOL - 1, -1, -1))
    check("reversed", rev, *_moe(ops, x[rev], router, gate_up, down, top_k, norm))
    odd = list(range(1, POOL, 2)) + list(range(0, POOL, 2))
    check("odd first", odd, *_moe(ops, x[odd], router, gate_up, down, top_k, norm))
    # One expert crowded: the token set repeated so each expert group is 3x longer, tokens at new places.
    tri = list(range(POOL)) * 3
    check("tripled", tri, *_moe(ops, x[tri], router, gate_up, down, top_k, norm))
    return bad


@pytest.mark.parametrize(
    "dtype,top_k,norm",
    [
        (torch.float32, 2, True),
        (torch.float32, 3, False),
        (torch.bfloat16, 2, False),
        (torch.bfloat16, 4, True),
    ],
)
def test_exact_rows_independent_of_the_batch(dtype, top_k, norm):
    assert _differences(ExactTorchOps(), dtype, top_k, norm) == []


def test_fast_backend_differs_negative_control():
    """The same check on PyTorch's defaults (F.linear without row padding, per expert) finds differences: fp32
    MKL GEMMs of fewer than 8 rows round differently, and experts of a decode-sized call see 1-3 rows."""
    bad = _differences(FastOps(), torch.float32, 2, True)
    assert bad, "the fast backend was expected to give some row other bits"
    assert any(b.startswith("alone") for b in bad)


def test_route_ties_go_to_the_lowest_expert_id():
    ops = ExactTorchOps()
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, 2.0],
            [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
            [0.0, 2.0, 1.0, 2.0, 1.0, 2.0],
        ],
        dtype=torch.bfloat16,
    )
    w, ids = ops.moe_route(logits, 3, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 3, 5]]
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    w4, ids4 = ops.moe_route(logits, 4, True)
    assert ids4.tolist() == [[1, 2, 4, 5], [0, 1, 2, 3], [1, 3, 5, 2]]
    assert torch.equal(w4[1], torch.full((4,), 0.25))
    # Rows of ties in bf16 router logits as a real router makes them (coarse values collide often).
    g = torch.Generator().manual_seed(0)
    many = (torch.randn(64, 16, generator=g) * 4).round().to(torch.bfloat16)
    _, ids = ops.moe_route(many, 4, False)
    probs = torch.softmax(many.float(), -1)
    for row, chosen in zip(probs, ids):
        # Descending probabilities; among equal ones, ascending ids; nothing left out beats the last one chosen.
        picked = row[chosen]
        assert all(picked[r] > picked[r + 1] or chosen[r] < chosen[r + 1] for r in range(3))
        rest = torch.ones(16, dtype=torch.bool)
        rest[chosen] = False
        worst = picked[-1]
        assert not ((row > worst) & rest).any()
        assert not ((row == worst) & rest & (torch.arange(16) < chosen[-1])).any()


def test_route_norm_divides_by_the_rank_order_sum():
    ops = ExactTorchOps()
    logits = torch.randn(50, E, generator=torch.Generator().manual_seed(3))
    raw, ids = ops.moe_route(logits, 4, False)
    normed, ids2 = ops.moe_route(logits, 4, True)
    assert torch.equal(ids, ids2)
    total = ((raw[:, 0] + raw[:, 1]) + raw[:, 2]) + raw[:, 3]
    assert torch.equal(normed, raw / total[:, None])
    probs = torch.softmax(logits, -1)
    assert torch.equal(raw, probs.gather(1, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_are_the_interfaces_definition_bit_for_bit(dtype):
    """out_t = sum over ranks, in rank order, of w[t, r] * o_r in fp32, o_r through the backend's own `linear`
    on the token alone: the exact backend gives exactly these bits (k = 4, so the summation order matters; in
    fp32 another order shows in the output, in bf16 the final rounding mostly hides it)."""
    ops = ExactTorchOps()
    router, gate_up, down, common = _weights(dtype, seed=5)
    x = _tokens(common, dtype, n=40)
    out, w, ids = _moe(ops, x, router, gate_up, down, 4, True)
    for t in range(40):
        acc = None
        for r in range(4):
            e = int(ids[t, r])
            gu = ops.linear(x[t : t + 1], gate_up[e])
            h = ops.silu_mul(gu[:, :INTER], gu[:, INTER:])
            term = w[t, r] * ops.linear(h, down[e])[0].float()
            acc = term if acc is None else acc + term
        assert torch.equal(out[t], acc.to(dtype)), t


def test_experts_match_a_float64_reference_and_gradients_are_right_and_deterministic():
    ops = ExactTorchOps()
    router, gate_up, down, common = _weights(torch.float32, seed=2)
    x = _tokens(common, torch.float32, n=37)

    def run(ops_or_none, leaves):
        xx, r, gu, dn = leaves
        if ops_or_none is None:  # float64 reference in plain torch
            w, ids = torch.softmax(xx @ r.T, -1).topk(3, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            out = torch.zeros_like(xx)
            for k in range(3):
                g, u = torch.einsum("td,tjd->tj", xx, gu[ids[:, k]]).chunk(2, dim=-1)
                out = out + w[:, k, None] * torch.einsum("tj,tdj->td", F.silu(g) * u, dn[ids[:, k]])
            return out
        out, _, _ = _moe(ops_or_none, xx, r, gu, dn, 3, True)
        return out

    probe = torch.randn(37, D, generator=torch.Generator().manual_seed(9))
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (x, router, gate_up, down)]
        out = run(ops, leaves)
        (out * probe).sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "backward is not deterministic"
    leaves64 = [t.double().requires_grad_(True) for t in (x, router, gate_up, down)]
    ref = run(None, leaves64)
    (ref * probe.double()).sum().backward()
    assert (out.double() - ref).abs().max() < 1e-5
    for got, want in zip(grads[0], (t.grad for t in leaves64)):
        assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()
