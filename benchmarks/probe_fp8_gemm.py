"""The fp8 GEMM's tile family (exactrl/ops/triton/fp8_matmul.py): does every tile give every row the bits of the
reference tile, and how fast is each against the bf16 exact GEMM at the same shape?

Per projection shape of qwen3-0.6b and qwen3-8b: every tile of the family (and a few more candidates) against the
reference tile's 512-row call, torch.equal, at 1..512 rows (row offsets included); GPU microseconds per call (CUDA
graphs, `pdl_launches`, as a decode step runs) of each tile, of the tile `fp8_tile` picks, and of the bf16 exact GEMM
(`exactrl.ops.triton.matmul.matmul`) at 1, 16, 64, 128, 256 and 512 rows; and the activation quantizer, the
one-launch kernel against the torch ops it replaces. One JSON line per shape on stdout.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_fp8_gemm.py`.
"""

from __future__ import annotations

import json

import torch
from _script import parser, require_cuda  # benchmarks/: the script's own folder is on sys.path
from probe_decode_gemm import _shapes, _time

from exactrl.ops.fp8 import quantize_activations_torch, quantize_weight
from exactrl.ops.triton.common import num_programs_cap
from exactrl.ops.triton.fp8_matmul import (
    FP8_FAMILY,
    FP8_REF_TILE,
    Fp8Tile,
    fp8_gemm_triton,
    fp8_tile,
)
from exactrl.ops.triton.fp8_quant import quantize_activations_triton
from exactrl.ops.triton.matmul import matmul

# Beyond the family: 128-row tiles (two warpgroups), other warp counts and stage depths, to see what the
# family leaves on the table and whether the equality holds for them too.
EXTRA = (
    Fp8Tile(128, 128, 8, 4),
    Fp8Tile(128, 64, 4, 4),
    Fp8Tile(128, 256, 8, 3),
    Fp8Tile(64, 128, 8, 3),
    Fp8Tile(64, 64, 4, 6),
    Fp8Tile(64, 64, 8, 4),
    Fp8Tile(64, 32, 4, 8),
    Fp8Tile(64, 16, 4, 8),
)
CHECKS = ((1, 0), (1, 137), (3, 5), (16, 17), (64, 236), (65, 3), (128, 100), (200, 50), (256, 256), (512, 0))
SIZES = (1, 16, 64, 128, 256, 512)


def _key(t: Fp8Tile) -> str:
    return f"{t.block_m}x{t.block_n}w{t.num_warps}s{t.num_stages}"


def _probe(model: str, part: str, n: int, k: int, tiles: tuple[Fp8Tile, ...], programs: int) -> dict:
    w = torch.randn(n, k, device="cuda") * 0.02
    x = torch.randn(512, k, device="cuda").bfloat16()
    qw, sw = quantize_weight(w)
    qx, sx = quantize_activations_triton(x)
    q_ref, s_ref = quantize_activations_torch(x)
    ref = fp8_gemm_triton(qx, sx, qw, sw, None, torch.bfloat16, tile=FP8_REF_TILE)
    wb = w.bfloat16()

    def gemm(m: int, tile: Fp8Tile | None = None, off: int = 0) -> torch.Tensor:
        return fp8_gemm_triton(qx[off : off + m], sx[off : off + m], qw, sw, None, torch.bfloat16, tile=tile)

    def us(fn) -> dict[int, float]:
        return {m: round(_time(lambda m=m: fn(m)), 1) for m in SIZES}

    rec: dict = {"model": model, "part": part, "N": n, "K": k, "programs": programs}
    rec["quantizer_equal"] = bool(
        torch.equal(qx.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sx, s_ref)
    )
    rec["us_quant_triton"] = us(lambda m: quantize_activations_triton(x[:m]))
    rec["us_quant_torch"] = us(lambda m: quantize_activations_torch(x[:m]))
    rec["us_bf16_exact"] = us(lambda m: matmul(x[:m], wb))
    rec["picked"] = {m: _key(fp8_tile(m, n, programs)) for m in SIZES}
    rec["us_fp8_picked"] = us(gemm)
    for tile in tiles:
        try:
            gemm(1, tile)
        except Exception as e:  # out of shared memory or registers: report and go on
            rec[_key(tile)] = {"error": str(e)[:100]}
            continue
        equal = all(torch.equal(gemm(m, tile, o), ref[o : o + m]) for m, o in CHECKS)
        rec[_key(tile)] = {"equal": equal, "us": us(lambda m, t=tile: gemm(m, t))}
    return rec


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    p.add_argument("--no-extra", action="store_true", help="the family only")
    args = p.parse_args()
    require_cuda("probe_fp8_gemm.py")
    torch.manual_seed(0)
    programs = num_programs_cap(torch.device("cuda"))
    tiles = FP8_FAMILY + (() if args.no_extra else EXTRA)
    for model in args.models.split(","):
        for part, (n, k) in _shapes(model).items():
            print(json.dumps(_probe(model, part, n, k, tiles, programs)), flush=True)


if __name__ == "__main__":
    main()
