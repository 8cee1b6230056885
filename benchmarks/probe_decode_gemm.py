"""Can a decode step (few rows) use a narrower tile of the invariant GEMM without changing a row's bits?

When this probe was written the exact matmul ran ONE tile config per dtype (128 x 128 x 64, persistent, TMA; the
tile family of exactrl/ops/triton/matmul.py `tile_config` came out of it). With a handful of rows the
weight is streamed by only cdiv(N, 128) programs (8 for N = 1024), far from the SMs' bandwidth. A config with
the same BLOCK_K, the same in-order K loop and the same MMA instruction family but a narrower N tile would put
more programs on the weight. This probe checks, per model shape, whether such configs give every row the bits
of the default config's 300-row call (torch.equal), and times them at 1, 8, 16, 64 rows against the default
config and cuBLAS. JSON lines on stdout.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_decode_gemm.py`.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from _script import require_cuda  # benchmarks/: the script's own folder is on sys.path

from exactrl.model.config import preset
from exactrl.ops.triton.matmul import MatmulConfig, matmul


def _shapes(name: str) -> dict[str, tuple[int, int]]:
    c = preset(name)
    h, hd = c.hidden_size, c.head_dim
    return {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * hd, h),
        "o": (h, c.num_heads * hd),
        "gate_up": (2 * c.intermediate_size, h),
        "down": (h, c.intermediate_size),
    }


def _time(fn, reps: int = 20) -> float:
    """GPU microseconds per call: `reps` calls captured in one CUDA graph, replayed (no host launch cost, which
    is what a decode step's graph sees), inside `pdl_launches` as the engine's steps run."""
    from exactrl.ops.triton.common import pdl_launches

    if not torch.cuda.is_available():  # Triton's interpreter on the CPU (a dry run): wall time of one call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    with pdl_launches():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (10 * reps) * 1e6


CANDIDATES = [
    MatmulConfig(64, bn, 64, 8, 4, st, tma=tma, flatten=tma)
    for bn in (16, 32, 64)
    for st in (3, 5)
    for tma in (True, False)
]
SIZES = (1, 16, 64, 128, 256)
# --mid: tiles for the rows between decode and training (a long-tailed rollout's 65..512 running sequences).
MID_CANDIDATES = [MatmulConfig(64, bn, 64, 8, 4, 5) for bn in (16, 32, 64, 128)] + [
    MatmulConfig(128, bn, 64, 8, 8, st, tma=tma, flatten=tma)
    for bn in (32, 64, 128)
    for st in (4,)
    for tma in (True, False)
]
MID_SIZES = (64, 96, 128, 192, 256, 384, 512)
# --bk: deeper K blocks for decode (fewer, larger loads in a program's K loop: a one-row GEMM is a chain of
# dependent loads), and 16-row tiles (another MMA instruction on Hopper): same bits as the training tile?
BK_CANDIDATES = [
    MatmulConfig(64, bn, bk, 8, 4, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4)
] + [
    MatmulConfig(16, bn, bk, 8, w, 4)
    for bn, bk, w in ((32, 128, 1), (64, 128, 2), (32, 256, 2), (64, 256, 4))
]
BK_SIZES = (1, 16, 64)
# --mid-bk: the deeper K steps of the decode family for the rows between decode and training (65..512), where the
# tile rule takes K steps of 64 today.
MID_BK_CANDIDATES = [MatmulConfig(64, bn, 128, 8, 4, st) for bn in (32, 64, 128) for st in (3, 4)]
# --wide: the decode tiles (and a 128-column one) where the output is wide enough for the training tile to fill
# the SMs (tile_config then takes it even for one row).
WIDE_CANDIDATES = [
    MatmulConfig(64, bn, bk, 8, 4, st)
    for bn, bk, st in ((128, 128, 3), (64, 128, 4), (32, 128, 4), (64, 256, 3))
]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="narrower invariant GEMM tiles: same bits? how fast?")
    ap.add_argument("--mid", action="store_true", help="tiles and row counts between decode and training")
    ap.add_argument("--bk", action="store_true", help="deeper K blocks and 16-row tiles for decode rows")
    ap.add_argument(
        "--wide",
        action="store_true",
        help="decode rows on the wide outputs (LM head, qwen3-1.7b's gate/up) that take the training tile today",
    )
    ap.add_argument("--mid-bk", action="store_true", help="K steps of 128 at 65..512 rows")
    args = ap.parse_args()
    require_cuda("probe_decode_gemm.py")
    candidates, sizes = (MID_CANDIDATES, MID_SIZES) if args.mid else (CANDIDATES, SIZES)
    if args.bk:
        candidates, sizes = BK_CANDIDATES, BK_SIZES
    if args.wide:
        candidates, sizes = WIDE_CANDIDATES, BK_SIZES
    if args.mid_bk:
        candidates, sizes = MID_BK_CANDIDATES, MID_SIZES
    dt = torch.bfloat16
    torch.manual_seed(0)
    for model in ("qwen3-0.6b", "qwen3-1.7b"):
        shapes = _shapes(model)
        if args.wide:
            c = preset(model)
            shapes = {"gate_up": shapes["gate_up"], "lm_head": (c.vocab_size, c.hidden_size)}
        for part, (n, k) in shapes.items():
            w = (torch.randn(n, k, device="cuda") * 0.02).to(dt)
            x = torch.randn(300, k, device="cuda").to(dt)
            ref = matmul(x, w)
            rec = {"model": model, "part": part, "N": n, "K": k}
            rec["us_default"] = {m: round(_time(lambda m=m, x=x, w=w: matmul(x[:m], w)), 1) for m in sizes}
            rec["us_cublas"] = {m: round(_time(lambda m=m, x=x, w=w: F.linear(x[:m], w)), 1) for m in sizes}
            for cfg in candidates:
                try:
                    matmul(x[:1], w, config=cfg)
                except Exception as e:  # out of shared memory or registers: report and go on
                    rec[f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"] = {"error": str(e)[:100]}
                    continue
                equal = True
                for m, off in ((1, 0), (1, 137), (3, 5), (8, 200), (16, 17), (64, 236), (200, 100), (300, 0)):
                    y = matmul(x[off : off + m], w, config=cfg)
                    equal &= bool(torch.equal(y, ref[off : off + m]))
                key = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}{'tma' if cfg.tma else ''}"
                rec[key] = {
                    "equal": equal,
                    "us": {
                        m: round(_time(lambda m=m, x=x, w=w, c=cfg: matmul(x[:m], w, config=c)), 1)
                        for m in sizes
                    },
                }
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
