"""Which fp8 tile rule makes a real decode step fastest? `benchmarks/probe_fp8_swap.py` times one GEMM alone;
inside a decode step each GEMM waits for the quantizer before it and the next kernel waits for it (programmatic
dependent launches), so a GEMM cannot overlap its neighbours the way repeated calls of one GEMM do. This script
measures the decode step itself (`exactrl bench rollout`'s measurement, CUDA graphs) under variants of `fp8_tile`'s
constants (exactrl/ops/triton/fp8_matmul.py), the model dtype's step beside them. The variants' tiles are the
family's and the swapped tile the row sweep (tests/ops/test_fp8_triton.py) checks bit for bit, except swap-64rows
(a 64-row swapped tile, checked by benchmarks/probe_fp8_swap.py only); this only asks which is fastest. Each line
says the source hash it ran (`exactrl.bench_records`).

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_fp8_decode_tiles.py --preset qwen3-8b --concurrency 1,64,256`.
One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json

import torch
from _script import parser, require_cuda  # benchmarks/: the script's own folder is on sys.path

import exactrl.ops.triton.fp8_matmul as fm
from exactrl.ops.triton.fp8_matmul import Fp8Tile

VARIANTS: dict[str, dict] = {
    "rule": {},
    "one-tile-0.7": {"_ONE_TILE_SM_SHARE": 0.7},  # the rule before 3 tiles a SM up to 64 rows
    "occupancy1.5": {"_MIN_SM_SHARE": 1.5},
    "occupancy3": {"_MIN_SM_SHARE": 3.0},
    "swap-64rows": {"FP8_SWAP_TILE": Fp8Tile(64, 64, 4, 4, True)},
    "swap-off": {"_SWAP_MIN_SM_SHARE": 1e9},
}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    require_cuda("probe_fp8_decode_tiles.py")

    from exactrl.bench import _rollout_on_rank
    from exactrl.bench_records import source_commit, source_hash
    from exactrl.distributed.env import DistContext
    from exactrl.model.loading import load_policy
    from exactrl.model.precision import use_fp8
    from exactrl.ops import set_exact_environment

    set_exact_environment(True)
    ctx = DistContext.single()
    model, tok = load_policy(preset_name=args.preset, device="cuda", dtype="bfloat16", init_draws="keyed")
    plain = model.ops
    fp8 = use_fp8(model)
    saved = {k: getattr(fm, k) for v in VARIANTS.values() for k in v}
    for c in (int(x) for x in args.concurrency.split(",")):
        runs = [("dtype", "rule")] + [("fp8", v) for v in args.variants.split(",")]
        for precision, variant in runs:
            for k, val in saved.items():
                setattr(fm, k, val)
            for k, val in VARIANTS[variant].items():
                setattr(fm, k, val)
            fm.fp8_tile.cache_clear()
            model.set_ops(plain if precision == "dtype" else fp8)
            ns = argparse.Namespace(
                what="rollout", preset=args.preset, model=None, mode="exact", dtype="bfloat16",
                precision=precision, concurrency=c, prompt_len=128, max_tokens=args.max_tokens, vs=None,
                device="cuda", split_kv="auto",
            )  # fmt: skip
            rec = _rollout_on_rank(ns, ctx, loaded=("cuda", model, tok))
            steps = max(rec["decode_steps"], 1)
            print(json.dumps({
                "preset": args.preset, "concurrency": c, "precision": precision, "variant": variant,
                "decode_step_ms": round(rec["decode_s"] / steps * 1e3, 3),
                "tokens_per_s": round(rec["tokens_per_s"], 1), "graph_steps": rec["cuda_graph_steps"],
                "gpu": torch.cuda.get_device_name(), "commit": source_commit(), "source": source_hash(),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
