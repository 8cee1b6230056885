"""The cost of exact mode's guard when a step makes several updates (minibatches_per_rollout or ppo_epochs > 1).

With one update per step the training forward checks every token at the sampling weights for free. With several,
the trainer first scores every completion token with one no-grad forward (`PolicyTrainer._prescore`). This
script samples real rollouts with the engine (so every check passes), then times, on the same batch:
  step_1mb  one update per step (the free check)
  step_4mb  4 minibatches (prescore + 4 updates)
  prescore  the scoring pass alone
and prints a table and one JSON line: prescore / step_4mb is what full checking costs there.

Usage: PYTHONPATH=. python benchmarks/bench_guard.py --preset qwen3-0.6b --device cuda [--prompts 64 --n 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from _script import cap_host_threads  # benchmarks/: the script's own folder is on sys.path

from exactrl.config import AlgorithmConfig
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.loading import load_policy
from exactrl.ops import set_exact_environment
from exactrl.train.optim import MasterAdamW
from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings


def _time(fn, device: str, reps: int) -> float:
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cap_host_threads(args.device)  # as `exactrl` caps them on CUDA
    set_exact_environment(True)
    model, _ = load_policy(preset_name=args.preset, device=args.device, dtype=args.dtype, exact=True)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    engine = RolloutEngine(model, EngineConfig(max_model_len=args.prompt_len + args.max_tokens + 16))
    outs = engine.generate(
        prompts, SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=1)
    )
    rollouts = [
        Rollout(p, s.token_ids, s.rollout_logprobs, advantage=1.0 if j % 2 else -1.0)
        for p, o in zip(prompts, outs)
        for j, s in enumerate(o.samples)
    ]
    tokens = sum(len(r.completion_ids) for r in rollouts)
    base = TrainerSettings(exact=True, on_mismatch="warn", max_tokens_per_microbatch=8192, grad_clip=1.0)
    # lr 0: the weights stay the sampling weights, so every repetition checks (and passes) on the same batch.
    t1 = PolicyTrainer(model, base, MasterAdamW(model, lr=0.0))
    t4 = PolicyTrainer(
        model,
        dataclasses.replace(base, algorithm=AlgorithmConfig(minibatches_per_rollout=4)),
        MasterAdamW(model, lr=0.0),
    )
    m: dict = {}

    def step(t):
        m.update(t.step(rollouts))

    step_1 = _time(lambda: step(t1), args.device, args.reps)
    step_4 = _time(lambda: step(t4), args.device, args.reps)
    assert m["mismatch/num_tokens"] == tokens and m["mismatch/num_mismatched_tokens"] == 0, m
    b = t4.prepare(rollouts)
    pre = _time(lambda: t4._prescore(b, rollouts), args.device, args.reps)
    row = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "rollouts": len(rollouts),
        "completion_tokens": tokens,
        "step_1mb_s": step_1,
        "step_4mb_s": step_4,
        "prescore_s": pre,
        "prescore_share_of_4mb_step": pre / step_4,
        "compared_tokens": int(m["mismatch/num_tokens"]),
    }
    print(f"{'':12} {'seconds':>9}")
    for k in ("step_1mb_s", "step_4mb_s", "prescore_s"):
        print(f"{k:12} {row[k]:9.3f}")
    print(f"full checking costs {100 * row['prescore_share_of_4mb_step']:.1f}% of a 4-minibatch step")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
