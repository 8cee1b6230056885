"""The fast CUDA backend (marker `gpu`, skipped without CUDA): correct numbers, not batch-invariant ones.

- FlashAttention varlen on packed sequences (GQA, a graph bucket's trailing empty sequences) against the fp32
  reference, forward and gradients.
- A whole model: fast-mode logprobs close to exact mode's (the same model, other kernels), and a training step's
  loss and gradients close too.
- The backend is what `get_ops(cuda, exact=False)` returns.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

if torch.cuda.is_available():
    from exactrl.ops import get_ops
    from exactrl.ops.batch import AttentionBatch
    from exactrl.ops.fast_cuda import FastCudaOps
    from exactrl.ops.torch_ops import attention_reference


def test_get_ops_fast_cuda():
    ops = get_ops("cuda", exact=False)
    assert isinstance(ops, FastCudaOps) and not ops.exact
    assert ops.training_attention == "flash-varlen"


@pytest.mark.parametrize("hq,hkv", [(16, 8), (8, 8), (14, 2)])
def test_flash_varlen_matches_reference(hq, hkv):
    torch.manual_seed(0)
    ops = FastCudaOps()
    lens = [300, 17, 1, 513]
    batch = AttentionBatch.packed(lens, device="cuda", num_seqs=6, width=528)  # two empty sequences
    T = sum(lens)
    q = torch.randn(T, hq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = ops.attention(q, k, v, batch)
    ref = attention_reference(q.float(), k.float(), v.float(), batch)
    assert (out.float() - ref).abs().max().item() < 2e-2
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g.float())
    for a, b in ((dq, rq), (dk, rk), (dv, rv)):
        assert torch.isfinite(a).all()
        assert (a.float() - b.float()).abs().max().item() < 5e-2 * max(1.0, b.abs().max().item())


def test_fast_model_close_to_exact():
    from exactrl.model.config import preset
    from exactrl.model.qwen import build_model

    cfg = preset("tiny")
    exact = build_model(cfg, device="cuda", dtype=torch.bfloat16, exact=True, seed=3)
    fast = build_model(cfg, device="cuda", dtype=torch.bfloat16, exact=False, seed=3)
    assert isinstance(fast.ops, FastCudaOps)
    lens = [40, 7, 90]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g).cuda()
    batch = AttentionBatch.packed(lens, device="cuda")
    targets = torch.roll(ids, -1)
    lp = {}
    for name, model in (("exact", exact), ("fast", fast)):
        hidden = model(ids, batch.q_pos, batch)
        lp[name] = model.logprobs(hidden, targets, temperature=0.7)[0]
        lp[name].sum().backward()
    assert (lp["exact"] - lp["fast"]).abs().max().item() < 5e-2
    for (n, pe), pf in zip(exact.named_parameters(), fast.parameters()):
        assert pf.grad is not None and torch.isfinite(pf.grad).all(), n
        scale = pe.grad.float().abs().max().item()
        assert (pe.grad.float() - pf.grad.float()).abs().max().item() <= 0.1 * max(scale, 1e-3), n


def test_fast_logprobs_keep_cublas_logits_and_match_reference():
    """Training-size calls keep their logits from a cuBLAS LM head (through `cublas_mm`, fp32 outputs included);
    logprobs, entropies and both gradients match a float64 reference."""
    from exactrl.ops.fast_cuda import cublas_mm
    from exactrl.ops.triton import logprobs as lpm

    T, D, V, temp = 512, 256, 5000, 0.8
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=g) * D**-0.5 * 2).to(torch.bfloat16)
    targets = torch.randint(0, V, (T,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(T, device="cuda", generator=g), torch.randn(T, device="cuda", generator=g)
    calls = []

    def counted(x, wt, out_dtype=None):
        calls.append(out_dtype)
        return cublas_mm(x, wt, out_dtype)

    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = lpm.logprobs(hl, wl, targets, temp, True, mm=counted)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert calls[0] is None and torch.float32 in calls  # forward logits, then dhidden's fp32 slices
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    logp = torch.log_softmax((hr @ wr.T) / temp, -1)
    rlp, rent = logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    ((rlp * g_lp.double()).sum() + (rent * g_ent.double()).sum()).backward()
    assert (lp.double() - rlp).abs().max().item() < 0.05
    for a, r in ((hl.grad, hr.grad), (wl.grad, wr.grad)):
        err = (a.double() - r).norm() / r.norm()
        assert err.item() < 2e-2, err.item()
    assert FastCudaOps().logprobs(h, w, targets, temp)[0].shape == (T,)


def test_fast_packed_linear_gradients_on_cuda():
    """cuBLAS packed projection: the parts' gradients reduced by a chain of GEMMs (no concatenated copy) match
    separate projections' (bf16 tolerance)."""
    ops = FastCudaOps()
    g = torch.Generator(device="cuda").manual_seed(1)
    sizes = [512, 128, 128]
    x = torch.randn(1000, 256, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (
        (torch.randn(sum(sizes), 256, device="cuda", generator=g) * 0.06)
        .to(torch.bfloat16)
        .requires_grad_(True)
    )
    outs = ops.packed_linear(x, w, None, sizes)
    ups = [torch.randn(o.shape, device="cuda", generator=g).to(torch.bfloat16) for o in outs]
    gx, gw = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outs, ups)), (x, w))
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = torch.nn.functional.linear(xr, wr).split(sizes, dim=-1)
    rx, rw = torch.autograd.grad(sum((o * u.double()).sum() for o, u in zip(ref, ups)), (xr, wr))
    for a, r in ((gx, rx), (gw, rw)):
        assert ((a.double() - r).norm() / r.norm()).item() < 1e-2
