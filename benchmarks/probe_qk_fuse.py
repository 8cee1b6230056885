"""What one launch for Qwen3's q/k norm + RoPE and the K/V cache write saves a decode step, and that it keeps bits.

Per attention layer of qwen3-0.6b (Hq 16, Hkv 8, Dh 128, bf16) at T new rows: today's three launches
(`rms_norm_rope` for q, for k, then `write_kv_cache`) against `qk_norm_rope` (one launch). Each is timed as 28 calls
(one per layer) captured in a CUDA graph, as the engine's decode step replays them, so the figure is GPU time with
the launch ramp the graph still pays; and every output (q, k, both caches) is compared with torch.equal. A table,
then one JSON line.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_qk_fuse.py`.
"""

from __future__ import annotations

import json
import time

import torch
from _script import kernel_device, parser  # benchmarks/: the script's own folder is on sys.path

from exactrl.ops.triton.kv_write import write_kv_cache
from exactrl.ops.triton.norm import qk_norm_rope, rms_norm_rope

HQ, HKV, DH, LAYERS, EPS = 16, 8, 128, 28, 1e-6


def _step(T: int, dev: str, dtype: torch.dtype = torch.bfloat16, pages: int = 64, page: int = 16) -> dict:
    g = torch.Generator().manual_seed(T)
    qkv = (torch.randn(T, (HQ + 2 * HKV) * DH, generator=g) * 2).to(dtype).to(dev)
    ang = torch.arange(4096, dtype=torch.float64)[:, None] * 1e6 ** (-torch.arange(DH // 2) / (DH // 2))
    return dict(
        q=qkv[:, : HQ * DH].view(T, HQ, DH),
        k=qkv[:, HQ * DH : (HQ + HKV) * DH].view(T, HKV, DH),
        v=qkv[:, (HQ + HKV) * DH :].view(T, HKV, DH),
        qw=(1 + 0.5 * torch.randn(DH, generator=g)).to(dtype).to(dev),
        kw=(1 + 0.5 * torch.randn(DH, generator=g)).to(dtype).to(dev),
        pos=torch.randint(0, 4096, (T,), generator=g).to(dev),
        cs=torch.cat((ang.cos(), ang.sin()), -1).float().to(dev),
        slots=torch.randperm(pages * page, generator=g)[:T].to(dev),
        cache=[torch.zeros(pages, page, HKV, DH, dtype=dtype, device=dev) for _ in range(2)],
    )


def three_launches(s: dict, cache) -> tuple[torch.Tensor, torch.Tensor]:
    q = rms_norm_rope(s["q"], s["qw"], EPS, s["pos"], s["cs"])
    k = rms_norm_rope(s["k"], s["kw"], EPS, s["pos"], s["cs"])
    write_kv_cache(k, s["v"], cache, s["slots"])
    return q, k


def one_launch(s: dict, cache) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_norm_rope(s["q"], s["k"], s["v"], s["qw"], s["kw"], EPS, s["pos"], s["cs"], cache, s["slots"])


def _us_per_layer(fn, s: dict, replays: int = 300) -> float:
    cache = [c.clone() for c in s["cache"]]
    if not torch.cuda.is_available():  # Triton's interpreter on the CPU (the dry run): one call's wall time
        t = time.perf_counter()
        fn(s, cache)
        return (time.perf_counter() - t) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(s, cache)  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn(s, cache)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (replays * LAYERS) * 1e6


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", default="1,8,64,256", help="comma-separated new rows T of a decode step")
    args = ap.parse_args()
    dev = kernel_device("probe_qk_fuse.py")
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter)"
    rows = []
    for T in (int(t) for t in args.rows.split(",")):
        s = _step(T, dev)
        ca, cb = [c.clone() for c in s["cache"]], [c.clone() for c in s["cache"]]
        equal = all(
            torch.equal(a, b) for a, b in zip((*three_launches(s, ca), *ca), (*one_launch(s, cb), *cb))
        )
        rows.append(
            dict(
                T=T,
                three_us=_us_per_layer(three_launches, s),
                one_us=_us_per_layer(one_launch, s),
                equal=equal,
            )
        )
    print(f"{name}: us per layer (28 layers in one CUDA graph)")
    print(
        "| T | three launches | one launch | saved per step (28 layers) | bits equal |\n|---:|---:|---:|---:|:---:|"
    )
    for r in rows:
        saved = (r["three_us"] - r["one_us"]) * LAYERS
        print(f"| {r['T']} | {r['three_us']:.2f} | {r['one_us']:.2f} | {saved:.0f} us | {r['equal']} |")
    print(json.dumps({"device": name, "rows": rows}))


if __name__ == "__main__":
    main()
