"""The fp8 GEMM with the operands' roles swapped (`_fp8_gemm_swap_kernel`, exactrl/ops/triton/fp8_matmul.py) for
few rows: does every swapped tile give every row the reference tile's bits, and how fast is it against the tile
`fp8_tile` picks today and the bf16 exact GEMM at 1..64 rows?

Per projection shape of the given presets: each swapped tile against the reference tile's 640-row call,
torch.equal, at 14 row counts of 1..64 with row offsets; GPU microseconds per call (CUDA graphs, `pdl_launches`, as a decode
step runs; each call reads a weight of its own from a ring larger than the L2, so every call streams its weight
from HBM as a decode step does). One JSON line per shape on stdout.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_fp8_swap.py`.
"""

from __future__ import annotations

import json

import torch
from _script import parser, require_cuda  # benchmarks/: the script's own folder is on sys.path
from probe_decode_gemm import _shapes

from exactrl.ops.fp8 import quantize_activations, quantize_weight
from exactrl.ops.triton.common import num_programs_cap, pdl_launches
from exactrl.ops.triton.fp8_matmul import FP8_REF_TILE, Fp8Tile, fp8_gemm_triton, fp8_tile
from exactrl.ops.triton.matmul import matmul

SWAPPED = tuple(
    Fp8Tile(bm, bn, w, s, True)
    for bm, bn, w, s in (
        (16, 64, 4, 4), (16, 64, 4, 6), (16, 64, 4, 8), (16, 128, 8, 4), (16, 128, 8, 6),
        (32, 64, 4, 4), (32, 128, 8, 4), (64, 64, 4, 4),
    )
)  # fmt: skip
CHECK_ROWS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64)
SIZES = (1, 4, 8, 16, 32, 64)
RING_BYTES = (
    256 << 20
)  # > the H200's 50 MB L2: each call of a graph reads a weight the previous calls did not


def _time_ring(fn, copies: int, reps: int = 3) -> float:
    """GPU microseconds per call: one call per weight copy, captured in one CUDA graph, replayed."""
    with pdl_launches():
        for i in range(copies):
            fn(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(copies):
                fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * copies)


def _probe(model: str, part: str, n: int, k: int, programs: int) -> dict:
    w = torch.randn(n, k, device="cuda") * 0.02
    x = torch.randn(640, k, device="cuda").bfloat16()
    qw, sw = quantize_weight(w)
    qx, sx = quantize_activations(x)
    ref = fp8_gemm_triton(qx, sx, qw, sw, None, torch.bfloat16, tile=FP8_REF_TILE)
    copies = max(2, RING_BYTES // (n * k))
    ring_q = [qw.clone() for _ in range(copies)]
    ring_s = [sw.clone() for _ in range(copies)]
    wb = w.bfloat16()
    ring_b = [wb.clone() for _ in range(max(2, copies // 2))]

    def gemm(m: int, tile: Fp8Tile | None, i: int = 0, off: int = 0) -> torch.Tensor:
        return fp8_gemm_triton(
            qx[off : off + m], sx[off : off + m], ring_q[i], ring_s[i], None, torch.bfloat16, tile=tile
        )

    rec: dict = {"model": model, "part": part, "N": n, "K": k, "programs": programs}
    rec["us_bf16_exact"] = {
        m: round(_time_ring(lambda i, m=m: matmul(x[:m], ring_b[i]), len(ring_b)), 1) for m in SIZES
    }
    rec["picked"] = {m: str(fp8_tile(m, n, programs)) for m in SIZES}
    rec["us_fp8_picked"] = {m: round(_time_ring(lambda i, m=m: gemm(m, None, i), copies), 1) for m in SIZES}
    for tile in SWAPPED:
        key = f"swap{tile.block_m}x{tile.block_n}w{tile.num_warps}s{tile.num_stages}"
        try:
            bad = [
                (m, off)
                for m in CHECK_ROWS
                for off in (0, 640 - m, 37)
                if not torch.equal(gemm(m, tile, 0, off), ref[off : off + m])
            ]
        except Exception as e:  # out of shared memory or registers: report and go on
            rec[key] = {"error": str(e)[:160]}
            continue
        us = {m: round(_time_ring(lambda i, m=m, t=tile: gemm(m, t, i), copies), 1) for m in SIZES}
        rec[key] = {"equal": not bad, "bad": bad[:6], "us": us}
    return rec


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    args = p.parse_args()
    require_cuda("probe_fp8_swap.py")
    torch.manual_seed(0)
    programs = num_programs_cap(torch.device("cuda"))
    for model in args.models.split(","):
        for part, (n, k) in _shapes(model).items():
            print(json.dumps(_probe(model, part, n, k, programs)), flush=True)


if __name__ == "__main__":
    main()
