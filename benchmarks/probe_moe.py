"""Exact vs fast MoE experts at qwen3-30b-a3b's layer shape: how much does the invariant MoE cost?

For T tokens (decode steps: 1, 16, 64, 256; a training microbatch: 8192), one MoE layer's routed experts
(D = 2048, I = 768, E = 128, k = 8, bf16) with the routing of a random router:
- exact: `TritonOps.moe_experts` (device-side sort, grouped Triton GEMMs, rank-order combine);
- fast: `FastCudaOps.moe_experts` (`torch._grouped_mm`, the combine in bf16).
Forward: GPU time per call, calls captured in a CUDA graph and replayed (what a decode step's graph sees; eager
with CUDA events where capture fails, marked). Forward + backward: eager, CUDA events, the exact path under
torch's deterministic algorithms as the RL loop runs it (warn_only, no fill of uninitialized memory), the fast
path without. Both include their own routing bookkeeping (sort, offsets); the router itself is not timed.

Columns: experts hit, µs per call, fast/exact (>= 0.9 is the target: exact at least 90% of the fast path's
speed), the expert weights read per forward at the achieved rate (GB/s: the decode roofline) and TFLOP/s.
A table, then one JSON line. Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_moe.py [--sizes 1,16,64]`.

--sweep: the exact path's grouped-GEMM and weight-gradient tiles (exactrl/ops/triton/moe.py), each timed and
checked for the default tile's bits (forward output; at training sizes the gradients too): one JSON line per
size and tile. Tiles of another BLOCK_K or BLOCK_M must give the same bits for the family to be usable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Callable, Iterator

import torch
from _script import require_cuda  # benchmarks/: the script's own folder is on sys.path

from exactrl.ops import set_exact_environment
from exactrl.ops.fast_cuda import FastCudaOps, grouped_mm_ok
from exactrl.ops.triton import moe
from exactrl.ops.triton.moe import MoETileConfig, WgradTileConfig, route_plan
from exactrl.ops.triton_ops import TritonOps

D, INTER, E, K = 2048, 768, 128, 8  # qwen3-30b-a3b: hidden, moe_intermediate_size, experts, experts per token
SIZES = (1, 16, 64, 256, 8192)
FWD_TILES = [MoETileConfig(64, bn, bk, 4, st) for bn in (64, 128) for bk in (64, 128) for st in (3, 4)] + [
    MoETileConfig(128, 128, 64, 8, 3),
    MoETileConfig(128, 64, 64, 4, 4),
    MoETileConfig(64, 256, 64, 8, 3),
]
WGRAD_TILES = [
    WgradTileConfig(128, 128, 64, 8, 3),
    WgradTileConfig(128, 128, 32, 8, 4),
    WgradTileConfig(64, 128, 64, 4, 3),
    WgradTileConfig(128, 64, 64, 4, 4),
    WgradTileConfig(128, 256, 64, 8, 3),
]


def time_graph(fn: Callable[[], object], reps: int) -> tuple[float, str]:
    """GPU µs per call: `reps` calls captured in one CUDA graph, replayed; eager with events if capture fails."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
    except Exception as e:  # e.g. the fast path's per-expert fallback syncs with the host
        torch.cuda.synchronize()
        return time_events(fn, reps), f"eager ({type(e).__name__})"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps), "graph"


def time_events(fn: Callable[[], object], reps: int) -> float:
    """GPU µs per eager call: the median over `reps` calls of CUDA-event time."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[None]:
    """torch's deterministic algorithms as train/loop.py sets them in exact mode, for the block."""
    before = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def probe(tokens: int, params: dict[str, torch.Tensor], exact: TritonOps, fast: FastCudaOps) -> dict:
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, D, generator=g, device="cuda").to(dt)
    w, ids = exact.moe_route(exact.linear(x, params["router"]), K, True)
    gate_up, down = params["gate_up"], params["down"]
    hit = int(torch.unique(ids).numel())
    rec: dict = {"T": tokens, "routed_rows": tokens * K, "experts_hit": hit}
    out_e = exact.moe_experts(x, gate_up, down, w, ids)
    out_f = fast.moe_experts(x, gate_up, down, w, ids)
    rec["rel_diff_fast_vs_exact"] = ((out_f.float() - out_e.float()).norm() / out_e.float().norm()).item()
    reps = 20 if tokens <= 256 else 3
    block_m = moe.moe_tile_config(tokens * K, dt).block_m
    rec["exact_plan_us"] = round(time_graph(lambda: route_plan(ids, E, block_m), reps)[0], 1)
    for name, ops in (("exact", exact), ("fast", fast)):
        us, mode = time_graph(lambda ops=ops: ops.moe_experts(x, gate_up, down, w, ids), reps)
        rec[f"{name}_fwd_us"], rec[f"{name}_fwd_mode"] = round(us, 1), mode
    # Forward + backward: every input that the trainer differentiates (x, both weights, the routing weights).
    gy = torch.randn(tokens, D, generator=g, device="cuda").to(dt)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, w)]

    def fwd_bwd(ops) -> None:
        for t in leaves:
            t.grad = None
        ops.moe_experts(*leaves, ids).backward(gy)

    for name, ops in (("exact", exact), ("fast", fast)):
        with deterministic(name == "exact"):
            rec[f"{name}_fwd_bwd_us"] = round(time_events(lambda ops=ops: fwd_bwd(ops), 10), 1)
    weight_bytes = hit * 3 * INTER * D * 2
    flops = 6 * tokens * K * D * INTER  # 2 * rows * (D * 2I + I * D)
    for name in ("exact", "fast"):
        us = rec[f"{name}_fwd_us"]
        rec[f"{name}_fwd_weight_GBps"] = round(weight_bytes / us / 1e3, 1)
        rec[f"{name}_fwd_TFLOPs"] = round(flops / us / 1e6, 2)
    rec["fwd_fast_over_exact"] = round(rec["fast_fwd_us"] / rec["exact_fwd_us"], 3)
    rec["fwd_bwd_fast_over_exact"] = round(rec["fast_fwd_bwd_us"] / rec["exact_fwd_bwd_us"], 3)
    return rec


