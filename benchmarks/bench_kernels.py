"""Benchmark the exact Triton kernels against PyTorch's defaults on the GPU.

- matmul: the batch-invariant persistent GEMM vs cuBLAS (`F.linear`) at qwen3-0.6b shapes, bf16,
  M in {1, 16, 256, 1024, 4096, 8192}; `ratio_vs_cublas` = cuBLAS time / Triton time (1.0 = as fast).
- a few alternative tile configs (informational: the exact path always uses MATMUL_CONFIGS), with whether
  their output is bitwise equal to the default config's.
- attention: packed causal training forward and forward+backward vs SDPA, and a paged decode step vs SDPA over
  a dense cache.
- logprobs: chunked exact logprobs vs F.linear + log_softmax.

Prints a table and one JSON line per measurement (`--out FILE` also writes the JSON lines there).
Usage: PYTHONPATH=. python benchmarks/bench_kernels.py [--quick] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import torch
import torch.nn.functional as F
from _script import require_cuda  # benchmarks/: the script's own folder is on sys.path

DEVICE = "cuda"
ATTN_TRAIN_CASES = [(8, 2048), (32, 512)]  # (sequences, length) packed for training
ATTN_DECODE_CASES = [(256, 512), (64, 2048)]  # (sequences, cached context) for one decode step
LOGPROB_SHAPE = (4096, 1024, 151936)  # (rows, hidden, vocab)


def bench(fn, grad_to_none=None, rep: int = 100) -> float:
    import triton.testing

    return float(
        triton.testing.do_bench(fn, warmup=rep // 4, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    )


def emit(rows: list[dict], record: dict, out) -> None:
    rows.append(record)
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


# (K, N) of qwen3-0.6b's matmuls as the model runs them: q/k/v and gate/up are packed weights.
SHAPES = {
    "qkv": (1024, 4096),
    "o": (2048, 1024),
    "gate_up": (1024, 6144),
    "down": (3072, 1024),
    "lm_head": (1024, 151936),
}


def bench_matmul(ms: list[int], rows: list[dict], out) -> None:
    from exactrl.ops.triton.matmul import matmul

    dtype = torch.bfloat16
    for name, (K, N) in SHAPES.items():
        w = torch.randn(N, K, device=DEVICE, dtype=dtype) * K**-0.5
        for M in ms:
            x = torch.randn(M, K, device=DEVICE, dtype=dtype)
            t_tri = bench(partial(matmul, x, w))
            t_cub = bench(partial(F.linear, x, w))
            flop = 2.0 * M * N * K
            emit(rows, {
                "bench": "matmul", "shape": name, "dtype": "bf16", "M": M, "K": K, "N": N,
                "triton_ms": t_tri, "cublas_ms": t_cub, "ratio_vs_cublas": t_cub / t_tri,
                "triton_tflops": flop / t_tri * 1e-9, "cublas_tflops": flop / t_cub * 1e-9,
            }, out)  # fmt: skip


MATMUL_ALTERNATIVES = {
    # (block_m, block_n, block_k, group_m, num_warps, num_stages, tma, flatten, warp_specialize)
    "128x128x64_w8_s4_ptr": (128, 128, 64, 8, 8, 4, False, False, False),
    "128x128x64_w8_s4_tma": (128, 128, 64, 8, 8, 4, True, False, False),
    "128x128x64_w8_s5_tma": (128, 128, 64, 8, 8, 5, True, False, False),
    "128x128x64_w8_s4_tma_fl": (128, 128, 64, 8, 8, 4, True, True, False),
    "128x128x64_w8_s4_tma_ws": (128, 128, 64, 8, 8, 4, True, False, True),
    "128x128x128_w8_s3_tma": (128, 128, 128, 8, 8, 3, True, False, False),
    "128x256x64_w8_s3_tma": (128, 256, 64, 8, 8, 3, True, False, False),
    "128x256x64_w8_s4_tma": (128, 256, 64, 8, 8, 4, True, False, False),
    "128x256x64_w8_s3_tma_fl": (128, 256, 64, 8, 8, 3, True, True, False),
    # Narrower tiles: more tiles per launch at small M (decode, M = 256), fewer FLOPs per loaded byte.
    "128x64x64_w4_s4_tma_fl": (128, 64, 64, 8, 4, 4, True, True, False),
    "128x64x64_w8_s5_tma_fl": (128, 64, 64, 8, 8, 5, True, True, False),
    "64x128x64_w4_s4_tma_fl": (64, 128, 64, 8, 4, 4, True, True, False),
    "64x128x64_w4_s6_tma_fl": (64, 128, 64, 8, 4, 6, True, True, False),
    "64x64x64_w4_s6_tma_fl": (64, 64, 64, 8, 4, 6, True, True, False),
    "128x128x64_w8_s3_tma_fl": (128, 128, 64, 8, 8, 3, True, True, False),
}


def bench_matmul_configs(ms: list[int], rows: list[dict], out, names: list[str] | None = None) -> None:
    """Other tile configs, for the record only (the exact ops never pick a config by M)."""
    from exactrl.ops.triton.matmul import MATMUL_CONFIGS, MatmulConfig, matmul

    dtype = torch.bfloat16
    for cname, c in MATMUL_ALTERNATIVES.items():
        if names and cname not in names:
            continue
        cfg = MatmulConfig(*c)
        for name, (K, N) in SHAPES.items():
            w = torch.randn(N, K, device=DEVICE, dtype=dtype) * K**-0.5
            for M in ms:
                x = torch.randn(M, K, device=DEVICE, dtype=dtype)
                rec = {"bench": "matmul_config", "config": cname, "shape": name, "M": M}
                try:
                    t = bench(partial(matmul, x, w, config=cfg), rep=40)
                    same = torch.equal(matmul(x, w, config=cfg), matmul(x, w, config=MATMUL_CONFIGS[dtype]))
                except Exception as e:  # e.g. out of shared memory: report and go on
                    emit(rows, {**rec, "error": str(e)[:200]}, out)
                    continue
                t_cub = bench(partial(F.linear, x, w), rep=40)
                emit(
                    rows,
                    {**rec, "triton_ms": t, "ratio_vs_cublas": t_cub / t, "bitwise_equal_to_default": same},
                    out,
                )


def _exact_fwd_bwd(leaves, batch, dy) -> None:
    from exactrl.ops.triton.attention import attention

    attention(*leaves, batch).backward(dy)


def _sdpa_fwd_bwd(leaves, dy) -> None:
    F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(dy)


def bench_attention(rows: list[dict], out, quick: bool) -> None:
    from exactrl.ops.batch import AttentionBatch
    from exactrl.ops.triton.attention import attention

    hq, hkv, dh = 16, 8, 128
    dtype = torch.bfloat16
    for B, L in ATTN_TRAIN_CASES if not quick else ATTN_TRAIN_CASES[-1:]:
        T = B * L
        q = torch.randn(T, hq, dh, device=DEVICE, dtype=dtype)
        k = torch.randn(T, hkv, dh, device=DEVICE, dtype=dtype)
        v = torch.randn(T, hkv, dh, device=DEVICE, dtype=dtype)
        dy = torch.randn_like(q)
        batch = AttentionBatch.packed([L] * B, device=DEVICE)
        qs, ks, vs = (t.view(B, L, -1, dh).transpose(1, 2).contiguous() for t in (q, k, v))
        dys = dy.view(B, L, hq, dh).transpose(1, 2).contiguous()
        flop_fwd = 4.0 * B * hq * dh * L * L / 2  # causal: half the score matrix
        with torch.no_grad():
            t_fwd = bench(partial(attention, q, k, v, batch))
            t_sdpa = bench(
                partial(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True, enable_gqa=True)
            )
        emit(rows, {
            "bench": "attention_fwd", "B": B, "L": L, "triton_ms": t_fwd, "sdpa_ms": t_sdpa,
            "ratio_vs_sdpa": t_sdpa / t_fwd, "triton_tflops": flop_fwd / t_fwd * 1e-9,
            "sdpa_tflops": flop_fwd / t_sdpa * 1e-9,
        }, out)  # fmt: skip
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        sleaves = [t.clone().requires_grad_(True) for t in (qs, ks, vs)]
        t_fb = bench(partial(_exact_fwd_bwd, leaves, batch, dy), grad_to_none=leaves)
        t_sfb = bench(partial(_sdpa_fwd_bwd, sleaves, dys), grad_to_none=sleaves)
        emit(rows, {
            "bench": "attention_fwd_bwd", "B": B, "L": L, "triton_ms": t_fb, "sdpa_ms": t_sfb,
            "ratio_vs_sdpa": t_sfb / t_fb, "triton_tflops": 3.5 * flop_fwd / t_fb * 1e-9,
        }, out)  # fmt: skip

    # Decode: one new token for each of S sequences with C cached tokens, block size 16, shuffled pages.
    block = 16
    for S, C in ATTN_DECODE_CASES if not quick else ATTN_DECODE_CASES[:1]:
        nb = S * (-(-(C + 1) // block))
        perm = torch.randperm(nb).tolist()
        per = nb // S
        tables = [perm[i * per : (i + 1) * per] for i in range(S)]
        k_cache = torch.randn(nb, block, hkv, dh, device=DEVICE, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        batch = AttentionBatch.paged([C] * S, [1] * S, tables, block, device=DEVICE)
        q = torch.randn(S, hq, dh, device=DEVICE, dtype=dtype)
        k = torch.randn(S, hkv, dh, device=DEVICE, dtype=dtype)
        v = torch.randn(S, hkv, dh, device=DEVICE, dtype=dtype)
        with torch.no_grad():
            t_dec = bench(partial(attention, q, k, v, batch, kv_cache=(k_cache, v_cache)))
            qs = q.view(S, hq, 1, dh)
            kd = torch.randn(S, hkv, C + 1, dh, device=DEVICE, dtype=dtype)
            vd = torch.randn_like(kd)
            t_sdpa = bench(partial(F.scaled_dot_product_attention, qs, kd, vd, enable_gqa=True))
        kv_bytes = 2.0 * S * (C + 1) * hkv * dh * 2
        emit(rows, {
            "bench": "attention_decode", "seqs": S, "context": C, "triton_ms": t_dec, "sdpa_dense_ms": t_sdpa,
            "ratio_vs_sdpa": t_sdpa / t_dec, "triton_kv_GBps": kv_bytes / t_dec * 1e-6,
            "sdpa_kv_GBps": kv_bytes / t_sdpa * 1e-6,
        }, out)  # fmt: skip


ATTN_FWD_ALTERNATIVES = [
    (64, 64, 4, 3),  # the default
    (64, 64, 4, 2),
    (64, 64, 4, 4),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (64, 128, 4, 2),
    (64, 128, 4, 3),
    (64, 32, 4, 4),
]


def _packed_attention_inputs(B: int, L: int):
    """q, k, v, dy and the packed AttentionBatch of B sequences of L tokens at the qwen3-0.6b attention shape."""
    from exactrl.ops.batch import AttentionBatch

    hq, hkv, dh, dtype = 16, 8, 128, torch.bfloat16
    T = B * L
    q = torch.randn(T, hq, dh, device=DEVICE, dtype=dtype)
    k = torch.randn(T, hkv, dh, device=DEVICE, dtype=dtype)
    v = torch.randn(T, hkv, dh, device=DEVICE, dtype=dtype)
    return q, k, v, torch.randn_like(q), AttentionBatch.packed([L] * B, device=DEVICE)


def bench_attention_configs(rows: list[dict], out, backward: bool = True) -> None:
    """Forward tile configs (time for training and decode, and whether decode rows equal training rows under
    each), then the backward's (bench_attention_bwd_configs) unless `backward` is False, for the record."""
    from exactrl.ops.batch import AttentionBatch
    from exactrl.ops.triton.attention import attention_fwd

    B, L = ATTN_TRAIN_CASES[0]
    q, k, v, _, train = _packed_attention_inputs(B, L)
    _, hq, dh = q.shape
    # Decode-like batch over the same key store: one query per sequence at a random position.
    pos = torch.randint(0, L, (B,), device=DEVICE)
    decode = AttentionBatch(
        q_seq=torch.arange(B, device=DEVICE),
        q_pos=pos,
        cu_seqlens_q=torch.arange(B + 1, device=DEVICE),
        key_lens=pos + 1,
        key_slots=train.key_slots,
        max_seqlen_q=1,
        max_key_len=L,
    )
    rows_idx = torch.arange(B, device=DEVICE) * L + pos
    q_dec = q[rows_idx]
    flop_fwd = 4.0 * B * hq * dh * L * L / 2
    with torch.no_grad():
        for cfg in ATTN_FWD_ALTERNATIVES:
            rec = {"bench": "attention_fwd_config", "config": cfg}
            try:
                full = attention_fwd(q, k, v, train, config=cfg)[0]
                dec = attention_fwd(q_dec, k, v, decode, config=cfg)[0]
                t = bench(partial(attention_fwd, q, k, v, train, cfg), rep=50)
                td = bench(partial(attention_fwd, q_dec, k, v, decode, cfg), rep=50)
            except Exception as e:
                emit(rows, {**rec, "error": str(e)[:200]}, out)
                continue
            same = torch.equal(dec, full[rows_idx])
            emit(rows, {**rec, "train_ms": t, "tflops": flop_fwd / t * 1e-9, "decode_rows_ms": td,
                        "decode_equals_training": same}, out)  # fmt: skip
    if backward:
        bench_attention_bwd_configs(rows, out)


