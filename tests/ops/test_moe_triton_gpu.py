"""Exactness of the MoE Triton ops on the GPU at qwen3-30b-a3b's expert shape (marker `gpu`, skipped without CUDA).

- Router: the lowest-id tie rule on bf16 logits (ties are common there); rows of an m-row call equal the rows
  of a 300-row call.
- Experts (D = 2048, I = 768, E = 128, k = 8): a token's bits do not change with the batch (prefixes of m tokens
  for m in SWEEP, permuted tokens, the other tokens rerouted), bf16 and fp32; a routed row has the bits of the
  dense `linear` kernel for its expert's weights and the combine is rank order in fp32 (end to end against the
  dense composition); a negative control (a split-K first GEMM for decode-sized calls) fails the same check.
- CUDA graphs: routing and experts captured once, replayed with other routings (incl. every token on the same
  experts), give eager's bits.
- Backward: against a float64 reference, deterministic, an expert's gradient independent of the other experts'
  loads; the fast path (`torch._grouped_mm`) close to the exact one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

if torch.cuda.is_available():
    from exactrl.ops import set_exact_environment
    from exactrl.ops.fast_cuda import FastCudaOps
    from exactrl.ops.triton.moe import grouped_linear, moe_tile_config, route_plan
    from exactrl.ops.triton_ops import TritonOps

    ops = TritonOps()
    set_exact_environment(True)

SWEEP = [1, 2, 3, 5, 7, 8, 15, 16, 17, 64, 255, 256, 300]
D, INTER, E, K = 2048, 768, 128, 8  # qwen3-30b-a3b: hidden, moe_intermediate_size, experts, experts per token
DEV = "cuda"
# bf16 against float64: each of the chain's roundings (gate/up, h, o; in the backward d(o), d(h), d(gate/up))
# adds about 0.2%; torch's bf16 MoE on the CPU measured 0.6-0.7% on a smaller layer. Twice that, and a margin.
TOL = 2e-2


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def layer(dtype, tokens=300, seed=0, d=D, inter=INTER, n_exp=E):
    """x, gate_up, down and a router's (weights, ids) as the model makes them: logits from the invariant linear."""
    x = randn(tokens, d, dtype=dtype, seed=seed)
    gate_up = randn(n_exp, 2 * inter, d, dtype=dtype, scale=d**-0.5, seed=seed + 1)
    down = randn(n_exp, d, inter, dtype=dtype, scale=inter**-0.5, seed=seed + 2)
    router = randn(n_exp, d, dtype=dtype, scale=d**-0.5, seed=seed + 3)
    w, ids = ops.moe_route(ops.linear(x, router), K, True)
    return x, gate_up, down, w, ids


def row_failures(fn, x, gate_up, down, w, ids) -> list[str]:
    full = fn(x, gate_up, down, w, ids)
    bad = [
        f"prefix {m}" for m in SWEEP if not torch.equal(fn(x[:m], gate_up, down, w[:m], ids[:m]), full[:m])
    ]
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1)).to(DEV)
    if not torch.equal(fn(x[perm], gate_up, down, w[perm], ids[perm]), full[perm]):
        bad.append("permuted")
    keep = torch.arange(len(x), device=DEV) % 7 == 0
    crowd = torch.arange(K, device=DEV)  # every other token on experts 0..k-1: few groups, all large
    if not torch.equal(fn(x, gate_up, down, w, torch.where(keep[:, None], ids, crowd))[keep], full[keep]):
        bad.append("others rerouted")
    return bad


# ------------------------------------------------------------------------------------------------------------
# router
# ------------------------------------------------------------------------------------------------------------


def test_route_ties_and_rows():
    logits = randn(300, E, dtype=torch.bfloat16, seed=5)
    logits[0] = 1.0
    w, ids = ops.moe_route(logits, K, True)
    rows = logits.float().cpu().tolist()
    want = [sorted(range(E), key=lambda e: (-r[e], e))[:K] for r in rows]
    assert ids.cpu().tolist() == want
    p = torch.softmax(logits.double(), -1).gather(1, ids)
    assert rel_err(w, p / p.sum(-1, keepdim=True)) < 1e-6
    bad = [m for m in SWEEP if not torch.equal(ops.moe_route(logits[:m], K, True)[0], w[:m])]
    assert not bad, f"router rows of an m-row call differ for m in {bad}"


# ------------------------------------------------------------------------------------------------------------
# experts: invariance, dense bits, negative control
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_rows_invariant(dtype):
    x, gate_up, down, w, ids = layer(dtype)
    assert row_failures(ops.moe_experts, x, gate_up, down, w, ids) == []


def split_k_when_small(x, gate_up, down, w, ids):
    """A plausible, wrong MoE: decode-sized calls (at most 16 tokens) split the first GEMM's K in two halves and
    add them, as a kernel that splits K to fill the GPU on small batches would. The negative control."""
    if x.shape[0] > 16:
        return ops.moe_experts(x, gate_up, down, w, ids)
    plan = route_plan(ids, E, moe_tile_config(ids.numel(), x.dtype).block_m)
    h = D // 2
    lo = grouped_linear(x[:, :h].contiguous(), gate_up[:, :, :h], plan, gather=True)
    hi = grouped_linear(x[:, h:].contiguous(), gate_up[:, :, h:], plan, gather=True)
    gu = (lo.float() + hi.float()).to(x.dtype)
    o = grouped_linear(ops.silu_mul(gu[:, :INTER], gu[:, INTER:]), down, plan, gather=False)
    return (
        torch.stack([o[plan.pos.view(-1, K)[:, r]].float() * w[:, r : r + 1] for r in range(K)])
        .sum(0)
        .to(x.dtype)
    )


