"""The fp8 recipe's pieces on the CPU (exactrl/ops/fp8.py): the quantizers against float64 references, their
row-locality, and the CPU GEMM's batch invariance, each exactness check with a negative control."""

from __future__ import annotations

import pytest
import torch
from fp8_backward_check import check_backward_is_the_wrapped_backends
from fp8_backward_check import grads as _grads

from exactrl.ops.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    Fp8Ops,
    dequantize_weight,
    fp8_gemm_cpu,
    fp8_linear,
    fp8_packed_linear,
    quantize_activations,
    quantize_weight,
)
from exactrl.ops.torch_ops import ExactTorchOps


def _data(*shape, seed=0, scale_rows=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if scale_rows:  # rows and groups of very different magnitudes, so a shared scale would show
        cols = torch.logspace(-2, 2, shape[-1])[torch.randperm(shape[-1], generator=g)]
        rows = torch.logspace(-2, 2, shape[0])[torch.randperm(shape[0], generator=g)]
        x = x * cols * rows[:, None]
    return x


def test_activation_scales_match_float64_reference():
    x = _data(9, 300)
    x[3] = 0.0  # an all-zero row: scale 1, values 0
    q, scale = quantize_activations(x)
    assert q.dtype == FP8_DTYPE and q.shape == (9, 384) and scale.shape == (9, 3)
    x64 = torch.zeros(9, 384, dtype=torch.float64)
    x64[:, :300] = x.double()
    amax = x64.view(9, 3, BLOCK).abs().amax(-1)
    ref = torch.where(
        amax > 0, amax / FP8_MAX, torch.ones_like(amax)
    ).float()  # fp32 division, correctly rounded
    assert torch.equal(scale, ref)
    qf = q.float().view(9, 3, BLOCK)
    # every non-zero group reaches the format's largest value; the zero padding past K stays 0
    assert torch.equal(qf.abs().amax(-1)[amax > 0], torch.full_like(qf.abs().amax(-1)[amax > 0], FP8_MAX))
    assert torch.equal(q.float()[:, 300:], torch.zeros(9, 84))
    assert torch.equal(q.float()[3], torch.zeros(384))
    # each value is within half an e4m3 step (3 mantissa bits: 2^-4 relative, 2^-10 absolute below the normals)
    deq = (qf * scale.double().view(9, 3, 1)).view(9, 384)
    s64 = scale.double().repeat_interleave(BLOCK, 1)
    step = torch.maximum(x64.abs() * 2.0**-4, s64 * 2.0**-10) * (1 + 1e-6)
    assert ((deq - x64).abs() <= step).all()


def test_weight_block_scales_match_float64_reference():
    w = _data(300, 200, seed=1)
    q, row_scale = quantize_weight(w)
    assert q.shape == (300, 256) and row_scale.shape == (300, 2)
    w64 = torch.zeros(384, 256, dtype=torch.float64)
    w64[:300, :200] = w.double()
    amax = w64.view(3, BLOCK, 2, BLOCK).abs().amax(dim=(1, 3))  # [NB, KB]
    ref = (amax / FP8_MAX).float().repeat_interleave(BLOCK, 0)[:300]
    assert torch.equal(row_scale, ref)
    err = (dequantize_weight(q, row_scale, 200).double() - w.double()).abs()
    s64 = row_scale.double().repeat_interleave(BLOCK, 1)[:, :200]
    assert (err <= torch.maximum(w.double().abs() * 2.0**-4, s64 * 2.0**-10) * (1 + 1e-6)).all()


def test_packed_weight_blocks_part_by_part():
    w = _data(200, 130, seed=2)
    q, s = quantize_weight(w, [72, 128])
    qa, sa = quantize_weight(w[:72])
    qb, sb = quantize_weight(w[72:])
    assert torch.equal(q.float(), torch.cat([qa, qb]).float()) and torch.equal(s, torch.cat([sa, sb]))
    # negative control: blocked as one weight, the first 128 rows share blocks across the part boundary
    q1, s1 = quantize_weight(w)
    assert not torch.equal(s1, s)


def _trained_stack(e: int, inter: int, k: int) -> torch.Tensor:
    """A packed gate|up expert stack [E, 2 * inter, K] in bf16 that looks trained: each expert and each part of its
    own magnitude (up to 10^4 apart), rows and channels uneven within them."""
    g = torch.Generator().manual_seed(7)
    w = torch.stack([_data(2 * inter, k, seed=10 + i) for i in range(e)])
    experts = torch.logspace(-2, 2, e)[torch.randperm(e, generator=g)]
    parts = torch.tensor([1.0, 30.0]).repeat_interleave(inter)  # the up part 30x the gate part
    return (w * experts[:, None, None] * parts[None, :, None]).to(torch.bfloat16)


def test_an_expert_stack_quantizes_in_chunks_to_each_experts_bits(monkeypatch):
    """`quantize_weight` of a stack [E, N, K] and `Fp8Weight.quantize` (a chunk of experts a call) give each
    expert the bits it gets alone, torch.equal: packed parts, K = 200 (not a multiple of 128), 80-row parts (not a
    multiple of 128 either). Negative control: one scale a block position for the whole stack differs."""
    from exactrl.ops import fp8

    e, inter, k = 7, 80, 200
    w = _trained_stack(e, inter, k)
    alone = [quantize_weight(w[i], [inter, inter]) for i in range(e)]
    q_ref = torch.stack([q for q, _ in alone]).view(torch.uint8)
    s_ref = torch.stack([s for _, s in alone])
    q, s = quantize_weight(w, [inter, inter])  # the whole stack in one call
    assert torch.equal(q.view(torch.uint8), q_ref) and torch.equal(s, s_ref)
    # Fp8Weight: chunks of 3 experts (3 + 3 + 1) at this bound, 3 calls.
    per_expert = 1 * BLOCK * 2 * BLOCK  # one part's rows padded to a 128-block, K to two
    monkeypatch.setattr(fp8, "QUANTIZE_CHUNK_ELEMENTS", 3 * per_expert + 5)
    calls = []
    inner = fp8.quantize_weight
    monkeypatch.setattr(fp8, "quantize_weight", lambda t, *a: calls.append(t.shape[0]) or inner(t, *a))
    entry = fp8.Fp8Weight(w, [inter, inter])
    entry.quantize()
    assert calls == [3, 3, 1]
    assert torch.equal(entry.q.view(torch.uint8), q_ref) and torch.equal(entry.scale, s_ref)
    assert torch.equal(entry.operand, entry.q.to(torch.float64))
    # Parts of different block counts (80 rows: one block; 200: two): the chunk is sized by the larger part's fp32
    # working copy (2 experts a call here, not the 3 the smaller part would allow), and each expert keeps its bits.
    w2 = _trained_stack(e, 140, k)
    alone2 = [quantize_weight(w2[i], [80, 200]) for i in range(e)]
    q_ref2 = torch.stack([q for q, _ in alone2]).view(torch.uint8)
    s_ref2 = torch.stack([s for _, s in alone2])
    monkeypatch.setattr(fp8, "QUANTIZE_CHUNK_ELEMENTS", 2 * (2 * BLOCK * 2 * BLOCK) + 5)
    calls.clear()
    entry2 = fp8.Fp8Weight(w2, [80, 200])
    entry2.quantize()
    assert calls == [2, 2, 2, 1]
    assert torch.equal(entry2.q.view(torch.uint8), q_ref2) and torch.equal(entry2.scale, s_ref2)
    # At least one expert a call, however large the expert.
    monkeypatch.setattr(fp8, "QUANTIZE_CHUNK_ELEMENTS", 1)
    assert fp8.expert_chunk(w.shape, [inter, inter]) == 1
    # Negative control: the stack sharing each block position's scale (its largest expert's) is not the same copy.
    groups = torch.zeros(e, 2 * BLOCK, 2 * BLOCK)
    groups[:, :inter, :k], groups[:, BLOCK : BLOCK + inter, :k] = w[:, :inter].float(), w[:, inter:].float()
    groups = groups.view(e, 2, BLOCK, 2, BLOCK)
    shared = (groups.abs().amax(dim=(0, 2, 4), keepdim=True) / FP8_MAX).expand(e, 2, 1, 2, 1)
    q_shared = (groups / shared).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(e, 2 * BLOCK, 2 * BLOCK)
    q_shared = torch.cat([q_shared[:, :inter], q_shared[:, BLOCK : BLOCK + inter]], dim=1)
    assert not torch.equal(q_shared.view(torch.uint8), q_ref)


def test_activation_quantizer_is_row_local():
    """A row's fp8 bits and scales are the same whatever other rows are in the call (torch.equal)."""
    x = _data(24, 256, seed=3)
    q, s = quantize_activations(x)
    big = torch.cat([x, 1e7 * torch.ones(3, 256)])  # rows of a far larger magnitude join the batch
    for rows in ([5], [0, 7, 23], list(range(24))):
        for batch in (x[rows], torch.cat([big[-3:], x[rows]])):
            qb, sb = quantize_activations(batch)
            n = len(rows)
            assert torch.equal(qb[-n:].float(), q[rows].float()) and torch.equal(sb[-n:], s[rows])

    # negative control: a per-tensor scale (amax over the whole batch) changes a row's bits when another joins
    def per_tensor(t):
        return (t / (t.abs().amax() / FP8_MAX)).to(FP8_DTYPE)

    assert not torch.equal(per_tensor(x)[5].float(), per_tensor(big)[5].float())


def _quant_pair(m, n, k, seed=4):
    qx, sx = quantize_activations(_data(m, k, seed=seed))
    qw, sw = quantize_weight(_data(n, k, seed=seed + 1))
    return qx, sx, qw, sw


def test_cpu_gemm_is_batch_invariant():
    qx, sx, qw, sw = _quant_pair(70, 96, 384)
    bias = torch.randn(96)
    full = fp8_gemm_cpu(qx, sx, qw, sw, bias, torch.bfloat16)
    for rows in ([0], [69], [3, 4, 5], list(range(0, 70, 7)), list(range(33))):
        part = fp8_gemm_cpu(qx[rows], sx[rows], qw, sw, bias, torch.bfloat16)
        assert torch.equal(part, full[rows]), rows
    # the output against a float64 evaluation of the same formula
    a64 = qx.double().view(70, 3, BLOCK) * sx.double()[..., None]
    w64 = qw.double().view(96, 3, BLOCK) * sw.double()[..., None]
    ref = torch.einsum("mkc,nkc->mn", a64, w64) + bias.double()
    assert torch.allclose(full.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_cpu_gemm_dot_order_matters_negative_control():
    """Why the CPU dot is taken in float64: the same fp8 products added in fp32 in two orders give other bits, so
    a BLAS whose blocking follows M would give a row other bits. The float64 dot is exact, in any order."""
    qx, _, qw, _ = _quant_pair(64, 64, 128, seed=7)
    prods = qx.float()[:, None, :] * qw.float()[None, :, :]  # [M, N, 128], every product exact in fp32
    fwd = torch.zeros(64, 64)
    bwd = torch.zeros(64, 64)
    for i in range(BLOCK):
        fwd = fwd + prods[..., i]
        bwd = bwd + prods[..., BLOCK - 1 - i]
    assert not torch.equal(fwd, bwd)
    p64 = prods.double()
    f64, b64 = p64.sum(-1), p64.flip(-1).cumsum(-1)[..., -1]
    assert torch.equal(f64, b64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_backward_is_the_wrapped_backends(dtype):
    """The fp8 projections' backward is the wrapped backend's `linear` backward with the model-dtype weight (the
    quantizers taken as the identity): dX, dW and dB torch.equal those of ExactTorchOps.linear given the same
    grad_out, at a row count the exact linear pads (13), for a plain and a packed projection."""
    inner = ExactTorchOps()
    x = _data(13, 200, seed=8).to(dtype)
    # trained-looking: rows and columns of other magnitudes
    w = torch.nn.Parameter((0.05 * _data(72, 200, seed=9)).to(dtype))
    b = torch.nn.Parameter(torch.randn(72).to(dtype))
    g = torch.randn(13, 72).to(dtype)
    sizes = [40, 16, 16]
    ops = check_backward_is_the_wrapped_backends(inner, x, w, b, g, sizes)
    gs = list(g.split(sizes, dim=-1))
    ref = _grads(lambda *a: inner.packed_linear(*a, sizes)[:2], x, w, b, gs[:2])
    # and the function itself, its backward given the wrapped backend explicitly
    e = ops._entry(w)
    got = _grads(lambda *a: fp8_packed_linear(*a, e.operand, e.scale, sizes, inner)[:2], x, w, b, gs[:2])
    assert all(torch.equal(a, r) for a, r in zip(got, ref))
    got = _grads(lambda *a: fp8_linear(*a, e.operand, e.scale), x, w, b, g)  # default: the CPU's exact ops
    assert all(torch.equal(a, r) for a, r in zip(got, _grads(inner.linear, x, w, b, g)))


def test_fp8_ops_requantizes_a_changed_weight():
    """A registered weight written in place (an optimizer step, a weight sync) is quantized again before use."""
    lin = torch.nn.Linear(128, 64, bias=False)
    ops = Fp8Ops(ExactTorchOps())
    ops.register(lin.weight)
    x = torch.randn(3, 128)
    before = ops.linear(x, lin.weight)
    with torch.no_grad():
        lin.weight.mul_(2.0)
    after = ops.linear(x, lin.weight)
    assert torch.equal(after, 2 * before)  # scales double, the fp8 values stay: exactly twice
    other = torch.nn.Linear(128, 64, bias=False)
    assert torch.equal(ops.linear(x, other.weight), ExactTorchOps().linear(x, other.weight))  # not registered


def _all_slots(ops, x, gate_up, down, weights, ids, e_gu, e_down):
    """Every expert over every token, each keeping the slots routed to it (`torch.where`: no arithmetic)."""
    from exactrl.ops.moe_torch import combine_rank_order

    t, k = ids.shape
    outs = x.new_zeros(t, k, x.shape[1])
    for e in range(gate_up.shape[0]):
        o = ops._expert(x, e, gate_up, down, e_gu, e_down)
        outs = torch.where((ids == e)[..., None], o[:, None, :], outs)
    return combine_rank_order(outs, weights, x.dtype)


def test_fp8_experts_grouped_equal_all_slots():
    """The CPU's grouped experts (each expert on its routed slots) and the all-slots form (every expert on every
    token, the routed slots kept: what CUDA's grouped kernels compute) give every token the same bits: the fp8
    GEMM is row-local."""
    from exactrl.ops.moe_torch import route_topk

    g = torch.Generator().manual_seed(11)
    e, d, inter, t = 5, 136, 40, 23
    gate_up = torch.nn.Parameter(0.1 * torch.randn(e, 2 * inter, d, generator=g))
    down = torch.nn.Parameter(0.1 * torch.randn(e, d, inter, generator=g))
    ops = Fp8Ops(ExactTorchOps())
    ops.register(gate_up, [inter, inter])
    ops.register(down)
    x = torch.randn(t, d, generator=g)
    weights, ids = route_topk(torch.randn(t, e, generator=g), 2, True)
    entries = ops._entry(gate_up), ops._entry(down)
    grouped = ops.experts_grouped(x, gate_up, down, weights, ids, *entries)
    every = _all_slots(ops, x, gate_up, down, weights, ids, *entries)
    assert torch.equal(grouped, every)
    assert torch.equal(ops.moe_experts(x, gate_up, down, weights, ids), grouped)
    # a token alone gets its bits from the full call
    assert torch.equal(ops.moe_experts(x[4:5], gate_up, down, weights[4:5], ids[4:5]), grouped[4:5])
    # negative control: the experts in the model dtype (the wrapped backend) are other numbers
    assert not torch.equal(ExactTorchOps().moe_experts(x, gate_up, down, weights, ids), grouped)


def test_a_gpu_without_fp8_tensor_cores_is_refused_by_name(monkeypatch):
    import pytest

    from exactrl.ops.fp8 import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"A100-SXM4-80GB is 8\.0.*model\.precision"):
        check_fp8_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_fp8_device("cuda:0")  # Ada and newer pass
    check_fp8_device("cpu")  # the CPU emulates it
