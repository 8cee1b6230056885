"""The fp8 GEMM on a persistent grid with TMA loads (`Fp8Tile.tma`, `_fp8_gemm_tma_kernel` in
exactrl/ops/triton/fp8_matmul.py) against the pointer-load tiles, for many rows (prefill, the trainer's forward):
the reference tile's bits (torch.equal at row offsets), and GPU microseconds a call beside the bf16 exact GEMM.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_fp8_tma.py`. One JSON line per shape on stdout.
"""

from __future__ import annotations

import json

import torch
from _script import parser, require_cuda  # benchmarks/: the script's own folder is on sys.path
from probe_decode_gemm import _shapes
from probe_fp8_swap import _time_ring

from exactrl.ops.fp8 import quantize_activations, quantize_weight
from exactrl.ops.triton.common import num_programs_cap
from exactrl.ops.triton.fp8_matmul import FP8_FAMILY, FP8_REF_TILE, Fp8Tile, fp8_gemm_triton, fp8_tile
from exactrl.ops.triton.matmul import matmul

TMA = tuple(
    Fp8Tile(bm, bn, w, s, tma=True, flatten=f)
    for bm, bn, w, s, f in (
        (128, 128, 8, 3, False), (128, 128, 8, 4, True), (128, 128, 8, 4, False), (64, 128, 4, 4, False),
        (64, 128, 4, 4, True), (128, 256, 8, 3, False), (64, 256, 8, 3, False), (128, 64, 4, 4, False),
    )
)  # fmt: skip
TILES = FP8_FAMILY[:1] + TMA
ROWS = (256, 1024, 8192)
TOP = 8192


def _key(t: Fp8Tile) -> str:
    return (
        f"{t.block_m}x{t.block_n}w{t.num_warps}s{t.num_stages}"
        + ("tma" if t.tma else "")
        + ("f" if t.flatten else "")
    )


def _probe(model: str, part: str, n: int, k: int, programs: int) -> dict:
    w = torch.randn(n, k, device="cuda") * 0.02
    x = torch.randn(TOP, k, device="cuda").bfloat16()
    qw, sw = quantize_weight(w)
    qx, sx = quantize_activations(x)
    ref = fp8_gemm_triton(qx, sx, qw, sw, None, torch.bfloat16, tile=FP8_REF_TILE)
    wb = w.bfloat16()
    copies = 2

    def gemm(m: int, tile: Fp8Tile | None, off: int = 0) -> torch.Tensor:
        return fp8_gemm_triton(qx[off : off + m], sx[off : off + m], qw, sw, None, torch.bfloat16, tile=tile)

    rec: dict = {"model": model, "part": part, "N": n, "K": k, "programs": programs}
    rec["us_bf16_exact"] = {m: round(_time_ring(lambda i, m=m: matmul(x[:m], wb), copies), 1) for m in ROWS}
    rec["picked"] = {m: _key(fp8_tile(m, n, programs)) for m in ROWS}
    rec["us_fp8_picked"] = {m: round(_time_ring(lambda i, m=m: gemm(m, None), copies), 1) for m in ROWS}
    for tile in TILES:
        try:
            bad = [
                (m, off)
                for m, off in ((1, 5), (64, 0), (65, 100), (300, 7000), (TOP, 0))
                if not torch.equal(gemm(m, tile, off), ref[off : off + m])
            ]
        except Exception as e:  # out of shared memory or registers: report and go on
            rec[_key(tile)] = {"error": str(e)[:160]}
            continue
        us = {m: round(_time_ring(lambda i, m=m, t=tile: gemm(m, t), copies), 1) for m in ROWS}
        rec[_key(tile)] = {"equal": not bad, "bad": bad, "us": us}
    return rec


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", default="qwen3-8b,qwen3-0.6b")
    args = p.parse_args()
    require_cuda("probe_fp8_tma.py")
    torch.manual_seed(0)
    programs = num_programs_cap(torch.device("cuda"))
    for model in args.models.split(","):
        for part, (n, k) in _shapes(model).items():
            print(json.dumps(_probe(model, part, n, k, programs)), flush=True)


if __name__ == "__main__":
    main()
