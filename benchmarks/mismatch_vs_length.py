"""Fast-mode rollout/trainer mismatch against completion length (exact mode alongside, which stays at 0).

A random-init model samples `--prompts` prompts x `--samples` completions of exactly N tokens (no stop token)
with the rollout engine, the trainer's path scores them, and per N it prints the share of tokens whose two
logprobs differ, the max and mean |difference|, and the k3 KL estimate, for the fast kernels (PyTorch defaults)
and the exact ones. Prints a table and one JSON line per (mode, N).
Usage: PYTHONPATH=. python benchmarks/mismatch_vs_length.py [--preset tiny] [--lengths 16 64 256]
"""

from __future__ import annotations

import argparse
import json

import torch

from exactrl.algorithms import mismatch_metrics
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset
from exactrl.parity import random_prompts
from exactrl.train.packing import completion_logprobs


def measure(exact: bool, n_tokens: int, args) -> dict:
    model = build_model(preset(args.preset), dtype=getattr(torch, args.dtype), exact=exact, seed=0)
    prompts = random_prompts(args.prompts, 256, seed=1, min_len=8, max_len=32)
    params = SamplingParams(temperature=1.0, max_tokens=n_tokens, n=args.samples, seed=0)
    engine = RolloutEngine(model, EngineConfig(max_model_len=32 + n_tokens + 16))
    outs = engine.generate(prompts, params)
    seqs, plens, rec = [], [], []
    for p, o in zip(prompts, outs):
        for s in o.samples:
            seqs.append(p + s.token_ids)
            plens.append(len(p))
            rec.append(s.rollout_logprobs.float())
    lps = completion_logprobs(model, seqs, plens, 1.0, 8192)
    width = max(len(x) for x in rec)
    pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])  # noqa: E731
    mask = torch.stack([torch.arange(width) < len(x) for x in rec]).float()
    m = {k: float(v) for k, v in mismatch_metrics(pad(rec), pad(lps), mask).items()}
    return {
        "mode": "exact" if exact else "fast",
        "completion_tokens": n_tokens,
        "tokens": int(m["mismatch/num_tokens"]),
        "mismatched": int(m["mismatch/num_mismatched_tokens"]),
        "abs_diff_max": m["mismatch/logprob_abs_diff_max"],
        "abs_diff_mean": m["mismatch/logprob_abs_diff_mean"],
        "kl_k3": m["mismatch/kl_k3"],
        "preset": args.preset,
        "dtype": args.dtype,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    args = ap.parse_args()
    rows = [measure(exact, n, args) for n in args.lengths for exact in (False, True)]
    print(
        f"{'mode':6} {'tokens/seq':>10} {'tokens':>7} {'differ':>7} {'share':>6} {'max|d|':>9} {'mean|d|':>9} {'KL k3':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:6} {r['completion_tokens']:10d} {r['tokens']:7d} {r['mismatched']:7d} "
            f"{r['mismatched'] / max(r['tokens'], 1):6.1%} {r['abs_diff_max']:9.2e} {r['abs_diff_mean']:9.2e} "
            f"{r['kl_k3']:9.2e}"
        )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
