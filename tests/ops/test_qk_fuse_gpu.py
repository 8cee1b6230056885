"""The fused q/k norm + RoPE + K/V write (`TritonOps.qk_norm_rope`) compiled on the GPU at qwen3-0.6b's attention
shape (Hq 16, Hkv 8, Dh 128), marker `gpu`.

- q, k and both caches equal today's three launches (rms_norm_rope for q, for k, write_kv_cache) bit for bit for
  every T of the sweep, bf16 and fp32, decode buckets with padding rows sharing the scratch slot; a k weight one ulp
  away shows.
- The op is one kernel on the GPU, and a CUDA graph of it replays the eager bits.
The engine's end-to-end parity at this shape (engine logprobs == trainer logprobs, eager and CUDA graphs) runs in
tests/engine/test_turns_gpu.py and tests/engine/test_decode_graphs.py, whose Qwen3 decode goes through this op.
"""

from __future__ import annotations

import pytest
import torch
from qk_step import EPS, clone_cache, differences, fused, make_step, one_ulp_away, unfused

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

if torch.cuda.is_available():
    from exactrl.ops.triton_ops import TritonOps

    ops = TritonOps()

HQ, HKV, DH = 16, 8, 128
SWEEP = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 33, 64, 100, 127, 128, 255, 256, 257, 300]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_equals_the_three_launches_sweep(dtype):
    bad = []
    for T in SWEEP:
        s = make_step(T, HQ, HKV, DH, dtype, "cuda", seed=T, pages=32, pad=T // 4)
        ref_cache, got_cache = clone_cache(s), clone_cache(s)
        ref = unfused(ops, s, ref_cache)
        got = fused(ops, s, got_cache)
        diff = differences(got, got_cache, ref, ref_cache)
        # Without a cache (the trainer's no-grad scoring forward): another compiled variant of the kernel.
        q, k = ops.qk_norm_rope(
            s.q, s.k, s.v, s.q_weight, s.k_weight, EPS, s.positions, s.cos_sin, None, None
        )
        diff += [
            name
            for name, a, b in (("q (no cache)", q, ref[0]), ("k (no cache)", k, ref[1]))
            if not torch.equal(a, b)
        ]
        if diff:
            bad.append((T, diff))
    assert not bad, f"fused differs from rms_norm_rope x2 + write_kv_cache at (T, outputs) {bad}"
    s = make_step(9, HQ, HKV, DH, dtype, "cuda", seed=1, pages=32)
    ref_cache, bad_cache = clone_cache(s), clone_cache(s)
    ref = unfused(ops, s, ref_cache)
    worse = fused(ops, s, bad_cache, k_weight=one_ulp_away(s.k_weight))
    assert differences(worse, bad_cache, ref, ref_cache) == ["k", "k cache"]


def test_one_kernel_and_graph_replay():
    from torch.profiler import ProfilerActivity, profile

    s = make_step(4, HQ, HKV, DH, torch.bfloat16, "cuda", seed=3, pad=1)
    eager_cache = clone_cache(s)
    eager = fused(ops, s, eager_cache)
    cache = clone_cache(s)
    fused(ops, s, cache)  # warm (compiled), so the profile sees launches only
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused(ops, s, cache)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert len(kernels) == 1 and "qk_norm_rope" in kernels[0], kernels
    graph_cache = clone_cache(s)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(ops, s, graph_cache)  # warm on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    graph_cache[0].copy_(s.cache[0])
    graph_cache[1].copy_(s.cache[1])
    with torch.cuda.graph(graph):
        out = fused(ops, s, graph_cache)
    graph_cache[0].copy_(s.cache[0])
    graph_cache[1].copy_(s.cache[1])
    graph.replay()
    torch.cuda.synchronize()
    assert not differences(out, graph_cache, eager, eager_cache)
