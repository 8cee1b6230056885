"""Qwen3's q/k norm + RoPE and the paged K/V write in one launch (`Ops.qk_norm_rope`), against today's three.

Runs everywhere: without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the kernels
are imported), with CUDA compiled; the qwen3-0.6b shapes and the launch count on the GPU are in
test_qk_fuse_gpu.py. The fused op must give q, k and every byte of both caches as rms_norm_rope (q), rms_norm_rope
(k) and write_kv_cache do, for decode and prefill steps with GQA, scattered positions and slots and a padding slot
shared by several rows; a weight one ulp away must show.
"""

from __future__ import annotations

import pytest
import torch
from qk_step import EPS, clone_cache, differences, fused, make_step, one_ulp_away, unfused
from triton_mode import triton_device

DEVICE = triton_device()

from exactrl.model.config import ModelConfig  # noqa: E402
from exactrl.model.qwen import Attention  # noqa: E402
from exactrl.ops.batch import AttentionBatch  # noqa: E402
from exactrl.ops.torch_ops import ExactTorchOps, FastOps  # noqa: E402
from exactrl.ops.triton import kv_write, norm  # noqa: E402
from exactrl.ops.triton_ops import TritonOps  # noqa: E402

ops = TritonOps()
HQ, HKV, DH = 6, 2, 64  # GQA 3; norm_config(64) tiles 64 rows, so q and k each end in a partial tile mostly


@pytest.mark.parametrize("T", [1, 2, 3, 5, 17, 64])
def test_fused_equals_the_three_launches(T):
    """q, k and both caches bit for bit; from T = 3 on the last two rows are padding rows sharing one slot."""
    s = make_step(T, HQ, HKV, DH, torch.bfloat16, DEVICE, seed=T, pad=2 if T >= 3 else 0)
    ref_cache, got_cache = clone_cache(s), clone_cache(s)
    ref = unfused(ops, s, ref_cache)
    got = fused(ops, s, got_cache)
    assert not differences(got, got_cache, ref, ref_cache), differences(got, got_cache, ref, ref_cache)
    assert not torch.equal(got_cache[0], s.cache[0]) and not torch.equal(got_cache[1], s.cache[1])  # it wrote
    # Negative control: a k weight one ulp away changes k and the cached K rows (and nothing of q).
    bad_cache = clone_cache(s)
    bad = fused(ops, s, bad_cache, k_weight=one_ulp_away(s.k_weight))
    assert differences(bad, bad_cache, ref, ref_cache) == ["k", "k cache"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_other_dtypes_and_head_dims(dtype):
    """fp32 and fp16 rows; a head dim whose tile is wider than the row (40 -> 64) and one of 128 (qwen3's)."""
    for dh, T in ((40, 7), (128, 9)):
        s = make_step(T, 4, 2, dh, dtype, DEVICE, seed=dh, pad=3)
        ref_cache, got_cache = clone_cache(s), clone_cache(s)
        ref = unfused(ops, s, ref_cache)
        got = fused(ops, s, got_cache)
        assert not differences(got, got_cache, ref, ref_cache), (
            dh,
            differences(got, got_cache, ref, ref_cache),
        )


def test_inputs_of_other_layouts():
    """Contiguous q/k (a LoRA-adapted projection) at an address that is not 16-byte aligned, and a v whose heads
    are not contiguous: read or copied as rms_norm_rope and write_kv_cache read them, same bytes."""
    s = make_step(11, HQ, HKV, DH, torch.bfloat16, DEVICE, seed=5, pad=2)
    buf = torch.empty(s.q.numel() + 1, dtype=s.q.dtype, device=DEVICE)
    q = buf[1:].view(s.q.shape).copy_(s.q)  # 2 bytes past an aligned allocation
    k = s.k.contiguous()
    v = s.v.transpose(0, 1).contiguous().transpose(0, 1)  # [T, Hkv, Dh] with the token stride innermost
    assert q.data_ptr() % 16 and not (v.stride(2) == 1 and v.stride(1) == DH)
    s = s._replace(q=q, k=k, v=v)
    ref_cache, got_cache = clone_cache(s), clone_cache(s)
    ref = unfused(ops, s, ref_cache)
    got = fused(ops, s, got_cache)
    assert not differences(got, got_cache, ref, ref_cache), differences(got, got_cache, ref, ref_cache)


def test_cache_of_another_dtype_converts_as_write_kv_cache():
    """fp32 rows into a bf16 cache: the fused launch leaves the write to write_kv_cache, which converts."""
    s = make_step(6, HQ, HKV, DH, torch.float32, DEVICE, seed=6)
    s = s._replace(cache=tuple(c.to(torch.bfloat16) for c in s.cache))
    ref_cache, got_cache = clone_cache(s), clone_cache(s)
    ref = unfused(ops, s, ref_cache)
    got = fused(ops, s, got_cache)
    assert not differences(got, got_cache, ref, ref_cache), differences(got, got_cache, ref, ref_cache)


def test_without_cache_and_under_autograd():
    """Training: no cache; with autograd recording, the two rms_norm_rope calls run (their backward), so values
    and gradients are those of the two calls; without it, the fused launch gives the same values."""
    s = make_step(13, HQ, HKV, DH, torch.bfloat16, DEVICE, seed=7)
    leaves = [t.detach().clone().requires_grad_(True) for t in (s.q, s.k, s.q_weight, s.k_weight)]
    twins = [t.detach().clone().requires_grad_(True) for t in (s.q, s.k, s.q_weight, s.k_weight)]
    q, k = ops.qk_norm_rope(leaves[0], leaves[1], s.v, leaves[2], leaves[3], EPS, s.positions, s.cos_sin)
    q2 = ops.rms_norm_rope(twins[0], twins[2], EPS, s.positions, s.cos_sin)
    k2 = ops.rms_norm_rope(twins[1], twins[3], EPS, s.positions, s.cos_sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    gq = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(q.dtype).to(DEVICE)
    gk = torch.randn(k.shape, generator=torch.Generator().manual_seed(9)).to(k.dtype).to(DEVICE)
    torch.autograd.backward((q, k), (gq, gk))
    torch.autograd.backward((q2, k2), (gq, gk))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, twins))
    with torch.no_grad():
        qn, kn = ops.qk_norm_rope(s.q, s.k, s.v, s.q_weight, s.k_weight, EPS, s.positions, s.cos_sin)
    assert torch.equal(qn, q2) and torch.equal(kn, k2)


