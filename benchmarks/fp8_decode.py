"""Decode tok/s of model.precision = "fp8" against the model dtype, side by side in one process.

For each preset the model is built once (bf16, random weights drawn "keyed", on several threads); then for each
concurrency the same `exactrl bench rollout` measurement (`exactrl.bench._rollout_on_rank`: warm-up call with
graph capture, then one timed `generate`) runs with the projections in the model dtype and in fp8, alternating,
`--repeats` times. One JSON record per measurement on stdout (each says "precision"), and, with --out-dir, one
file per record as `exactrl bench rollout` writes them, plus a summary line per (preset, concurrency) with the
fp8/dtype ratio of the best of each.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/fp8_decode.py --presets qwen3-0.6b,qwen3-8b --concurrency 1,64`.
Dry run on the CPU: `--device cpu --presets tiny --dtype float32 --concurrency 1 --prompt-len 8 --max-tokens 4`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _script import cap_host_threads  # benchmarks/: the script's own folder is on sys.path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="qwen3-0.6b,qwen3-8b", help="comma-separated preset names")
    p.add_argument("--concurrency", default="1,64", help="comma-separated sequence counts")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="alternations of dtype and fp8 per concurrency")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--out-dir", help="also write one record file per measurement here")
    p.add_argument(
        "--profile",
        default="",
        help="comma-separated concurrencies: after their measurements, one more run of each precision under "
        "torch.profiler (warm-up and capture included), its kernels with the most GPU time as one JSON line",
    )
    p.add_argument(
        "--trace-dir", help="with --profile: also write each profiled run's Chrome trace here (.json.gz)"
    )
    args = p.parse_args()
    cap_host_threads(args.device)  # the CLI's host-thread rule: a busy core beside the run must not halve it

    from exactrl.bench import _rollout_on_rank, record_head  # noqa: F401 - record_head: the record's keys
    from exactrl.distributed.env import DistContext
    from exactrl.model.loading import load_policy
    from exactrl.model.precision import use_fp8
    from exactrl.ops import set_exact_environment

    set_exact_environment(True)
    ctx = DistContext.single()
    for preset in args.presets.split(","):
        model, tok = load_policy(preset_name=preset, device=args.device, dtype=args.dtype, init_draws="keyed")
        plain = model.ops
        fp8 = use_fp8(model)  # quantized once; the model switches between the two backends below
        for c in (int(x) for x in args.concurrency.split(",")):
            best: dict[str, float] = {}
            for _ in range(args.repeats):
                for precision, ops in (("dtype", plain), ("fp8", fp8)):
                    model.set_ops(ops)
                    ns = argparse.Namespace(
                        what="rollout", preset=preset, model=None, mode="exact", dtype=args.dtype,
                        precision=precision, concurrency=c, prompt_len=args.prompt_len,
                        max_tokens=args.max_tokens, vs=None, device=args.device, split_kv="auto",
                    )  # fmt: skip
                    rec = _rollout_on_rank(ns, ctx, loaded=(args.device, model, tok))
                    rec["script"] = "benchmarks/fp8_decode.py"
                    print(json.dumps(rec), flush=True)
                    best[precision] = max(best.get(precision, 0.0), rec["tokens_per_s"])
                    if args.out_dir:
                        name = f"rollout-{preset}-c{c}-exact" + ("-fp8" if precision == "fp8" else "")
                        path = Path(args.out_dir) / f"{name}-{rec['gpu'] or 'cpu'}.json".replace(" ", "-")
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(json.dumps(rec) + "\n")
            if str(c) in args.profile.split(","):
                for precision, ops in (("dtype", plain), ("fp8", fp8)):
                    model.set_ops(ops)
                    ns.precision = precision
                    trace = None
                    if args.trace_dir:
                        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                        trace = str(Path(args.trace_dir) / f"decode-{preset}-c{c}-{precision}.json.gz")
                    print(
                        json.dumps(_profiled(ns, ctx, (args.device, model, tok), preset, c, trace)),
                        flush=True,
                    )
            summary = {
                "summary": "fp8_decode",
                "preset": preset,
                "concurrency": c,
                "dtype_tokens_per_s": best["dtype"],
                "fp8_tokens_per_s": best["fp8"],
                "fp8_over_dtype": best["fp8"] / best["dtype"],
            }
            print(json.dumps(summary), flush=True)
        del model, plain, fp8
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


def _profiled(ns, ctx, loaded, preset: str, c: int, trace: str | None = None, top: int = 15) -> dict:
    """One `_rollout_on_rank` under torch.profiler: the kernels with the most GPU time (own time, all calls);
    `trace`: the Chrome trace's path (benchmarks/trace_gaps.py reads it)."""
    from torch.profiler import ProfilerActivity, profile

    from exactrl.bench import _rollout_on_rank

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _rollout_on_rank(ns, ctx, loaded=loaded)
    if trace:
        prof.export_chrome_trace(trace)
    kind = torch.autograd.DeviceType.CUDA
    events = sorted(
        (e for e in prof.key_averages() if e.device_type == kind),
        key=lambda e: e.self_device_time_total,
        reverse=True,
    )
    rows = [
        {"kernel": e.key[:100], "ms": round(e.self_device_time_total / 1e3, 2), "count": e.count}
        for e in events
    ]
    total = sum(r["ms"] for r in rows)
    return {
        "profile": preset,
        "concurrency": c,
        "precision": ns.precision,
        "total_gpu_ms": round(total, 1),
        "top": rows[:top],
    }


if __name__ == "__main__":
    raise SystemExit(main())