def test_experts_row_check_negative_control():
    x, gate_up, down, w, ids = layer(torch.bfloat16)
    assert "prefix 1" in row_failures(split_k_when_small, x, gate_up, down, w, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_equal_dense_composition(dtype):
    """Expert by expert through the dense kernels (`linear`, `silu_mul`, `linear`), combined with torch in rank
    order in fp32 (mul, then add): the same bits as moe_experts. So a routed row is the dense path's row."""
    x, gate_up, down, w, ids = layer(dtype)
    o = torch.empty(*ids.shape, D, dtype=dtype, device=DEV)
    for e in range(E):
        t, r = torch.nonzero(ids == e, as_tuple=True)
        if len(t):
            g, u = ops.packed_linear(x[t], gate_up[e], None, [INTER, INTER])
            o[t, r] = ops.linear(ops.silu_mul(g, u), down[e])
    acc = torch.zeros(x.shape, dtype=torch.float32, device=DEV)
    for r in range(K):
        acc = acc + w[:, r : r + 1] * o[:, r].float()
    assert torch.equal(ops.moe_experts(x, gate_up, down, w, ids), acc.to(dtype))


def test_tile_family_same_bits():
    x, gate_up, _, _, ids = layer(torch.bfloat16)
    from exactrl.ops.triton.moe import _MOE_CONFIGS

    decode, train = _MOE_CONFIGS[torch.bfloat16]
    plan = route_plan(ids, E, decode.block_m)
    a = grouped_linear(x, gate_up, plan, gather=True, config=decode)
    assert torch.equal(a, grouped_linear(x, gate_up, plan, gather=True, config=train))


# ------------------------------------------------------------------------------------------------------------
# CUDA graphs
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_cuda_graph_replay_with_new_routing(tokens):
    """Routing and experts captured once (a decode step), replayed after copying in other hidden states and
    router logits: eager's bits every time, also when every token routes to the same k experts (largest groups)
    or to k experts of its own. A capture that synchronised with the host would fail here."""
    dtype = torch.bfloat16
    _, gate_up, down, _, _ = layer(dtype, tokens=1)
    x = randn(tokens, D, dtype=dtype, seed=10)
    logits = randn(tokens, E, dtype=dtype, seed=11)

    def step():
        w, ids = ops.moe_route(logits, K, True)
        return ops.moe_experts(x, gate_up, down, w, ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    same_experts = torch.full((tokens, E), -5.0, device=DEV)
    same_experts[:, :K] = torch.arange(K, 0, -1, device=DEV)
    own = torch.full((tokens, E), -5.0, device=DEV)
    for t in range(tokens):
        own[t, (t * K + torch.arange(K)) % E] = 1.0
    for i, new_logits in enumerate((randn(tokens, E, seed=12), same_experts, own)):
        new_x = randn(tokens, D, dtype=dtype, seed=13 + i)
        x.copy_(new_x)
        logits.copy_(new_logits.to(dtype))
        graph.replay()
        w, ids = ops.moe_route(new_logits.to(dtype), K, True)
        want = ops.moe_experts(new_x, gate_up, down, w, ids)
        assert torch.equal(out, want), f"replay {i} differs from eager"


# ------------------------------------------------------------------------------------------------------------
# backward, fast path
# ------------------------------------------------------------------------------------------------------------


def reference_loop(x, gate_up, down, w, ids):
    """float64, expert by expert (the [T, k, 2I, D] gather of a one-shot einsum would not fit)."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=DEV)
    for e in range(gate_up.shape[0]):
        t, r = torch.nonzero(ids == e, as_tuple=True)
        if len(t):
            a = x[t] @ gate_up[e].T
            h = F.silu(a[:, :INTER]) * a[:, INTER:]
            out = out.index_add(0, t, w[t, r, None] * (h @ down[e].T))
    return out


def grads(fn, x, gate_up, down, w, ids, gy):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    fn(*leaves, ids).backward(gy)
    return [t.grad for t in leaves]


def test_experts_backward():
    dtype = torch.bfloat16
    x, gate_up, down, w, ids = layer(dtype, tokens=256)
    gy = randn(256, D, dtype=dtype, seed=20)
    got = grads(ops.moe_experts, x, gate_up, down, w, ids, gy)
    refs = [t.double().requires_grad_(True) for t in (x, gate_up, down, w)]
    reference_loop(*refs, ids).backward(gy.double())
    for name, g, r in zip(("x", "gate_up", "down", "weights"), got, refs):
        assert rel_err(g, r.grad) < TOL, f"d{name}"
    again = grads(ops.moe_experts, x, gate_up, down, w, ids, gy)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "the backward is not deterministic"
    # An expert's gradient from only its own tokens (every other group changes size and its group moves): the
    # same bits. The busiest expert after expert 0 (the first group would not move).
    e = 1 + int(torch.bincount(ids.flatten(), minlength=E)[1:].argmax())
    mine = (ids == e).any(1)
    sub = grads(ops.moe_experts, x[mine], gate_up, down, w[mine], ids[mine], gy[mine])
    assert torch.equal(sub[1][e], got[1][e]) and torch.equal(sub[2][e], got[2][e])
    fast = grads(FastCudaOps().moe_experts, x, gate_up, down, w, ids, gy)
    for name, g, f in zip(("x", "gate_up", "down", "weights"), got, fast):
        assert rel_err(f, g) < 1.5 * TOL, f"fast d{name}"


def test_fast_path_close_to_exact():
    x, gate_up, down, w, ids = layer(torch.bfloat16)
    exact = ops.moe_experts(x, gate_up, down, w, ids)
    assert rel_err(FastCudaOps().moe_experts(x, gate_up, down, w, ids), exact) < TOL
    assert rel_err(exact, reference_loop(x.double(), gate_up.double(), down.double(), w.double(), ids)) < TOL