def test_cache_without_slot_mapping_is_an_error():
    s = make_step(2, HQ, HKV, DH, torch.bfloat16, DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.qk_norm_rope(s.q, s.k, s.v, s.q_weight, s.k_weight, EPS, s.positions, s.cos_sin, s.cache)
    with pytest.raises(ValueError, match="slot_mapping"):
        ExactTorchOps().qk_norm_rope(
            s.q, s.k, s.v, s.q_weight, s.k_weight, EPS, s.positions, s.cos_sin, s.cache
        )


class _Counted:
    """Stands in for a @triton.jit kernel and counts its launches (`kernel[grid](...)`)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _tiny_qwen3_attention(dtype: torch.dtype) -> tuple[Attention, ModelConfig]:
    cfg = ModelConfig(
        architecture="qwen3", vocab_size=64, hidden_size=96, intermediate_size=128, num_layers=1, num_heads=HQ,
        num_kv_heads=HKV, head_dim=DH, max_position_embeddings=512,
    )  # fmt: skip
    attn = Attention(cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        attn.qkv_proj.weight.copy_(torch.randn(attn.qkv_proj.weight.shape, generator=g) * 0.1)
        attn.o_proj.weight.copy_(torch.randn(attn.o_proj.weight.shape, generator=g) * 0.1)
        attn.q_norm.weight.copy_(1 + 0.5 * torch.randn(DH, generator=g))
        attn.k_norm.weight.copy_(0.7 + 0.5 * torch.randn(DH, generator=g))
    return attn.to(device=DEVICE, dtype=dtype), cfg


def test_qwen3_attention_decode_launches_once_and_keeps_its_bits(monkeypatch):
    """The model's Qwen3 attention against the cache (a prefill of two sequences, then a decode step of both):
    the layer's output and both caches have the bits of today's sequence (rms_norm_rope twice, attention writing
    K/V), and the q/k norm, RoPE and K/V write are one launch: no rms_norm_rope launch, no separate KV write."""
    attn, cfg = _tiny_qwen3_attention(torch.bfloat16)
    cos_sin = cfg.rope_table().to(DEVICE)
    cache = tuple(torch.zeros(4, 16, HKV, DH, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    ref_cache = tuple(c.clone() for c in cache)
    tables = [[2, 0], [3, 1]]

    def old_forward(x, positions, batch, kv):  # Attention.forward before the fusion
        T = x.shape[0]
        q, k, v = attn.qkv_proj(ops, x)
        q = ops.rms_norm_rope(q.view(T, HQ, DH), attn.q_norm.weight, attn.q_norm.eps, positions, cos_sin)
        k = ops.rms_norm_rope(k.view(T, HKV, DH), attn.k_norm.weight, attn.k_norm.eps, positions, cos_sin)
        return attn.o_proj(ops, ops.attention(q, k, v.view(T, HKV, DH), batch, kv).reshape(T, -1))

    g = torch.Generator().manual_seed(12)
    steps = [([0, 0], [5, 9]), ([5, 9], [1, 1])]  # (cached, new) per sequence: prefill, then decode
    for cached, new in steps:
        batch = AttentionBatch.paged(cached, new, tables, 16, device=DEVICE)
        x = torch.randn(sum(new), cfg.hidden_size, generator=g).to(torch.bfloat16).to(DEVICE)
        kernels = [
            (norm, "_qk_norm_rope_kernel"),
            (norm, "_rms_norm_fwd_kernel"),
            (kv_write, "_kv_write_kernel"),
        ]
        counts = {name: _Counted(getattr(mod, name)) for mod, name in kernels}
        with monkeypatch.context() as m:
            for mod, name in kernels:
                m.setattr(mod, name, counts[name])
            with torch.no_grad():
                got = attn(ops, x, batch.q_pos, cos_sin, batch, cache)
        assert {n: c.launches for n, c in counts.items()} == {
            "_qk_norm_rope_kernel": 1, "_rms_norm_fwd_kernel": 0, "_kv_write_kernel": 0,
        }  # fmt: skip
        with torch.no_grad():
            ref = old_forward(x, batch.q_pos, batch, ref_cache)
        assert torch.equal(got, ref)
        assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])


@pytest.mark.parametrize("backend", [ExactTorchOps, FastOps])
def test_torch_backends_compose_and_attend_without_writing_twice(backend):
    """The CPU backends' qk_norm_rope is the composition (rms_norm_rope twice, write_kv_cache); attention with
    kv_written=True reads the cache as written and equals attention writing the rows itself."""
    tops = backend()
    s = make_step(5, HQ, HKV, DH, torch.float32, "cpu", seed=13)
    cache = tuple(torch.zeros(2, 16, HKV, DH) for _ in range(2))
    ref_cache = tuple(c.clone() for c in cache)
    batch = AttentionBatch.paged([0, 0], [2, 3], [[1], [0]], 16)
    pos = batch.q_pos
    q, k = tops.qk_norm_rope(
        s.q, s.k, s.v, s.q_weight, s.k_weight, EPS, pos, s.cos_sin, cache, batch.slot_mapping
    )
    out = tops.attention(
        q, torch.full_like(k, float("nan")), torch.full_like(s.v, float("nan")), batch, cache, kv_written=True
    )
    q2 = tops.rms_norm_rope(s.q, s.q_weight, EPS, pos, s.cos_sin)
    k2 = tops.rms_norm_rope(s.k, s.k_weight, EPS, pos, s.cos_sin)
    ref = tops.attention(q2, k2, s.v, batch, ref_cache)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(out, ref)
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])
    # Control: with the k weight one ulp away the cached K rows differ.
    bad = tuple(c.clone().zero_() for c in cache)
    tops.qk_norm_rope(
        s.q, s.k, s.v, s.q_weight, one_ulp_away(s.k_weight), EPS, pos, s.cos_sin, bad, batch.slot_mapping
    )
    assert not torch.equal(bad[0], ref_cache[0]) and torch.equal(bad[1], ref_cache[1])


def test_residual_and_rope_together_are_refused():
    """rms_norm_fwd's RoPE rows read no residual: asking for both is an error, not an uninitialised `summed`."""
    from exactrl.ops.triton.norm import RopeArgs, rms_norm_fwd

    x = torch.randn(3, 2, 8)
    cs = torch.randn(16, 8)
    with pytest.raises(ValueError, match="residual and rope"):
        rms_norm_fwd(x, torch.ones(8), 1e-6, residual=x, rope=RopeArgs(torch.arange(3), cs, 2, x.stride(0)))
