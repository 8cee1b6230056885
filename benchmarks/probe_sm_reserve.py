"""Can a decode-like chain of exact kernels run beside the trainer's persistent GEMMs? (Probe for overlapping
generation with training on one GPU.) A thread runs back-to-back exact Triton GEMMs (the trainer) with 0, 16, 32
or 48 SMs left out of their persistent grids (a running program is never preempted, whatever the streams'
priorities; the grid size only decides which program computes a tile, never how); the main thread replays a
CUDA graph of 28 layers of small exact GEMMs (a decode step's shape, 32 rows) on a high-priority stream. Prints
the chain's median latency and the trainer's GEMM throughput for each reserve, and one JSON line."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import torch
from _script import parser, require_cuda  # benchmarks/: the script's own folder is on sys.path

from exactrl.ops.triton import matmul as mm
from exactrl.ops.triton.matmul import linear

_reserve = threading.local()
_full_cap = mm.num_programs_cap


def _cap(device: torch.device) -> int:  # the persistent grid less this thread's reserve
    return max(1, _full_cap(device) - getattr(_reserve, "n", 0))


mm.num_programs_cap = _cap


@contextlib.contextmanager
def sms_reserved(n: int) -> Iterator[None]:
    _reserve.n = n
    try:
        yield
    finally:
        _reserve.n = 0


def main() -> None:
    parser(__doc__).parse_args()
    require_cuda("probe_sm_reserve.py")
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    x = torch.randn(32, 2048, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(n, 2048, device=dev, dtype=torch.bfloat16) * 0.02 for n in (4096, 2048, 6144)]
    wd = torch.randn(2048, 6144, device=dev, dtype=torch.bfloat16) * 0.02

    def chain() -> torch.Tensor:
        h = x
        for _ in range(28):  # a layer: qkv, o, gate|up, down
            linear(h, ws[0])
            h = linear(h, ws[1])
            u = linear(h, ws[2])
            h = linear(u, wd)
        return h

    hi = torch.cuda.Stream(dev, priority=-100)
    hi.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(hi):
        chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=hi):
        chain()
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for reserve in (0, 16, 32, 48):  # compile each grid's kernel here, not in the thread
        with sms_reserved(reserve):
            linear(a, b)
    torch.cuda.synchronize()
    stop = threading.Event()
    done = [0]

    def load(reserve: int) -> None:
        try:
            torch.cuda.set_device(dev)
            with sms_reserved(reserve):
                while not stop.is_set():
                    for _ in range(4):
                        linear(a, b)
                    torch.cuda.current_stream().synchronize()
                    done[0] += 4
        except BaseException as err:  # shown, not lost in the thread
            print("load thread failed:", repr(err), flush=True)
            raise

    def chain_ms() -> float:
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            with torch.cuda.stream(hi):
                g.replay()
            hi.synchronize()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[len(ts) // 2] * 1e3

    res: dict[str, float] = {"idle_chain_ms": chain_ms()}
    for reserve in (0, 16, 32, 48):
        # the load alone: its GEMM rate with this reserve
        stop.clear()
        done[0] = 0
        th = threading.Thread(target=load, args=(reserve,))
        th.start()
        time.sleep(1.0)
        n0, t0 = done[0], time.perf_counter()
        time.sleep(1.5)
        alone = (done[0] - n0) / (time.perf_counter() - t0)
        n0, t0 = done[0], time.perf_counter()
        busy = chain_ms()
        shared = (done[0] - n0) / (time.perf_counter() - t0)
        stop.set()
        th.join()
        flops = 2 * 8192**3
        res[f"reserve{reserve}_chain_ms"] = busy
        res[f"reserve{reserve}_gemm_tflops_alone"] = alone * flops / 1e12
        res[f"reserve{reserve}_gemm_tflops_beside_chain"] = shared * flops / 1e12
    for k, v in res.items():
        print(f"{k:40s} {v:9.3f}")
    print(json.dumps({"probe": "sm_reserve", "gpu": torch.cuda.get_device_name(), **res}))


if __name__ == "__main__":
    main()
