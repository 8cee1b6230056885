"""What the compiler made of the exact Triton kernels on this GPU: registers, spills, shared memory, and whether
the matrix kernels use Hopper's wgmma (`HGMMA`) rather than the older mma.sync path.

Runs every op once at qwen3-0.6b shapes (bf16 and fp32), then prints one JSON line per compiled kernel.
Usage: PYTHONPATH=. python benchmarks/gpu_kernel_check.py
"""

from __future__ import annotations

import json
import sys

import torch


def _compiled(fn):
    """The compiled variants of a JIT function (Triton keeps them per device; the layout varies by version)."""
    caches = getattr(fn, "device_caches", None) or {}
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            yield from cache.values()
    yield from (getattr(fn, "cache", None) or {}).get(torch.cuda.current_device(), {}).values()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_kernel_check needs a CUDA GPU", file=sys.stderr)
        return 1
    from exactrl.ops.batch import AttentionBatch
    from exactrl.ops.triton import attention as attn_mod
    from exactrl.ops.triton import elementwise, logprobs, matmul, norm
    from exactrl.ops.triton_ops import TritonOps

    ops = TritonOps()
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(300, 1024, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.randn(3072, 1024, device="cuda", dtype=dtype, requires_grad=True)
        ops.linear(x, w).sum().backward()
        ops.rms_norm(x, torch.ones(1024, device="cuda", dtype=dtype), 1e-6).sum().backward()
        normed, summed = ops.add_rms_norm(
            x, torch.randn_like(x), torch.ones(1024, device="cuda", dtype=dtype), 1e-6
        )
        (normed.sum() + summed.sum()).backward()
        g = torch.randn(300, 3072, device="cuda", dtype=dtype, requires_grad=True)
        ops.silu_mul(g, g.detach()).sum().backward()
        cs = torch.randn(512, 128, device="cuda")
        xr = torch.randn(300, 16, 128, device="cuda", dtype=dtype, requires_grad=True)
        ops.rope(xr, torch.arange(300, device="cuda"), cs).sum().backward()
        lens = [200, 100]
        q = torch.randn(300, 16, 128, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(300, 8, 128, device="cuda", dtype=dtype, requires_grad=True)
        ops.attention(q, k, k, AttentionBatch.packed(lens, device="cuda")).sum().backward()
        wv = torch.randn(4096, 1024, device="cuda", dtype=dtype, requires_grad=True)
        lp, _ = ops.logprobs(x, wv, torch.randint(0, 4096, (300,), device="cuda"), 1.0, True)
        lp.sum().backward()
        ops.logits(x.detach(), wv.detach())
    torch.cuda.synchronize()

    kernels = {
        "matmul": matmul._matmul_kernel,
        "rms_norm_fwd": norm._rms_norm_fwd_kernel,
        "rms_norm_bwd": norm._rms_norm_bwd_kernel,
        "silu_mul_fwd": elementwise._silu_mul_fwd_kernel,
        "rope": elementwise._rope_kernel,
        "attn_fwd": attn_mod._attn_fwd_kernel,
        "attn_bwd_dkdv": attn_mod._attn_bwd_dkdv_kernel,
        "attn_bwd_dq": attn_mod._attn_bwd_dq_kernel,
        "logprob_fwd": logprobs._logprob_fwd_kernel,
        "logprob_bwd": logprobs._logprob_bwd_kernel,
    }
    for name, fn in kernels.items():
        try:
            compiled = list(_compiled(fn))
        except Exception as e:  # the cache layout is Triton-version specific
            print(json.dumps({"kernel": name, "error": repr(e)[:200]}))
            continue
        for ck in compiled:
            asm = getattr(ck, "asm", {}) or {}
            ptx = asm.get("ptx", "") or ""
            meta = getattr(ck, "metadata", None)
            rec = {
                "kernel": name,
                "n_regs": getattr(ck, "n_regs", None),
                "n_spills": getattr(ck, "n_spills", None),
                "shared_bytes": getattr(meta, "shared", None),
                "num_warps": getattr(meta, "num_warps", None),
                "num_stages": getattr(meta, "num_stages", None),
                "wgmma": "wgmma.mma_async" in ptx,
                "mma_sync": "mma.sync" in ptx,
                "constants": str(getattr(getattr(ck, "src", None), "constants", ""))[:200],
            }
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
