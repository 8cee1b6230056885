"""Where a training step's host time goes (issue: the step is host-bound on some machines).

One preset's exact trainer (random init, 8 x 1,024 tokens as `exactrl bench train`), warm-up steps, then one step
under the torch profiler with CPU and CUDA activities. Prints one JSON line:
- wall time of the step against the GPU's kernel time (the union of kernel intervals on the device timeline),
- the host's launch work (kernel launches: count and CPU time) and every synchronizing call (stream/device
  synchronizations, device-to-host copies, `.item()`), with the Python frames that issued them,
- the top host operators by self CPU time.
`--busy-cores N` runs N spinning processes beside the step (a `yes > /dev/null` each), as a shared host would.

GPU: `PYTHONPATH=. python3 benchmarks/probe_host_side.py --preset qwen3-0.6b [--busy-cores 1]`.
CPU dry run (the harness, not a measurement): `--device cpu --preset tiny --tokens 256`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from types import SimpleNamespace

from _script import busy_cores  # benchmarks/: the script's own folder is on sys.path

SYNC_NAMES = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "aten::_local_scalar_dense",
)
LAUNCH_NAMES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaGraphLaunch",
)


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) intervals in microseconds."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the step's one microbatch")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--mode", default="exact", choices=("exact", "fast"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--busy-cores", type=int, default=0, help="spinning processes beside the run")
    ap.add_argument(
        "--host-threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: as `exactrl train` and `bench` set them, limit_host_threads; -1: torch's "
        "default, one per core)",
    )
    args = ap.parse_args()

    import torch

    if args.host_threads > 0:
        torch.set_num_threads(args.host_threads)
    elif args.host_threads == 0:
        from exactrl.distributed.env import limit_host_threads

        limit_host_threads(args.device)

    from exactrl.bench import _bench_rollouts
    from exactrl.model.loading import load_policy
    from exactrl.ops import set_exact_environment
    from exactrl.train.optim import MasterAdamW
    from exactrl.train.trainer import PolicyTrainer, TrainerSettings

    exact = args.mode == "exact"
    set_exact_environment(exact)
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    model, tok = load_policy(
        preset_name=args.preset, path=None, device=args.device, dtype=dtype, exact=exact, seed=0
    )
    rollouts, tokens = _bench_rollouts(SimpleNamespace(tokens_per_microbatch=args.tokens), model, tok)
    settings = TrainerSettings(max_tokens_per_microbatch=args.tokens, exact=exact, on_mismatch="warn")
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spinners = busy_cores(args.busy_cores)
    try:
        for _ in range(args.warmup):
            trainer.step(rollouts)
        sync()
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else []
        )
        with torch.profiler.profile(activities=acts, with_stack=True) as prof:
            t0 = time.perf_counter()
            trainer.step(rollouts)
            sync()
            wall_ms = (time.perf_counter() - t0) * 1e3
    finally:
        for p in spinners:
            p.terminate()
    events = prof.events()
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    gpu_ms = _union_ms(kernels)
    syncs: Counter = Counter()
    sync_frames: Counter = Counter()
    launches, launch_us = 0, 0.0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.name in LAUNCH_NAMES:
            launches += 1
            launch_us += e.cpu_time_total
        elif e.name in SYNC_NAMES or (e.name == "cudaMemcpyAsync" and "DtoH" in str(e.input_shapes)):
            syncs[e.name] += 1
            frames = [f for f in (e.stack or []) if "exactrl" in f][:2]
            sync_frames[" <- ".join(frames) or "(no exactrl frame)"] += 1
    ka = sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)
    rec = {
        "probe": "host-side",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "preset": args.preset,
        "mode": args.mode,
        "tokens": tokens,
        "busy_cores": args.busy_cores,
        "host_threads": torch.get_num_threads(),
        "step_wall_ms": round(wall_ms, 1),
        "gpu_kernel_ms": round(gpu_ms, 1),
        "gpu_busy_share": round(gpu_ms / wall_ms, 3) if cuda else None,
        "kernel_launches": launches,
        "launch_cpu_ms": round(launch_us / 1e3, 1),
        "syncs": dict(syncs),
        "sync_sites": sync_frames.most_common(12),
        "top_host_ops_ms": [[k.key[:60], k.count, round(k.self_cpu_time_total / 1e3, 2)] for k in ka[:20]],
    }
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
