"""exactrl's training step (exact and fast modes) against a compiled stock-PyTorch step and transformers' step,
timed in alternation and repeated in one process, so that the ratios between them do not ride on one run.

The shape of `exactrl bench train --vs torch`: one preset (random init, bf16), one microbatch of 8 x 1,024 tokens,
one optimizer step a step. The four steps:

- exact: exactrl's trainer in exact mode (batch-invariant kernels, CUDA graphs, the exactness check);
- fast: exactrl's trainer in fast mode (cuBLAS, FlashAttention-2, the same fused kernels elsewhere);
- stock: exactrl/bench_torch.py (nn.Linear, SDPA flash, torch.compile per block and for head + loss, fp32
  masters + fused AdamW): the step a skilled PyTorch user would write;
- hf: transformers' AutoModelForCausalLM from the same weights (its default SDPA attention, its own loss over
  the same tokens), torch.optim.AdamW on its bf16 parameters and clip_grad_norm_ at 1.0, as a plain user would
  run it (no compile).

Each repeat runs every step in turn: build it (exactrl's trainers capture their graphs; the stock step compiles
on the first repeat and reuses dynamo's cache later), one warm-up step, `--steps` timed steps, then free it. A
repeat's rate is its tokens over the median of its steps' times (CUDA events between back-to-back steps; `--stat
mean`: over their mean, which is the whole run's time over its steps, the rule before). On an H100 (2026-11-26) the
exact qwen3-1.7b step ran 193-207 ms with occasional, mostly paired, 215-236 ms steps (0-8 of every 30; Python's
garbage collector did not run, and they came with it disabled too); the median is the steady rate. exact runs
with exact mode's numerics switches, the others with PyTorch's defaults (`stock_numerics`). Reported: per step
kind the median over the repeats of their rates, with the smallest and largest, MFU (forward+backward FLOPs at
half the sequence as attention context, over the measured bf16 matmul rate), and each kind's ratio to the stock
step's median. One JSON line at the end.

Usage (GPU): PYTHONPATH=. python benchmarks/train_vs_torch.py --preset qwen3-1.7b [--repeats 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
from _script import busy_cores  # benchmarks/: the script's own folder is on sys.path

STEPS = ("exact", "fast", "stock", "hf")


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time(step: Callable[[], object], steps: int, device: torch.device, stat: str = "median") -> float:
    """Seconds a step: the median (or mean) of `steps` back-to-back steps' times after one warm-up step
    (`exactrl.bench.back_to_back_step_times`: CUDA events between steps, one synchronization at the end)."""
    from exactrl.bench import back_to_back_step_times

    times = back_to_back_step_times(step, steps, device)
    return statistics.median(times) if stat == "median" else statistics.fmean(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per step kind and repeat")
    ap.add_argument("--which", nargs="+", default=list(STEPS), choices=STEPS)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on a small preset")
    ap.add_argument("--stat", choices=("median", "mean"), default="median", help="a repeat's step time")
    ap.add_argument(
        "--busy-cores", type=int, default=0, help="spinning processes beside the run (a shared host)"
    )
    args = ap.parse_args()

    from exactrl.bench import _bench_rollouts, _to_hf, measure_matmul_rate, source_commit, source_hash
    from exactrl.bench_torch import GrpoBatch, TorchDecoder, TorchGrpoStep, stock_numerics
    from exactrl.distributed.env import limit_host_threads
    from exactrl.model.loading import load_policy
    from exactrl.ops import set_exact_environment
    from exactrl.train.optim import MasterAdamW
    from exactrl.train.trainer import PolicyTrainer, TrainerSettings

    device = torch.device(args.device)
    set_exact_environment(True)  # exact's switches; the other steps run inside stock_numerics()
    host_threads = limit_host_threads(
        device
    )  # as every exactrl command on CUDA (each step kind runs under it)
    busy_cores(args.busy_cores)
    models = {}
    for mode in ("exact", "fast"):
        if mode in args.which or (mode == "exact" and {"stock", "hf"} & set(args.which)):
            models[mode], tok = load_policy(
                preset_name=args.preset,
                path=None,
                device=args.device,
                dtype="bfloat16",
                exact=mode == "exact",
                seed=0,
            )
    base = models.get("exact") or models["fast"]
    rollouts, tokens = _bench_rollouts(SimpleNamespace(tokens_per_microbatch=args.tokens), base, tok)
    seq_len = len(rollouts[0].completion_ids)
    batch = GrpoBatch.from_rollouts(rollouts, device)
    ids = torch.tensor([r.prompt_ids + r.completion_ids for r in rollouts], device=device)
    hf = _to_hf(base, tok).train() if "hf" in args.which else None
    flops = 3 * base.flops_per_token(context=seq_len // 2) * tokens
    peak = measure_matmul_rate(device)

    def build(kind: str) -> tuple[Callable[[], object], Callable[[], None]]:
        """(one step, what frees it) for a step kind."""
        if kind in ("exact", "fast"):
            model = models[kind]
            settings = TrainerSettings(max_tokens_per_microbatch=args.tokens, exact=True, on_mismatch="warn")
            trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5))

            def free() -> None:
                nonlocal trainer
                trainer = None
                model.zero_grad(set_to_none=True)

            return (lambda: trainer.step(rollouts)), free
        if kind == "stock":
            tstep = TorchGrpoStep(TorchDecoder.from_model(base).compile_blocks(), lr=1e-5)

            def free_stock() -> None:
                nonlocal tstep
                tstep = None

            return (lambda: tstep(batch)), free_stock
        assert hf is not None
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)

        def hstep() -> None:
            out = hf(ids, labels=ids)  # transformers shifts the labels itself
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def free_hf() -> None:
            nonlocal opt
            opt = None
            hf.zero_grad(set_to_none=True)

        return hstep, free_hf

    rates: dict[str, list[float]] = {k: [] for k in args.which}
    for r in range(args.repeats):
        for kind in args.which:
            ctx = stock_numerics() if kind != "exact" else contextlib.nullcontext()
            with ctx:
                step, free = build(kind)
                rates[kind].append(tokens / _time(step, args.steps, device, args.stat))
                free()
                del step
            _free()
            print(f"repeat {r}: {kind:6} {rates[kind][-1]:10.0f} tok/s", flush=True)

    med = {k: statistics.median(v) for k, v in rates.items()}
    ref = med.get("stock")
    print(
        f"\n{args.preset}, {tokens} tokens a step, {args.repeats} repeats of {args.steps} steps ({args.stat}), alternating"
    )
    print(f"{'step':8} {'tok/s median':>13} {'min':>9} {'max':>9} {'MFU':>6} {'/ stock':>8}")
    for k, v in rates.items():
        ratio = f"{med[k] / ref:8.3f}" if ref else f"{'':8}"
        mfu = flops * med[k] / tokens / peak
        print(f"{k:8} {med[k]:13.0f} {min(v):9.0f} {max(v):9.0f} {mfu:6.3f} {ratio}")
    rec = {
        "bench": "train-vs-torch",
        "commit": source_commit(),
        "source": source_hash(),
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "tokens_per_step": tokens,
        "repeats": args.repeats,
        "steps": args.steps,
        "step_stat": args.stat,
        "host_threads": host_threads,
        "busy_cores": args.busy_cores,
        "matmul_peak_TFLOPs": peak / 1e12,
        **{f"{k}_tokens_per_s": round(med[k], 1) for k in rates},
        **{f"{k}_runs": [round(x, 1) for x in v] for k, v in rates.items()},
        **{f"{k}_mfu": round(flops * med[k] / tokens / peak, 4) for k in rates},
        **({f"{k}_over_stock": round(med[k] / ref, 4) for k in rates if k != "stock"} if ref else {}),
    }
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
