"""Decode speed of a rollout engine split over ranks (engine.tensor_parallel = T, the bit-keeping form: o_proj and
down_proj gather their input and output), against the same split with Megatron's row-parallel o_proj / down_proj
(one all-reduce of partial sums: not bit-exact, `RowParallelLinear`) in the same process, and against T = 1 (run
it once without torchrun). Each form: a warm-up call at the timed shapes (compiles, captures the decode graphs),
then one timed `generate` of C random prompts of --prompt-len tokens, --max-tokens each; decode tokens/s from the
engine's own decode time. Rank 0 prints a table and one JSON line per form and concurrency (`"bench":
"decode_split"`); with several ranks the forms' tokens are compared too (the gathered form's are the T = 1
engine's; the all-reduce form's usually are not).

    python benchmarks/decode_split.py --preset qwen3-8b                                  # T = 1
    torchrun --standalone --nproc-per-node 2 benchmarks/decode_split.py --preset qwen3-8b  # T = 2
    torchrun --standalone --nproc-per-node 2 benchmarks/decode_split.py --preset tiny --device cpu \\
        --dtype float32 --concurrency 2 --max-tokens 4                                   # the dry run
"""

from __future__ import annotations

import json
import os
import sys
import time

from _script import cap_host_threads, parser


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--expert-parallel", action="store_true", help="split a MoE model's experts too (E = T)")
    ap.add_argument(
        "--forms",
        nargs="+",
        default=["gathered", "all-reduce"],
        choices=("gathered", "all-reduce"),
        help="with several ranks: the split forms to time (the all-reduce form holds a second copy while it is made)",
    )
    args = ap.parse_args()
    cap_host_threads(args.device)  # as `exactrl` caps them on CUDA

    import torch
    import torch.distributed as dist

    from exactrl.distributed.env import leave_process_group
    from exactrl.distributed.expert_parallel import shard_experts
    from exactrl.distributed.tensor_parallel import (
        row_parallel_reference,
        shard_engine_model,
        tensor_parallel_groups,
    )
    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.sampler import SamplingParams
    from exactrl.model.loading import load_policy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    full, tok = load_policy(preset_name=args.preset, device=device, dtype=args.dtype, init_draws="keyed")
    full.requires_grad_(False)
    forms: dict[str, torch.nn.Module] = {}
    if world == 1:
        forms["one device"] = full
    else:
        tp = tensor_parallel_groups(rank, world, world)
        if "all-reduce" in args.forms:  # from a copy of the whole model (its o_proj / down_proj K-sliced)
            forms["all-reduce (row-parallel)"] = row_parallel_reference(full, tp)
        if "gathered" in args.forms:  # the whole model split in place
            forms["gathered (exact)"] = shard_engine_model(full, tp)
        if args.expert_parallel:
            for k in list(forms):
                forms[k] = shard_experts(forms[k], tp)
        del full
    if args.device == "cuda":
        torch.cuda.empty_cache()
    vocab = min(tok.vocab_size, next(iter(forms.values())).config.vocab_size)
    P, N = args.prompt_len, args.max_tokens
    rows, tokens = [], {}
    for C in args.concurrency:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab, (C, P), generator=g).tolist()
        warm = [[(t + 1) % vocab for t in p] for p in prompts]
        for name, model in forms.items():
            engine = RolloutEngine(
                model,
                EngineConfig(
                    block_size=16,
                    max_num_seqs=C,
                    max_num_batched_tokens=max(8192, P),
                    prefill_chunk_size=max(8192, P),
                    max_model_len=P + N + 16,
                    num_kv_blocks=C * (-(-(P + N) // 16) + 1) + 16,
                ),
            )
            engine.generate(warm, SamplingParams(temperature=1.0, max_tokens=4, seed=1))
            sync()
            engine.reset_stats()
            t0 = time.perf_counter()
            outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=N, seed=0))
            sync()
            wall = time.perf_counter() - t0
            out_tokens = [s.token_ids for o in outs for s in o.samples]
            n = sum(len(t) for t in out_tokens)
            decode_s = float(engine.stats.get("decode_s", 0.0))
            rec = {
                "bench": "decode_split",
                "preset": args.preset,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "dtype": args.dtype,
                "tensor_parallel": world,
                "expert_parallel": world if args.expert_parallel else 1,
                "form": name,
                "concurrency": C,
                "prompt_len": P,
                "max_tokens": N,
                "output_tokens": n,
                "seconds": round(wall, 4),
                "decode_s": round(decode_s, 4),
                "decode_tokens_per_s": round((n - C) / decode_s, 2) if decode_s > 0 else None,
                "cuda_graph_steps": int(engine.stats.get("cuda_graph_steps", 0)),
            }
            tokens[(C, name)] = out_tokens
            rows.append(rec)
            if engine.runner is not None:  # graphs holding NCCL collectives go before the group does
                engine.runner.release_graphs()
            del engine
    if rank == 0:
        for rec in rows:
            C = rec["concurrency"]
            same = [t for (c, k), t in tokens.items() if c == C and k.startswith("gathered")]
            if world > 1 and same:
                rec["tokens_equal_gathered"] = tokens[(C, rec["form"])] == same[0]
            print(
                f"C={C:<4} {rec['form']:28} decode {rec['decode_tokens_per_s'] or 0:10.1f} tok/s  "
                f"({rec['output_tokens']} tokens, {rec['decode_s']:.3f} s decode)",
                file=sys.stderr,
            )
            print(json.dumps(rec))
    if world > 1:
        dist.barrier()
        leave_process_group()  # with the pause that keeps gloo's threads from aborting a finished rank


if __name__ == "__main__":
    main()
