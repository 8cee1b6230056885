"""The training step's GEMMs, one by one: the invariant Triton kernel against cuBLAS, forward and backward.

The forward GEMMs must be the invariant kernel (the trainer's logprobs are the engine's bits). The backward only
has to be deterministic: dX = dY @ W may run in the invariant kernel or in cuBLAS. For each projection of the
qwen3-0.6b and qwen3-1.7b shapes at 8,192 rows (one training microbatch) this times, in CUDA graphs:
forward Triton vs cuBLAS, dX Triton vs cuBLAS, the packed projections' segmented dX vs cuBLAS over the
concatenated gradient, and the LM head's slice GEMMs. TFLOP/s per call and the step's total for each choice.
JSON lines on stdout.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_train_gemm.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _script import kernel_device, parser  # benchmarks/: the script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_decode_gemm import _shapes, _time  # noqa: E402

from exactrl.model.config import preset  # noqa: E402
from exactrl.ops.triton.matmul import _segmented_dx, matmul  # noqa: E402


def _time_part(n: int, k: int, rows: int, split: list[int] | None, dev: str) -> dict[str, float]:
    """Microseconds of one projection's forward and dX, Triton and cuBLAS (split: a packed projection's parts)."""
    dt = torch.bfloat16
    w = (torch.randn(n, k, device=dev) * 0.02).to(dt)
    x = torch.randn(rows, k, device=dev).to(dt)
    gy = (torch.randn(rows, n, device=dev) * 1e-3).to(dt)
    us = {
        "fwd_triton": _time(lambda: matmul(x, w), reps=5),
        "fwd_cublas": _time(lambda: torch.matmul(x, w.t()), reps=5),
        "dx_cublas": _time(lambda: torch.matmul(gy, w), reps=5),
    }
    if split:
        gs = [g.contiguous() for g in gy.split(split, dim=1)]
        us["dx_triton"] = _time(lambda: _segmented_dx(gs, w), reps=5)
        us["dx_cublas_cat"] = _time(lambda: torch.matmul(torch.cat(gs, dim=1), w), reps=5)
    else:
        us["dx_triton"] = _time(lambda: matmul(gy, w.t()), reps=5)
    return us


def probe(model: str, rows: int = 8192, dev: str = "cuda") -> dict:
    c = preset(model)
    dt = torch.bfloat16
    torch.manual_seed(0)
    rec: dict = {"model": model, "rows": rows, "parts": {}}
    tot = {"fwd_triton": 0.0, "fwd_cublas": 0.0, "dx_triton": 0.0, "dx_cublas": 0.0}
    splits = {"qkv": [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
              "gate_up": [c.intermediate_size, c.intermediate_size]}  # fmt: skip
    for part, (n, k) in _shapes(model).items():
        us = _time_part(n, k, rows, splits.get(part), dev)
        flop = 2.0 * rows * n * k
        rec["parts"][part] = {
            kk: {"us": round(v, 1), "TFLOPs": round(flop / v / 1e6, 1)} for kk, v in us.items()
        }
        for kk in tot:
            tot[kk] += us[kk] * c.num_layers / 1e3
    # LM head, as the chunked logprobs' backward runs it: logits of a vocabulary slice over all rows (Triton),
    # dhidden from the slice (Triton, fp32 out) or cuBLAS.
    V, D = c.vocab_size, c.hidden_size
    vc = min(V, max(256, 1024 * V // rows))
    w = (torch.randn(vc, D, device=dev) * 0.02).to(dt)
    h = torch.randn(rows, D, device=dev).to(dt)
    gz = (torch.randn(rows, vc, device=dev) * 1e-4).to(dt)
    slices = -(-V // vc)
    flop = 2.0 * rows * vc * D
    lm = {
        "logits_triton": _time(lambda: matmul(h, w), reps=5),
        "dh_triton_fp32": _time(lambda: matmul(gz, w.t(), out_dtype=torch.float32), reps=5),
        "dh_cublas": _time(lambda: torch.matmul(gz, w), reps=5),
        "dw_cublas": _time(lambda: torch.matmul(gz.t(), h), reps=5),
    }
    rec["lm_head_slice"] = {
        kk: {"us": round(v, 1), "TFLOPs": round(flop / v / 1e6, 1)} for kk, v in lm.items()
    }
    rec["lm_head_slices"] = slices
    rec["step_ms_layers"] = {kk: round(v, 2) for kk, v in tot.items()}
    return rec


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--presets", default="qwen3-0.6b,qwen3-1.7b", help="comma-separated model shapes")
    ap.add_argument("--rows", type=int, default=8192, help="rows of a microbatch")
    args = ap.parse_args()
    dev = kernel_device("probe_train_gemm.py")
    for model in args.presets.split(","):
        print(json.dumps(probe(model, args.rows, dev)), flush=True)


if __name__ == "__main__":
    main()
