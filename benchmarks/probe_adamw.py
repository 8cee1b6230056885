"""The AdamW kernel's launch shape (elements a program, warps) against its memory traffic, on a preset's parameter
shapes: bf16 gradients and weights, fp32 masters and moments (28 bytes an element read or written). Only the
launch shape varies: every element's arithmetic is the same in each, so the fastest can be the default without a
bit of any update changing.

Usage (GPU): PYTHONPATH=. python benchmarks/probe_adamw.py [--preset qwen3-1.7b]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _script import kernel_device  # benchmarks/: the script's own folder is on sys.path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    on_gpu = kernel_device("probe_adamw.py") == "cuda"
    from exactrl.model import build_model, preset
    from exactrl.ops.triton.adamw import AdamWTables, adamw_step

    model = build_model(preset(args.preset), device="meta", dtype=torch.bfloat16, exact=False, seed=0)
    numels = [p.numel() for p in model.parameters()]
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    g = [torch.randn(n, device=dev).to(torch.bfloat16) for n in numels]
    w = [x.clone() for x in g]
    p32 = [x.float() for x in g]
    m = [torch.zeros(n, device=dev) for n in numels]
    v = [torch.zeros(n, device=dev) for n in numels]
    scalars = torch.tensor([1.0, 0.1, 0.001, 0.0], device=dev)
    total = sum(numels)
    results = []
    ref = None
    for block, warps in [(2048, 4), (1024, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]:
        tables = AdamWTables(numels, dev, block=block, num_warps=warps)
        tables.point_at(p32, g, m, v, w)
        kw = dict(lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
        adamw_step(tables, scalars, **kw)
        if on_gpu:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t = time.perf_counter()
        for _ in range(args.iters):
            adamw_step(tables, scalars, **kw)
        if on_gpu:
            b.record()
            torch.cuda.synchronize()
            ms = a.elapsed_time(b) / args.iters
        else:  # Triton's interpreter (the dry run): wall time, meaningless as a rate
            ms = (time.perf_counter() - t) * 1e3 / args.iters
        gbs = total * 28 / ms / 1e6
        row = {"block": block, "num_warps": warps, "ms": round(ms, 3), "GB_per_s": round(gbs, 1)}
        results.append(row)
        ref = ref or ms
        print(
            f"block {block:6d} warps {warps:3d}: {ms:7.3f} ms  {gbs:7.1f} GB/s  ({ref / ms:.2f}x the default)"
        )
    print(json.dumps({"probe_adamw": args.preset, "params": total, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