ATTN_BWD_ALTERNATIVES = {
    # (rows, block_n, num_warps, num_stages) of each backward kernel, swept one kernel at a time. rows: (query,
    # q-head) rows of a query tile; block_n: key positions of a key tile. The dK/dV kernel is keys-major (scores
    # as [keys, rows]: p^T and ds^T feed their MMAs from registers) when block_n >= 16 * num_warps, rows-major
    # otherwise. Left out: tiles that spill a lot (offline compile for sm_90) or need more shared memory than a
    # Hopper SM has (dK/dV (128, 64, 8, 3): 242 KiB).
    "dkdv": [
        (128, 64, 8, 2),  # rows-major
        (128, 32, 8, 2),
        (128, 32, 8, 3),
        (32, 128, 8, 2),  # keys-major
        (32, 128, 8, 3),
        (64, 128, 8, 2),
        (64, 128, 8, 3),
        (32, 64, 4, 2),
        (32, 64, 4, 3),
        (64, 64, 4, 2),
        (64, 64, 4, 3),
    ],
    "dq": [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 32, 8, 2),
        (128, 32, 8, 3),
        (128, 128, 8, 2),
        (256, 32, 8, 2),
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (64, 32, 4, 3),
        (64, 128, 4, 2),
    ],
}


def _compile_bwd_tile(name: str, cfg: tuple[int, int, int, int]) -> None:
    """Put one backward tile's binary into Triton's cache, from a worker process (compiles hold the GIL, so
    processes are what runs them in parallel). Small inputs with the sweep's dtypes, strides and alignment give
    the same specialisation, hence the same cache entry."""
    from exactrl.ops.batch import AttentionBatch
    from exactrl.ops.triton.attention import attention_bwd_dkdv, attention_bwd_dq

    hq, hkv, dh, lens = 16, 8, 128, [256, 256]
    try:
        q, dy = (torch.randn(sum(lens), hq, dh, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(sum(lens), hkv, dh, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        lse, delta = (torch.zeros(sum(lens), hq, device=DEVICE) for _ in range(2))
        fn = attention_bwd_dkdv if name == "dkdv" else attention_bwd_dq
        fn(dy, q, k, v, lse, delta, AttentionBatch.packed(lens, device=DEVICE), cfg)
        torch.cuda.synchronize()
    except Exception:  # the timed run reports it
        pass


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_attention_bwd_configs(rows: list[dict], out) -> None:
    """Backward tiles, one kernel at a time: the dK/dV or the dQ kernel alone under each tile of its
    ATTN_BWD_ALTERNATIVES, the backward's total with that tile (delta + dK/dV + dQ, the other kernel at its
    default), and whether its gradients equal the default tile's. Ends with the fastest pair timed together."""
    from exactrl.ops.triton.attention import (
        _BWD_LAUNCH,
        AttnBwdConfig,
        attention_bwd,
        attention_bwd_delta,
        attention_bwd_dkdv,
        attention_bwd_dq,
        attention_fwd,
    )

    B, L = ATTN_TRAIN_CASES[0]
    q, k, v, dy, batch = _packed_attention_inputs(B, L)
    _, hq, dh = q.shape
    dtype = q.dtype
    with torch.no_grad():
        out_d, lse = attention_fwd(q, k, v, batch)
    delta = attention_bwd_delta(dy, out_d)
    kernels = {
        "dkdv": lambda cfg: attention_bwd_dkdv(dy, q, k, v, lse, delta, batch, cfg),
        "dq": lambda cfg: (attention_bwd_dq(dy, q, k, v, lse, delta, batch, cfg),),
    }
    base = {name: fn(None) for name, fn in kernels.items()}
    # Compile the tiles in 8 processes first: one by one, compiling would take most of the sweep's time.
    tiles = [(name, cfg) for name, cfgs in ATTN_BWD_ALTERNATIVES.items() for cfg in cfgs]
    try:
        with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile_bwd_tile, *zip(*tiles)))
    except Exception as e:  # then the timed runs compile one by one
        print(f"parallel compile failed ({e!r}); compiling one tile at a time", file=sys.stderr)
    flop_fwd = 4.0 * B * hq * dh * L * L / 2
    flops = {"dkdv": 2.0 * flop_fwd, "dq": 1.5 * flop_fwd}  # 4 and 3 matmuls over the causal half
    rep = 30
    t_delta = bench(partial(attention_bwd_delta, dy, out_d), rep=rep)
    t_delta_torch = bench(lambda: (dy.float() * out_d.float()).sum(-1), rep=rep)
    t_default = {name: bench(partial(fn, None), rep=rep) for name, fn in kernels.items()}
    emit(rows, {"bench": "attention_bwd_default", "B": B, "L": L, "default": tuple(_BWD_LAUNCH[dtype]),
                "delta_ms": t_delta, "torch_delta_ms": t_delta_torch, "dkdv_ms": t_default["dkdv"],
                "dq_ms": t_default["dq"], "total_ms": t_delta + sum(t_default.values())}, out)  # fmt: skip
    best: dict[str, tuple[tuple[int, int, int, int], float]] = {}
    for name, cfgs in ATTN_BWD_ALTERNATIVES.items():
        other = "dq" if name == "dkdv" else "dkdv"
        for cfg in cfgs:
            rec: dict = {"bench": f"attention_bwd_{name}_config", "config": cfg}
            if name == "dkdv":
                rec["keys_major"] = cfg[1] >= 16 * cfg[2]
            try:
                grads = kernels[name](cfg)
                t = bench(partial(kernels[name], cfg), rep=rep)
            except Exception as e:  # e.g. out of shared memory: report and go on
                emit(rows, {**rec, "error": str(e)[:200]}, out)
                continue
            emit(rows, {
                **rec, "ms": t, "tflops": flops[name] / t * 1e-9, "total_ms": t_delta + t + t_default[other],
                "equal_to_default": all(torch.equal(a, b) for a, b in zip(grads, base[name])),
                "rel_diff_to_default": max(_rel_diff(a, b) for a, b in zip(grads, base[name])),
            }, out)  # fmt: skip
            if name not in best or t < best[name][1]:
                best[name] = (cfg, t)
    if len(best) == 2:
        pair = AttnBwdConfig(dkdv=best["dkdv"][0], dq=best["dq"][0])
        t_pair = bench(partial(attention_bwd, dy, q, k, v, out_d, lse, batch, pair), rep=rep)
        t_def = bench(partial(attention_bwd, dy, q, k, v, out_d, lse, batch), rep=rep)
        emit(rows, {"bench": "attention_bwd_best", "config": tuple(pair), "bwd_ms": t_pair,
                    "tflops": 3.5 * flop_fwd / t_pair * 1e-9, "default_bwd_ms": t_def,
                    "default_tflops": 3.5 * flop_fwd / t_def * 1e-9}, out)  # fmt: skip


def bench_logprobs(rows: list[dict], out) -> None:
    from exactrl.ops.triton.logprobs import logprobs

    dtype = torch.bfloat16
    T, D, V = LOGPROB_SHAPE
    h = torch.randn(T, D, device=DEVICE, dtype=dtype)
    w = torch.randn(V, D, device=DEVICE, dtype=dtype) * D**-0.5
    tg = torch.randint(0, V, (T,), device=DEVICE)

    def fast():
        z = F.linear(h, w).float() / 0.7
        return torch.log_softmax(z, -1).gather(1, tg[:, None])

    with torch.no_grad():
        t_tri = bench(partial(logprobs, h, w, tg, 0.7, True))
        t_fast = bench(fast)
    emit(rows, {"bench": "logprobs_fwd", "T": T, "V": V, "triton_ms": t_tri, "torch_ms": t_fast,
                "ratio_vs_torch": t_fast / t_tri}, out)  # fmt: skip


def print_table(rows: list[dict]) -> None:
    print("\nmatmul (bf16): exact Triton vs cuBLAS; ratio = cuBLAS time / Triton time")
    print(
        f"{'shape':>8} {'K':>5} {'N':>7} {'M':>5} {'triton ms':>10} {'cublas ms':>10} {'ratio':>6} {'TFLOP/s':>8}"
    )
    for r in rows:
        if r["bench"] == "matmul":
            print(f"{r['shape']:>8} {r['K']:>5} {r['N']:>7} {r['M']:>5} {r['triton_ms']:>10.4f} "
                  f"{r['cublas_ms']:>10.4f} {r['ratio_vs_cublas']:>6.2f} {r['triton_tflops']:>8.1f}")  # fmt: skip
    big = [r["ratio_vs_cublas"] for r in rows if r["bench"] == "matmul" and r["M"] >= 256]
    if big:
        gm = math.exp(sum(math.log(x) for x in big) / len(big))
        print(f"geometric mean ratio at M >= 256: {gm:.3f} (min {min(big):.3f})")
    cfg_rows = [r for r in rows if r["bench"] == "matmul_config" and "ratio_vs_cublas" in r]
    if cfg_rows:
        print(
            "\nalternative matmul tiles (informational): geometric-mean ratio vs cuBLAS over the shapes, per M"
        )
        ms = sorted({r["M"] for r in cfg_rows})
        print(f"{'config':>22} " + " ".join(f"{m:>6}" for m in ms) + "  M>=256  equal_to_default")
        for cname in dict.fromkeys(r["config"] for r in cfg_rows):
            cells = []
            for m in ms:
                xs = [r["ratio_vs_cublas"] for r in cfg_rows if r["config"] == cname and r["M"] == m]
                cells.append(f"{math.exp(sum(map(math.log, xs)) / len(xs)):>6.2f}" if xs else f"{'-':>6}")
            eq = all(r["bitwise_equal_to_default"] for r in cfg_rows if r["config"] == cname)
            big = [r["ratio_vs_cublas"] for r in cfg_rows if r["config"] == cname and r["M"] >= 256]
            gm = f"{math.exp(sum(map(math.log, big)) / len(big)):>6.3f}" if big else f"{'-':>6}"
            print(f"{cname:>22} " + " ".join(cells) + f"  {gm}  {eq}")
    for r in rows:
        if r["bench"].startswith("attention") or r["bench"] == "logprobs_fwd":
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    ap.add_argument("--skip-configs", action="store_true", help="skip the alternative tile configs")
    ap.add_argument("--only-matmul-configs", action="store_true", help="only the alternative matmul tiles")
    ap.add_argument(
        "--configs", nargs="*", default=None, help="names of MATMUL_ALTERNATIVES to run (default all)"
    )
    ap.add_argument("--only-attention-configs", action="store_true", help="only the attention tile sweeps")
    ap.add_argument(
        "--forward-only", action="store_true", help="with --only-attention-configs: the forward's"
    )
    args = ap.parse_args(argv)
    require_cuda("bench_kernels.py")
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU", file=sys.stderr)
        return 1
    from exactrl.ops import set_exact_environment

    set_exact_environment(True)
    torch.manual_seed(0)
    out = open(args.out, "w") if args.out else None
    rows: list[dict] = []
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": __import__("triton").__version__}))  # fmt: skip
    ms = [1, 16, 256, 1024, 4096, 8192] if not args.quick else [1, 256, 4096]
    if args.only_attention_configs:
        bench_attention_configs(rows, out, backward=not args.forward_only)
        print_table(rows)
        return 0
    if args.only_matmul_configs:
        bench_matmul_configs([1, 256, 1024, 4096, 8192], rows, out, args.configs)
        print_table(rows)
        return 0
    bench_matmul(ms, rows, out)
    bench_attention(rows, out, args.quick)
    bench_logprobs(rows, out)
    if not args.skip_configs:
        bench_attention_configs(rows, out)
        bench_matmul_configs(ms, rows, out)
    print_table(rows)
    if out is not None:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
