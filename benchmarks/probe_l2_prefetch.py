"""Would a one-sequence decode step gain from asking L2 for a GEMM's weight one kernel ahead?

A decode step at one sequence runs ~10 kernels a layer; the four projection GEMMs stream 31.5 MB of weight
(qwen3-0.6b), the others (norms, RoPE, attention, SiLU) move almost nothing and leave HBM idle for their few
microseconds. This probe times the model's one-row GEMMs in one CUDA graph (inside `pdl_launches`, as the engine
runs them) over 28 layers' distinct weights (cold: every weight comes from HBM), over one layer's weights repeated
(hot: from L2), and with a short single-program kernel before each GEMM (standing in for the layer's small
kernels) that either does nothing else or first asks L2 for the next GEMM's weight (`cp.async.bulk.prefetch.L2`).
Prefetching changes no value: the GEMM's outputs are compared with torch.equal against the cold run.

`--chain`: a one-row GEMM's time against K (N = 1,024, L2-hot, the decode tiles): every output element is one chain
of K / 16 dependent MMAs (the in-order K reduction exactness rests on), so the slope is the latency of one link of
that chain, and the intercept the rest of the kernel. cuBLAS beside it. JSON lines.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_l2_prefetch.py [--preset qwen3-0.6b] [--spin 500 2000]
[--chain]`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl
from _script import require_cuda  # benchmarks/: the script's own folder is on sys.path

from exactrl.model.config import preset
from exactrl.ops.triton.common import pdl, pdl_launches, pdl_wait
from exactrl.ops.triton.matmul import matmul

_CHUNK = 1 << 16  # bytes a prefetch instruction asks for


@triton.jit
def _busy_kernel(
    x_ptr,
    w_ptr,
    n_elems,
    SPIN: tl.constexpr,
    NCHUNK: tl.constexpr,
    CHUNK_ELEMS: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if PREFETCH:  # before the wait: the weight is not written by any kernel of the step
        offs = tl.arange(0, NCHUNK).to(tl.int64) * CHUNK_ELEMS
        nbytes = (tl.minimum(n_elems - offs, CHUNK_ELEMS) * 2).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [w_ptr + offs, nbytes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    pdl_wait(USE_PDL)
    v = tl.load(x_ptr).to(tl.float32)
    for _ in range(SPIN):
        v = v * 0.999 + 0.001
    tl.store(x_ptr, v.to(x_ptr.dtype.element_ty))


def _shapes(name: str) -> list[tuple[int, int]]:
    c = preset(name)
    h, hd = c.hidden_size, c.head_dim
    return [
        ((c.num_heads + 2 * c.num_kv_heads) * hd, h),
        (h, c.num_heads * hd),
        (2 * c.intermediate_size, h),
        (h, c.intermediate_size),
    ]


def _graph_us(fn, layers: int) -> float:
    with pdl_launches():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / 20)
    return best / layers * 1e6


def _chain(gpu: str) -> None:
    import torch.nn.functional as F

    from exactrl.ops.triton.matmul import MatmulConfig

    dev = torch.device("cuda")
    n = 1024
    # 64-row tiles: Hopper's wgmma (the decode family); 16- and 32-row tiles with fewer warps: Triton lowers those
    # to mma.sync (m16n8k16), another instruction whose chain may be shorter: equal bits are checked, not assumed.
    tiles = [
        MatmulConfig(64, 16, 256, 8, 4, 3),
        MatmulConfig(64, 16, 128, 8, 4, 4),
        MatmulConfig(64, 32, 128, 8, 4, 4),
        MatmulConfig(64, 64, 128, 8, 4, 4),
        MatmulConfig(16, 16, 256, 8, 1, 3),
        MatmulConfig(16, 16, 128, 8, 1, 4),
        MatmulConfig(16, 32, 128, 8, 1, 4),
        MatmulConfig(16, 64, 128, 8, 2, 4),
        MatmulConfig(32, 32, 128, 8, 2, 4),
    ]
    for k in (256, 512, 1024, 2048, 4096, 8192):
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        # bits: 40 rows of mixed magnitudes and the timed row, each equal to the wgmma tile's
        xs = (torch.randn(40, k, device=dev) * torch.logspace(-3, 3, 40, device=dev)[:, None]).to(
            torch.bfloat16
        )
        ref, ref1 = matmul(xs, w, config=tiles[0]), matmul(x, w, config=tiles[0])
        for cfg in tiles:
            same = torch.equal(matmul(xs, w, config=cfg), ref) and torch.equal(matmul(x, w, config=cfg), ref1)
            us = _graph_us(lambda cfg=cfg, x=x, w=w: [matmul(x, w, config=cfg) for _ in range(20)], 20)
            print(
                json.dumps(
                    {
                        "probe": "mma-chain",
                        "gpu": gpu,
                        "n": n,
                        "k": k,
                        "links": k // 16,
                        "tile": [cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps],
                        "us": round(us, 2),
                        "equal_first_tile": same,
                    }
                ),
                flush=True,
            )
        us = _graph_us(lambda x=x, w=w: [F.linear(x, w) for _ in range(20)], 20)
        print(
            json.dumps(
                {"probe": "mma-chain", "gpu": gpu, "n": n, "k": k, "tile": "cublas", "us": round(us, 2)}
            ),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--spin", type=int, nargs="+", default=[500, 2000])
    ap.add_argument("--chain", action="store_true")
    args = ap.parse_args()
    require_cuda("probe_l2_prefetch.py")
    dev = torch.device("cuda")
    if args.chain:
        _chain(torch.cuda.get_device_name(dev))
        return
    torch.manual_seed(0)
    shapes = _shapes(args.preset)
    ws = [
        [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
        for _ in range(args.layers)
    ]
    xs = [torch.randn(1, k, device=dev, dtype=torch.bfloat16) for _, k in shapes]
    scratch = torch.zeros(1, device=dev, dtype=torch.float32)
    outs: dict[str, list[torch.Tensor]] = {}

    def busy(w: torch.Tensor | None, spin: int) -> None:
        n = w.numel() if w is not None else 0
        nchunk = triton.next_power_of_2(max(1, triton.cdiv(n * 2, _CHUNK)))
        _busy_kernel[(1,)](
            scratch,
            w if w is not None else scratch,
            n,
            SPIN=spin,
            NCHUNK=nchunk,
            CHUNK_ELEMS=_CHUNK // 2,
            PREFETCH=w is not None,
            **pdl(dev),
        )

    def run(name: str, hot: bool, spin: int | None, prefetch: bool):
        res: list[torch.Tensor] = []
        outs[name] = res

        def fn() -> None:
            res.clear()
            for layer in range(args.layers):
                for j, x in enumerate(xs):
                    w = ws[0 if hot else layer][j]
                    if spin is not None:
                        busy(w if prefetch else None, spin)
                    res.append(matmul(x, w))

        return fn

    busy_alone = {
        s: _graph_us(lambda s=s: [busy(None, s) for _ in range(4 * args.layers)], args.layers)
        for s in args.spin
    }
    rows = [("cold", False, None, False), ("hot", True, None, False)]
    for s in args.spin:
        rows += [(f"cold+busy{s}", False, s, False), (f"cold+busy{s}+prefetch", False, s, True)]
    gpu = torch.cuda.get_device_name(dev)
    for name, hot, spin, pf in rows:
        us = _graph_us(run(name, hot, spin, pf), args.layers)
        rec = {
            "probe": "l2-prefetch",
            "gpu": gpu,
            "preset": args.preset,
            "arm": name,
            "us_per_layer": round(us, 2),
            "weight_MB_per_layer": round(sum(n * k * 2 for n, k in shapes) / 1e6, 2),
        }
        if spin is not None:
            rec["busy_alone_us_per_layer"] = round(busy_alone[spin], 2)
        print(json.dumps(rec), flush=True)
    cold, pre = outs["cold"], outs[f"cold+busy{args.spin[0]}+prefetch"]
    same = all(torch.equal(a, b) for a, b in zip(cold, pre, strict=True))
    print(json.dumps({"probe": "l2-prefetch", "outputs_equal_cold_vs_prefetched": same}), flush=True)


if __name__ == "__main__":
    main()
