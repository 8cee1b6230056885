"""Each training step's time, not their mean: does a run's rate move because every step is slower, or because of a
few slow steps? And does Python's garbage collector run during them?

One preset's exact trainer (random init, one microbatch of 8 x 1,024 tokens, as `exactrl bench train`), one warm-up
step, then `--steps` synchronized steps timed one by one, a `gc.callbacks` hook counting collections (`--gc off`
disables the collector after the warm-up). Then one step with CUDA events around it (GPU time against the wall
clock) and, with `--profile`, one step under the torch profiler: the top kernels by GPU time.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_step_times.py --preset qwen3-1.7b [--steps 30] [--gc off]
[--profile]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from types import SimpleNamespace

import torch
from _script import cap_host_threads  # benchmarks/: the script's own folder is on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--gc", choices=("on", "off"), default="on")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (with a small preset)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model dtype")
    args = ap.parse_args()
    cap_host_threads(args.device)  # as `exactrl` caps them on CUDA
    on_gpu = args.device != "cpu"

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    from exactrl.bench import _bench_rollouts, _step_times
    from exactrl.model.loading import load_policy
    from exactrl.ops import set_exact_environment
    from exactrl.train.optim import MasterAdamW
    from exactrl.train.trainer import PolicyTrainer, TrainerSettings

    set_exact_environment(True)
    dev = torch.device(args.device)
    model, tok = load_policy(
        preset_name=args.preset, path=None, device=args.device, dtype=args.dtype, exact=True, seed=0
    )
    rollouts, tokens = _bench_rollouts(SimpleNamespace(tokens_per_microbatch=args.tokens), model, tok)
    settings = TrainerSettings(
        algorithm="grpo", max_tokens_per_microbatch=args.tokens, exact=True, on_mismatch="warn"
    )
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5))

    def step() -> None:
        trainer.step(rollouts)

    step()
    sync()
    if args.gc == "off":
        gc.disable()
    collections: list[tuple[str, int]] = []
    gc.callbacks.append(lambda phase, info: collections.append((phase, info["generation"])))
    times = _step_times(step, args.steps, dev)
    med = statistics.median(times)
    # On the GPU: CUDA events around one step (its GPU time against the wall clock); none on the CPU.
    e0, e1 = (
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        if on_gpu
        else (None, None)
    )
    sync()
    t = time.perf_counter()
    if on_gpu:
        e0.record()
    step()
    if on_gpu:
        e1.record()
    sync()
    rec = {
        "probe": "step-times",
        "gpu": torch.cuda.get_device_name(dev) if on_gpu else "cpu",
        "preset": args.preset,
        "gc": args.gc,
        "gc_collections": sum(phase == "start" for phase, _ in collections),
        "steps_ms": [round(x * 1e3, 1) for x in times],
        "median_tokens_per_s": round(tokens / med),
        "mean_tokens_per_s": round(tokens / statistics.fmean(times)),
        "steps_over_1.05_median": sum(x > 1.05 * med for x in times),
        "one_step_wall_ms": round((time.perf_counter() - t) * 1e3, 1),
        "one_step_events_ms": round(e0.elapsed_time(e1), 1) if on_gpu else None,
    }
    if args.profile:
        act = torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[act]) as prof:
            step()
            sync()

        def own(k) -> float:  # a kernel's GPU time; on the CPU an operator's own CPU time
            return k.device_time_total if on_gpu else k.self_cpu_time_total

        ka = sorted(prof.key_averages(), key=lambda k: -own(k))
        rec["gpu_kernel_ms"] = round(sum(own(k) for k in ka) / 1e3, 1)
        rec["top_kernels_ms"] = [[k.key[:80], k.count, round(own(k) / 1e3, 2)] for k in ka[:12]]
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
