"""Where exactrl's training step and the compiled stock-PyTorch step (exactrl/bench_torch.py) spend GPU time.

For one preset (random init, bf16, 8 x 1,024 tokens, the shape of `exactrl bench train --vs torch`), profiles two
steps of exactrl's trainer in each mode asked for and two of the stock step on the same weights, sorts every
kernel into a category (GEMM, attention forward / backward, LM head + logprobs, norms, elementwise, optimizer,
copies, other) by its name, and prints one table with the categories side by side (ms of GPU time a step), the
device-busy and wall time a step, the top kernels of each step, and one JSON line.

Usage (GPU): PYTHONPATH=. python benchmarks/profile_vs_torch.py --preset qwen3-1.7b [--modes exact fast]
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections import defaultdict
from types import SimpleNamespace

import torch
from _script import cap_host_threads  # benchmarks/: the script's own folder is on sys.path
from torch.profiler import ProfilerActivity, profile
from train_vs_torch import _free, _time  # benchmarks/: the script's own folder is on sys.path

# First match wins; names are lower-cased. Inductor names its fused kernels after the ops they fuse
# (triton_red_fused__log_softmax_..., triton_per_fused_add_mean_mul_pow_rsqrt_...).
CATEGORIES: list[tuple[str, str]] = [
    ("optimizer", r"adam|multi_tensor|foreach|_amp_|clip|norm_kernel|l2norm|_adamw"),
    ("attn bwd", r"attn_bwd|flash_bwd|fmha.*bwd|flash.*backward|attention.*backward|dkdv|bwd_dq|convert_dq"),
    ("attn fwd", r"attn_fwd|flash_fwd|fmha|attn_combine|flash"),
    ("head+logprob", r"logprob|log_softmax|logsumexp|_scale_kernel|nll|gather|exp_sub|amax"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|sm90_|sm80_|_matmul_kernel|_matmul_tma|cublas|splitk|\bmm\b|_mm_"),
    ("norm", r"rms_norm|rsqrt|pow_|_pow|mean"),
    ("rope/silu/elementwise", r"rope|silu|sigmoid|elementwise|vectorized|fused_|cat|neg|mul|add"),
    ("copy/fill", r"memcpy|memset|copy|fill|zero"),
]


def category(name: str) -> str:
    n = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, n):
            return cat
    return "other"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile(step, steps: int, device: torch.device) -> dict:
    for _ in range(2):  # and one more in _time: the graphs captured, the compiled step built
        step()
    wall = _time(step, steps, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            step()
        _sync()
    by_cat: dict[str, float] = defaultdict(float)
    kernels = []
    for e in prof.key_averages():
        if re.match(r"Optimizer\.|## ", e.key):  # ranges the profiler annotates, not kernels: counted twice
            continue
        on_cuda = e.device_type == torch.autograd.DeviceType.CUDA
        t_us = (
            e.self_device_time_total
            if on_cuda
            else (e.self_cpu_time_total if not torch.cuda.is_available() else 0)
        )
        if t_us <= 0:
            continue
        ms = t_us / 1e3 / 2
        by_cat[category(e.key)] += ms
        kernels.append((ms, e.count // 2, e.key[:100]))
    kernels.sort(reverse=True)
    return {"wall_ms": wall * 1e3, "busy_ms": sum(by_cat.values()), "by_cat": dict(by_cat), "top": kernels}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--modes", nargs="+", default=["exact", "fast"], choices=["exact", "fast"])
    ap.add_argument("--steps", type=int, default=10, help="timed steps (unprofiled) for the wall time")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (operators' CPU time)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a step (sequences of up to 1,024)")
    args = ap.parse_args()
    cap_host_threads(args.device)  # as `exactrl` caps them on CUDA

    from exactrl.bench import _bench_rollouts, _load
    from exactrl.bench_torch import GrpoBatch, TorchDecoder, TorchGrpoStep, stock_numerics
    from exactrl.train.optim import MasterAdamW
    from exactrl.train.trainer import PolicyTrainer, TrainerSettings

    results: dict[str, dict] = {}
    for i, mode in enumerate(args.modes):
        bargs = SimpleNamespace(
            device=args.device,
            mode=mode,
            preset=args.preset,
            model=None,
            dtype="bfloat16",
            tokens_per_microbatch=args.tokens,
        )
        device, model, tok = _load(bargs)
        rollouts, tokens = _bench_rollouts(bargs, model, tok)
        settings = TrainerSettings(
            max_tokens_per_microbatch=args.tokens,
            exact=True,
            cuda_graphs=args.device == "cuda",
            on_mismatch="warn",
        )
        trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5))
        results[mode] = _profile(functools.partial(trainer.step, rollouts), args.steps, device)
        del trainer
        model.zero_grad(set_to_none=True)
        _free()
        if i == 0:
            batch = GrpoBatch.from_rollouts(rollouts, device)
            with stock_numerics():
                tstep = TorchGrpoStep(TorchDecoder.from_model(model).compile_blocks(), lr=1e-5)
                results["stock"] = _profile(functools.partial(tstep, batch), args.steps, device)
            del tstep
        del model
        _free()

    names = list(results)
    cats = [c for c, _ in CATEGORIES] + ["other"]
    print(f"\n== {args.preset}, {tokens} tokens: GPU ms a step by category")
    print(f"{'category':24}" + "".join(f"{n:>10}" for n in names))
    for c in cats:
        print(f"{c:24}" + "".join(f"{results[n]['by_cat'].get(c, 0.0):10.2f}" for n in names))
    for key in ("busy_ms", "wall_ms"):
        print(f"{key:24}" + "".join(f"{results[n][key]:10.2f}" for n in names))
    print(
        f"{'tok/s (unprofiled)':24}" + "".join(f"{tokens / results[n]['wall_ms'] * 1e3:10.0f}" for n in names)
    )
    for n in names:
        print(f"\n== {n}: top kernels (ms a step, launches a step)")
        for ms, count, key in results[n]["top"][: args.top]:
            print(f"{ms:9.2f} {count:6d}  [{category(key)}] {key}")
    print(
        json.dumps(
            {
                "profile_vs_torch": args.preset,
                **{
                    n: {
                        "wall_ms": round(r["wall_ms"], 2),
                        "busy_ms": round(r["busy_ms"], 2),
                        **{c: round(v, 2) for c, v in r["by_cat"].items()},
                    }
                    for n, r in results.items()
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
