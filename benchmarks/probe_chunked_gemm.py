"""Would a GEMM that reduces K in fixed chunks let a decode step split K without changing a row's bits?

The exact matmul reduces K in one chain per output element (DESIGN rule 2: no split-K), so a decode step's
projection with a 1,024-wide output (qwen3's o and down) has at most N / 16 = 64 programs, each streaming all of K:
6-8 us for 4-6 MB (docs/benchmarks.md, fifteenth session). If instead every path reduced K in chunks of KC
elements, each chunk its own chain from zero, and added the chunks' results in chunk order (as the attention folds
its key chunks), then a decode step could give each chunk its own program (split-K with a fixed chunk *size* and a
fixed merge order) and training could fold the chunks in registers: the same fp32 operations in the same order on
both paths. This probe measures whether that holds on the GPU and what it would buy, before any change to the
product's kernel:
- bits: the split form (one program per (tile, chunk), fp32 partials, then a fold kernel) at 1..64 rows against
  the in-register form at 300 rows, torch.equal, per shape and chunk size; and the in-register form against
  exactrl's matmul (expected to differ: another reduction order; printed, not required);
- time at 1, 16 and 64 rows: exactrl's matmul today, the split form (both launches), the in-register form;
- time of the in-register form at 8,192 rows against exactrl's matmul (the training side's cost; the probe's
  kernel uses pointer loads where exactrl's training tile uses TMA, so read it as a bound, not a verdict).
A table line and a JSON line per (shape, chunk size) on stdout.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_chunked_gemm.py`. Under TRITON_INTERPRET=1 it checks its own
bits at small shapes (`--small`), so the script is known to run before device time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from _script import kernel_device  # benchmarks/: the script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exactrl.ops.triton.common import mma
from exactrl.ops.triton.matmul import matmul


@triton.jit
def _chunk_acc(
    x_ptr, w_ptr, offs_m, offs_n, k0, M, N, K, sxm, sxk, swn, swk, KC: tl.constexpr, BLOCK_K: tl.constexpr
):
    # One chunk's chain from zero: k in [k0, k0 + KC), BLOCK_K at a time, masked past K (zeros add exactly 0).
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
    for kt in range(0, KC // BLOCK_K):
        k = k0 + kt * BLOCK_K + offs_k
        a = tl.load(
            x_ptr + offs_m[:, None] * sxm + k[None, :] * sxk,
            mask=(offs_m[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + k[:, None] * swk + offs_n[None, :] * swn,
            mask=(k[:, None] < K) & (offs_n[None, :] < N),
            other=0.0,
        )
        acc = mma(a, b, acc)
    return acc


@triton.jit
def _folded_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sxm, sxk, swn, swk, som, son,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KC: tl.constexpr):  # fmt: skip
    # Training's form: the chunks in turn, each from zero, added to the total in chunk order, in registers.
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(0, tl.cdiv(K, KC)):
        total = total + _chunk_acc(
            x_ptr, w_ptr, offs_m, offs_n, c * KC, M, N, K, sxm, sxk, swn, swk, KC, BLOCK_K
        )
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(
        out_ptr + offs_m[:, None] * som + offs_n[None, :] * son, total.to(out_ptr.dtype.element_ty), mask=ok
    )


@triton.jit
def _split_kernel(x_ptr, w_ptr, part_ptr, M, N, K, sxm, sxk, swn, swk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KC: tl.constexpr):  # fmt: skip
    # A decode step's form: one program per (tile, chunk), the chunk's fp32 result to part[chunk, M, N].
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(2)
    acc = _chunk_acc(x_ptr, w_ptr, offs_m, offs_n, c * KC, M, N, K, sxm, sxk, swn, swk, KC, BLOCK_K)
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(part_ptr + (c * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=ok)


@triton.jit
def _fold_kernel(part_ptr, out_ptr, M, N, S, BLOCK: tl.constexpr):
    # The partials added in chunk order onto zeros: the operations of the in-register fold.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, S):
        total = total + tl.load(part_ptr + c * M * N + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def folded(
    x: torch.Tensor, w: torch.Tensor, kc: int, bm: int = 64, bn: int = 64, bk: int = 64, warps: int = 4
) -> torch.Tensor:
    # Two [bm, bn] fp32 tiles live at once (the chunk's and the total): 8 warps for a 128 x 128 tile.
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    _folded_kernel[grid](x, w, out, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0),
                         out.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, KC=kc, num_warps=warps)  # fmt: skip
    return out


def split(
    x: torch.Tensor, w: torch.Tensor, kc: int, bm: int = 64, bn: int = 16, bk: int = 128
) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    S = triton.cdiv(K, kc)
    part = torch.empty((S, M, N), dtype=torch.float32, device=x.device)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), S)
    _split_kernel[grid](x, w, part, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, KC=kc, num_warps=4)  # fmt: skip
    _fold_kernel[(triton.cdiv(M * N, 1024),)](part, out, M, N, S, BLOCK=1024)
    return out


def _time(fn, reps: int = 20) -> float:
    from probe_decode_gemm import _time as graph_time  # GPU microseconds per call, from a CUDA graph

    return graph_time(fn, reps)


def _timings(x: torch.Tensor, w: torch.Tensor, kc: int, bk: int, gen: torch.Generator) -> dict:
    """GPU us per call at 1, 16, 64 rows (today's matmul, the split form, the folded form) and at 8,192 rows."""
    us = {
        str(m): {
            "matmul": round(_time(lambda m=m: matmul(x[:m], w)), 1),
            "split": round(_time(lambda m=m: split(x[:m], w, kc, bk=bk)), 1),
            "folded": round(_time(lambda m=m: folded(x[:m], w, kc)), 1),
        }
        for m in (1, 16, 64)
    }
    big = torch.randn(8192, x.shape[1], device=x.device, generator=gen).to(x.dtype)
    us_big = {
        "matmul": round(_time(lambda: matmul(big, w), reps=5), 1),
        "folded_128x128": round(_time(lambda: folded(big, w, kc, bm=128, bn=128, warps=8), reps=5), 1),
    }
    return {"us": us, "us_8192": us_big}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="small shapes, bits only (the interpreter's check)")
    args = ap.parse_args()
    dev = kernel_device("probe_chunked_gemm.py")
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    if args.small:
        shapes = {"small": (48, 200)}  # N, K: K not a multiple of the chunk nor of BLOCK_K
        chunks, rows, full_rows, bk = (64,), (1, 3), 20, 32
    else:
        shapes = {"o": (1024, 2048), "down": (1024, 3072), "qkv": (4096, 1024), "gate_up": (6144, 1024)}
        chunks, rows, full_rows, bk = (512, 1024), (1, 2, 5, 16, 17, 64), 300, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    for part, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=dev, generator=gen) * k**-0.5).to(dt)
        x = torch.randn(full_rows, k, device=dev, generator=gen).to(dt)
        x[:, :8] *= 6.0  # a few large input channels, as activations have
        for kc in chunks:
            ref = folded(x, w, kc, bk=min(bk, 64))
            equal = all(torch.equal(split(x[:m], w, kc, bk=bk), ref[:m]) for m in rows)
            rec = {"part": part, "N": n, "K": k, "chunk": kc, "split_equals_folded": equal}
            rec["folded_equals_matmul"] = bool(torch.equal(ref, matmul(x, w)))
            if not args.small:
                rec.update(_timings(x, w, kc, bk, gen))
                one = rec["us"]["1"]
                print(
                    f"{part:8s} K {k:5d} chunk {kc:5d}  bits {'same' if equal else 'DIFFER'}  one row: matmul "
                    f"{one['matmul']} us, split {one['split']} us  |  8192 rows: matmul {rec['us_8192']['matmul']} "
                    f"us, folded {rec['us_8192']['folded_128x128']} us",
                    flush=True,
                )
            print(json.dumps(rec), flush=True)
            if args.small and not equal:
                raise SystemExit("split and folded forms differ under the interpreter: the probe is wrong")


if __name__ == "__main__":
    main()
