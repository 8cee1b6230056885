"""Does a CUDA graph replayed on a high-priority stream get ahead of another stream's GEMMs? (Probe for the
one-step-off worker: its decode graphs compete with the trainer's kernels.) Prints the latency of a small graph
(a chain of short kernels, like a decode step) replayed alone and while a GEMM loop runs on the default stream,
for graphs captured on a default- and on a high-priority stream, each replayed on a high-priority stream, and
the eager chain on either stream. One JSON line at the end."""

from __future__ import annotations

import json
import threading
import time

import torch
from _script import parser, require_cuda  # benchmarks/: the script's own folder is on sys.path


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(40):  # 40 small GEMMs + adds: a decode step's shape of work
        x = torch.addmm(x, x, w)
    return x


def main() -> None:
    parser(__doc__).parse_args()
    require_cuda("probe_priority.py")
    dev = torch.device("cuda")
    x = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16) * 0.001
    hi = torch.cuda.Stream(dev, priority=-100)
    lo_cap = torch.cuda.Stream(dev)
    print("priority range", torch.cuda.Stream.priority_range(), "hi", hi.priority)
    graphs = {}
    for name, cap in (("captured_default", lo_cap), ("captured_high", hi)):
        cap.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(cap):
            chain(x, w)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=cap):
            chain(x, w)
        graphs[name] = g
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    stop = threading.Event()

    def load() -> None:  # the trainer: back-to-back big GEMMs on the default stream
        while not stop.is_set():
            for _ in range(4):
                torch.mm(a, a)
            torch.cuda.current_stream().synchronize()

    def timed(fn, stream) -> float:
        ts = []
        for _ in range(30):
            torch.cuda.synchronize(dev) if not busy else stream.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                fn()
            stream.synchronize()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[len(ts) // 2] * 1e3

    res = {}
    for busy in (False, True):
        th = None
        if busy:
            stop.clear()
            th = threading.Thread(target=load)
            th.start()
            time.sleep(0.5)
        tag = "busy" if busy else "idle"
        res[f"{tag}_graph_captured_default_on_high_ms"] = timed(graphs["captured_default"].replay, hi)
        res[f"{tag}_graph_captured_high_on_high_ms"] = timed(graphs["captured_high"].replay, hi)
        res[f"{tag}_graph_captured_default_on_default_prio_ms"] = timed(
            graphs["captured_default"].replay, lo_cap
        )
        res[f"{tag}_eager_on_high_ms"] = timed(lambda: chain(x, w), hi)
        res[f"{tag}_eager_on_default_prio_ms"] = timed(lambda: chain(x, w), lo_cap)
        if th is not None:
            stop.set()
            th.join()
    for k, v in res.items():
        print(f"{k:48s} {v:8.3f}")
    print(json.dumps({"probe": "stream_priority", "gpu": torch.cuda.get_device_name(), **res}))


if __name__ == "__main__":
    main()