def sweep(tokens: int, params: dict[str, torch.Tensor], exact: TritonOps) -> None:
    """Every candidate tile as the exact path's only tile: µs and whether the default tile's bits come out."""
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, D, generator=g, device="cuda").to(dt)
    gy = torch.randn(tokens, D, generator=g, device="cuda").to(dt)
    w, ids = exact.moe_route(exact.linear(x, params["router"]), K, True)
    gate_up, down = params["gate_up"], params["down"]
    train = tokens * K > 4096

    def fwd_bwd() -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
        exact.moe_experts(*leaves, ids).backward(gy)
        return [t.grad for t in leaves]

    want = exact.moe_experts(x, gate_up, down, w, ids)
    want_grads = fwd_bwd() if train else []
    saved = (dict(moe._MOE_CONFIGS), dict(moe._WGRAD_CONFIGS))
    try:
        for kind, tiles in (("fwd", FWD_TILES), ("wgrad", WGRAD_TILES if train else [])):
            for tile in tiles:
                if kind == "fwd":
                    moe._MOE_CONFIGS[dt] = (tile, tile)
                else:
                    moe._WGRAD_CONFIGS[dt] = tile
                rec = {"T": tokens, "kind": kind, "tile": tile.__dict__}
                try:
                    out = exact.moe_experts(x, gate_up, down, w, ids)
                    rec["equal"] = bool(torch.equal(out, want))
                    if kind == "fwd":
                        rec["fwd_us"] = round(
                            time_graph(lambda: exact.moe_experts(x, gate_up, down, w, ids), 5)[0], 1
                        )
                    if train:
                        rec["grads_equal"] = all(torch.equal(a, b) for a, b in zip(fwd_bwd(), want_grads))
                        rec["fwd_bwd_us"] = round(time_events(fwd_bwd, 5), 1)
                except Exception as e:  # out of shared memory or registers: report and go on
                    rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                print(json.dumps(rec), flush=True)
                moe._MOE_CONFIGS.update(saved[0])
                moe._WGRAD_CONFIGS.update(saved[1])
    finally:
        moe._MOE_CONFIGS.update(saved[0])
        moe._WGRAD_CONFIGS.update(saved[1])


def main() -> None:
    ap = argparse.ArgumentParser(description="exact vs fast MoE experts, qwen3-30b-a3b layer shape")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="token counts, comma-separated")
    ap.add_argument("--sweep", action="store_true", help="time the exact path's candidate tiles instead")
    args = ap.parse_args()
    require_cuda("probe_moe.py")
    set_exact_environment(True)
    torch.manual_seed(0)
    dt = torch.bfloat16
    params = {
        "gate_up": (torch.randn(E, 2 * INTER, D, device="cuda") * D**-0.5).to(dt),
        "down": (torch.randn(E, D, INTER, device="cuda") * INTER**-0.5).to(dt),
        "router": (torch.randn(E, D, device="cuda") * D**-0.5).to(dt),
    }
    exact, fast = TritonOps(), FastCudaOps()
    if args.sweep:
        for t in args.sizes.split(","):
            sweep(int(t), params, exact)
        return
    x1 = torch.zeros(1, D, device="cuda", dtype=dt)
    grouped = grouped_mm_ok(x1, params["gate_up"], params["down"])
    rows = [probe(int(t), params, exact, fast) for t in args.sizes.split(",")]
    head = (
        f"{'T':>6} {'hit':>4} {'plan':>6} {'exact fwd':>10} {'fast fwd':>10} {'f/e':>6} {'exact GB/s':>10} "
    )
    head += f"{'exact f+b':>10} {'fast f+b':>10} {'f/e':>6} {'diff':>8}"
    print(head)
    for r in rows:
        print(
            f"{r['T']:>6} {r['experts_hit']:>4} {r['exact_plan_us']:>6.1f} {r['exact_fwd_us']:>10.1f} {r['fast_fwd_us']:>10.1f} "
            f"{r['fwd_fast_over_exact']:>6.2f} {r['exact_fwd_weight_GBps']:>10.0f} {r['exact_fwd_bwd_us']:>10.1f} "
            f"{r['fast_fwd_bwd_us']:>10.1f} {r['fwd_bwd_fast_over_exact']:>6.2f} {r['rel_diff_fast_vs_exact']:>8.1e}"
        )
    import triton

    print(
        json.dumps(
            {
                "probe": "moe",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "triton": triton.__version__,
                "shape": {"D": D, "I": INTER, "E": E, "k": K, "dtype": "bfloat16"},
                "fast_path": "torch._grouped_mm" if grouped else "per-expert cuBLAS",
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
