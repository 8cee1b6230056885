"""Where a rollout decode step and a training step spend GPU time: torch.profiler kernel tables.

Builds a model shape (`--preset`, default qwen3-0.6b; random init, bf16) in exact or fast mode and prints, for each of
- rollout: one `generate` call (C concurrent prompts of P tokens, N new tokens) after a warm-up call, and
- train: forward + backward + optimizer step on 8 x 1024 packed tokens,
the kernels with the most total CUDA time, the host time per step, and one JSON line per table.

Usage (GPU): PYTHONPATH=. python benchmarks/profile_steps.py [--mode exact] [--concurrency 256] [--what rollout train]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _script import cap_host_threads  # benchmarks/: the script's own folder is on sys.path
from torch.profiler import ProfilerActivity, profile


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _own_us(e) -> float:
    """An event's own time: GPU time of a kernel; on a CPU (the dry run) an operator's own CPU time."""
    return e.self_device_time_total if torch.cuda.is_available() else e.self_cpu_time_total


def _table(prof, label: str, top: int) -> None:
    kind = torch.autograd.DeviceType.CUDA if torch.cuda.is_available() else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind]
    total = sum(_own_us(e) for e in events) or 1.0
    events.sort(key=_own_us, reverse=True)
    print(
        f"\n== {label}: {'GPU' if kind == torch.autograd.DeviceType.CUDA else 'CPU'} time (total {total / 1e3:.1f} ms)"
    )
    rows = []
    for e in events[:top]:
        share = _own_us(e) / total
        print(f"{_own_us(e) / 1e3:9.2f} ms {share:6.1%} {e.count:7d}x  {e.key[:90]}")
        rows.append({"kernel": e.key[:120], "ms": _own_us(e) / 1e3, "count": e.count})
    print(json.dumps({"profile": label, "total_gpu_ms": total / 1e3, "top": rows}))


def _host_profile(step, top: int) -> None:
    """Wall time of a step with and without cProfile, and the host functions with the most own time: a step
    whose wall time exceeds its GPU time is bound by the host (Python, launches)."""
    import cProfile
    import pstats

    _sync()
    t = time.perf_counter()
    for _ in range(3):
        step()
    _sync()
    print(json.dumps({"train_step_s": (time.perf_counter() - t) / 3}))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2):
        step()
    _sync()
    pr.disable()
    print("\n== host: functions by own time over 2 steps (cProfile)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)
    print("\n== host: functions by cumulative time over 2 steps (cProfile)")
    pstats.Stats(pr).sort_stats("cumulative").print_stats(top)


def _trace(prof, folder: str, name: str) -> None:
    """Export the Chrome trace (gzipped) and print where the GPU sat idle."""
    import gzip
    import os
    import sys

    os.makedirs(folder, exist_ok=True)
    raw = os.path.join(folder, f"{name}.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(raw)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from trace_gaps import analyse, load

    print(f"\n== idle gaps: {name}")
    print(json.dumps({"trace_gaps": name, **analyse(load(raw + ".gz"), top=20, min_us=10.0)}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="exact", choices=["exact", "fast"])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--what", nargs="+", default=["rollout", "train"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--torch-deterministic",
        default="off",
        choices=["off", "on", "on-nofill"],
        help="torch.use_deterministic_algorithms as the RL loop sets it in exact mode (on), and without its "
        "filling of uninitialized memory (on-nofill)",
    )
    ap.add_argument(
        "--host",
        action="store_true",
        help="also profile the host (cProfile, by own time): rollout, 2 train steps",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="write Chrome traces (train: with Python stacks) into this folder and print their idle gaps "
        "(benchmarks/trace_gaps.py)",
    )
    ap.add_argument(
        "--graphs", default="on", choices=["on", "off"], help="train: replay the step from CUDA graphs"
    )
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (with a small preset)")
    ap.add_argument(
        "--train-tokens", type=int, default=8192, help="train: tokens a step, in sequences of 1,024"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model dtype")
    args = ap.parse_args()
    cap_host_threads(args.device)  # as `exactrl` caps them on CUDA

    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.sampler import SamplingParams
    from exactrl.model import build_model, preset
    from exactrl.ops import set_exact_environment

    exact = args.mode == "exact"
    set_exact_environment(exact)
    if args.torch_deterministic != "off":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = args.torch_deterministic == "on"
    dtype = getattr(torch, args.dtype)
    model = build_model(preset(args.preset), device=args.device, dtype=dtype, exact=exact, seed=0)
    vocab = model.config.vocab_size
    C, P, N = args.concurrency, args.prompt_len, args.max_tokens
    g = torch.Generator().manual_seed(0)
    if "rollout" in args.what:
        prompts = torch.randint(0, vocab, (C, P), generator=g).tolist()
        eng = RolloutEngine(
            model,
            EngineConfig(
                max_num_seqs=C,
                max_num_batched_tokens=max(8192, P),
                prefill_chunk_size=max(8192, P),
                max_model_len=P + N + 16,
                num_kv_blocks=C * (-(-(P + N) // 16) + 1) + 16,
            ),
        )
        params = SamplingParams(temperature=1.0, max_tokens=N, seed=0)
        eng.generate(prompts, params)  # warm-up: compile, capture graphs
        _sync()
        eng.reset_stats()
        t = time.perf_counter()
        with profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        ) as prof:
            eng.generate(prompts, params)
            _sync()
        wall = time.perf_counter() - t
        st = eng.stats
        print(json.dumps({"rollout_wall_s": wall, **{k: v for k, v in st.items()}}))
        _table(prof, f"rollout {args.preset} {args.mode} C={C} P={P} N={N} ({st['steps']} steps)", args.top)
        if args.trace:
            _trace(prof, args.trace, f"rollout-{args.preset}-{args.mode}-c{C}")
        if args.host:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            eng.generate(prompts, params)
            _sync()
            pr.disable()
            print(f"\n== host: rollout generate ({N} new tokens), functions by own time (cProfile)")
            pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)
    if "train" in args.what:
        from exactrl.train.optim import MasterAdamW
        from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings

        length = min(1024, args.train_tokens)
        seqs = torch.randint(
            0, vocab, (max(1, args.train_tokens // length), length + 1), generator=g
        ).tolist()
        rollouts = [
            Rollout(s[:1], s[1:], torch.zeros(length), advantage=1.0 - 2 * (i % 2))
            for i, s in enumerate(seqs)
        ]
        # Synthetic rollouts (no engine logprobs): the check runs at its cost, "warn" keeps it from stopping us.
        settings = TrainerSettings(
            max_tokens_per_microbatch=max(8192, args.train_tokens),
            exact=True,
            cuda_graphs=args.graphs == "on" and args.device == "cuda",
            on_mismatch="warn",
        )
        trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5))

        def step():
            trainer.step(rollouts)

        for _ in range(2):
            step()
        _sync()
        t = time.perf_counter()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts, with_stack=bool(args.trace)) as prof:
            for _ in range(2):
                step()
            _sync()
        print(json.dumps({"train_step_s_profiled": (time.perf_counter() - t) / 2}))
        _table(
            prof,
            f"train {args.preset} {args.mode} {len(seqs)}x{length} graphs {args.graphs} (2 steps)",
            args.top,
        )
        if args.trace:
            _trace(prof, args.trace, f"train-{args.preset}-{args.mode}-graphs-{args.graphs}")
        if args.host:
            _host_profile(step, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
