"""`exactrl bench rollout|train|rl`: throughput benchmarks that print a table and one JSON line.

rollout: output tokens/s of `RolloutEngine.generate` (random-init preset, random prompts, no early stop), and on
CUDA the achieved memory bandwidth of decode (weights + KV read per step) next to a copy bandwidth measured in
the same run. `--vs hf` runs transformers `generate` on the same weights and prompts in the same process.

train: tokens/s and MFU of the trainer's step (forward, GRPO loss, backward, AdamW; replayed from CUDA graphs
unless `--graphs off`) against a bf16 matmul rate measured in the same run; `--vs hf` trains the transformers
model on the same weights and data (cross-entropy loss, eager).

rl: whole GRPO steps of the RL loop and the seconds of their stages (exactrl/bench_rl.py).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from exactrl.model.loading import load_policy, resolve_device


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _seconds_per_step(step, steps: int, device) -> float:
    """Mean wall time of step() over `steps` calls, after one warm-up call."""
    step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t) / steps


def measure_copy_bandwidth(device) -> float | None:
    """Bytes read + written per second by a large device-to-device copy."""
    if torch.device(device).type != "cuda":
        return None
    n = 1 << 28  # 256M bf16 = 512 MiB
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    _sync(device)
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        b.copy_(a)
    _sync(device)
    return 2 * a.numel() * 2 * reps / (time.perf_counter() - t)


def measure_matmul_rate(device, dtype=torch.bfloat16) -> float:
    n = 8192 if torch.device(device).type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def _result_path(out_dir: str, bench: str, preset: str, mode: str, device: str) -> Path:
    dev = torch.cuda.get_device_name().replace(" ", "-") if device.startswith("cuda") else "cpu"
    return Path(out_dir) / f"{bench}-{preset}-{mode}-{dev}.json"


def _emit(args, record: dict) -> None:
    name = args.preset if not args.model else Path(args.model).name
    if args.what == "rollout":
        name += f"-c{args.concurrency}"
    elif getattr(args, "graphs", "on") == "off":
        name += "-eager"
    if record.get("bench") == "train-fsdp":
        name += "-fsdp"
    path = _result_path(args.out_dir, args.what, name, args.mode, record["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record) + "\n")
    print(json.dumps(record))
    print(f"result written to {path}", file=sys.stderr)


def _load(args):
    from exactrl.ops import set_exact_environment

    device = resolve_device(args.device)
    set_exact_environment(args.mode == "exact")
    model, tok = load_policy(
        preset_name=None if args.model else args.preset,
        path=args.model,
        device=device,
        dtype=args.dtype,
        exact=args.mode == "exact",
        seed=0,
    )
    return device, model, tok


def bench_rollout(args) -> dict:
    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.runner import kv_bytes_per_token
    from exactrl.engine.sampler import SamplingParams

    device, model, tok = _load(args)
    g = torch.Generator().manual_seed(0)
    C, P, N = args.concurrency, args.prompt_len, args.max_tokens
    prompts = torch.randint(0, min(tok.vocab_size, model.config.vocab_size), (C, P), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=N, seed=0)
    engine = RolloutEngine(
        model,
        EngineConfig(
            block_size=16,
            max_num_seqs=max(C, 1),
            max_num_batched_tokens=max(8192, P),
            prefill_chunk_size=max(8192, P),
            max_model_len=P + N + 16,
            cuda_graphs=True,
            # Sized for the whole run up front, so the warm-up call below builds the cache and captures the
            # CUDA graphs once, outside the timed call.
            num_kv_blocks=C * (-(-(P + N) // 16) + 1) + 16,
        ),
    )
    # Warm-up at the timed call's shapes (all C prompts prefilled, a few decode steps), on other token ids: the
    # Triton kernels are compiled and the graphs captured for every shape the timed call meets, so one-time costs
    # stay out of its prefill time. (The prefix cache lives within one generate call; nothing carries over.)
    vocab = min(tok.vocab_size, model.config.vocab_size)
    warm = [[(t + 1) % vocab for t in p] for p in prompts]
    engine.generate(warm, SamplingParams(temperature=1.0, max_tokens=4, seed=1))
    _sync(device)
    engine.reset_stats()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(device)
    wall = time.perf_counter() - t
    n_out = sum(len(s.token_ids) for o in outs for s in o.samples)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kvpt = kv_bytes_per_token(model)
    # Decode step k (k = 1..N-1) reads all weights and the KV of every running sequence: C * (P + k) tokens.
    decode_bytes = sum(weight_bytes + C * (P + k) * kvpt for k in range(1, N))
    decode_s = engine.stats.get("decode_s", 0.0)
    rec = {
        "bench": "rollout",
        "preset": args.preset,
        "mode": args.mode,
        "device": device,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "dtype": args.dtype,
        "concurrency": C,
        "prompt_len": P,
        "max_tokens": N,
        "output_tokens": n_out,
        "seconds": wall,
        "tokens_per_s": n_out / wall,
        "decode_s": decode_s,
        "prefill_s": engine.stats.get("prefill_s", 0.0),
        "cuda_graphs": bool(engine.stats.get("cuda_graph_steps", 0)),
        "cuda_graph_steps": engine.stats.get("cuda_graph_steps", 0),
        "decode_steps": engine.stats.get("static_decode_steps", 0),
        "ahead_steps": engine.stats.get("ahead_steps", 0),
        "graph_capture_s": engine.runner.capture_seconds if engine.runner is not None else 0.0,
    }
    if decode_s > 0:
        rec["decode_bandwidth_GBps"] = decode_bytes / decode_s / 1e9
    copy_bw = measure_copy_bandwidth(device)
    if copy_bw:
        rec["copy_bandwidth_GBps"] = copy_bw / 1e9
        if decode_s > 0:
            rec["decode_roofline_fraction"] = rec["decode_bandwidth_GBps"] / rec["copy_bandwidth_GBps"]
    if args.vs == "hf":
        rec.update(_hf_generate(model, tok, prompts, N, device))
        rec["speedup_vs_hf"] = rec["tokens_per_s"] / rec["hf_tokens_per_s"]
    return rec


def _to_hf(model, tok):
    import transformers

    from exactrl.model.hf import save_model

    tmp = tempfile.mkdtemp(prefix="exactrl-bench-")
    save_model(model, tmp, tokenizer=tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype).to(model.device)
    return hf


def _hf_generate(model, tok, prompts, max_tokens, device) -> dict:
    hf = _to_hf(model, tok).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=0,
    )
    with torch.no_grad():  # warm-up at the timed call's batch shape, as for exactrl
        hf.generate((ids + 1) % hf.config.vocab_size, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        _sync(device)
        t = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        _sync(device)
    wall = time.perf_counter() - t
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del hf
    return {"hf_tokens_per_s": n / wall, "hf_seconds": wall}


def _bench_rollouts(args, model, tok) -> tuple[list, int]:
    """One microbatch of random sequences (up to 1024 tokens each) as GRPO rollouts, and its token count."""
    from exactrl.train.trainer import Rollout

    T = args.tokens_per_microbatch
    seq_len = min(1024, T)
    n_seq = max(1, T // seq_len)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(
        0, min(tok.vocab_size, model.config.vocab_size), (n_seq, seq_len + 1), generator=g
    ).tolist()
    # One GRPO step of the real trainer over one microbatch: forward, policy loss, backward, clip, AdamW. Both
    # modes take the old logprobs as given (exact mode's rule), so fast and exact do the same work: this
    # measures kernels and the step's machinery, not fast mode's extra scoring pass.
    rollouts = [
        Rollout(s[:1], s[1:], torch.zeros(seq_len), advantage=1.0 if i % 2 else -1.0)
        for i, s in enumerate(seqs)
    ]
    return rollouts, n_seq * seq_len


def bench_train(args) -> dict:
    from exactrl.train.optim import MasterAdamW
    from exactrl.train.trainer import PolicyTrainer, TrainerSettings

    device, model, tok = _load(args)
    T = args.tokens_per_microbatch
    seq_len = min(1024, T)
    n_seq = max(1, T // seq_len)
    rollouts, _ = _bench_rollouts(args, model, tok)
    seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
    # The rollouts are synthetic (no engine logprobs): the exactness check runs at its usual cost, and "warn"
    # keeps its verdict from stopping the benchmark.
    settings = TrainerSettings(
        algorithm="grpo",
        max_tokens_per_microbatch=T,
        exact=True,
        cuda_graphs=args.graphs == "on",
        on_mismatch="warn",
    )
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5))

    def step():
        trainer.step(rollouts)

    wall = _seconds_per_step(step, args.steps, device)
    tokens = n_seq * seq_len
    flops = 3 * model.flops_per_token(context=seq_len // 2) * tokens
    peak = measure_matmul_rate(device)
    rec = {
        "bench": "train",
        "preset": args.preset,
        "mode": args.mode,
        "device": device,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "dtype": args.dtype,
        "tokens_per_step": tokens,
        "seq_len": seq_len,
        "cuda_graphs": trainer.graphs.replays > 0,
        "step_s": wall,
        "tokens_per_s": tokens / wall,
        "achieved_TFLOPs": flops / wall / 1e12,
        "matmul_peak_TFLOPs": peak / 1e12,
        "mfu": flops / wall / peak,
    }
    if args.vs == "hf":
        hf = _to_hf(model, tok).train()
        hopt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
        ids = torch.tensor(seqs, device=device)

        def hstep():
            out = hf(ids[:, :-1], labels=ids[:, 1:].contiguous())
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            hopt.step()
            hopt.zero_grad(set_to_none=True)

        hwall = _seconds_per_step(hstep, args.steps, device)
        rec["hf_tokens_per_s"] = tokens / hwall
        rec["hf_mfu"] = flops / hwall / peak
        rec["speedup_vs_hf"] = rec["tokens_per_s"] / rec["hf_tokens_per_s"]
    return rec


def bench_train_fsdp(args) -> dict:
    """The same training step (`bench_train`'s GRPO step) on today's path and under FSDP2 at world size 1, in
    one process started by torchrun (`exactrl bench train --fsdp` launches it): the cost of the sharded layout
    itself (per-layer all-gather and reduce-scatter hooks, fp32 shards cast to the model dtype in every forward,
    gradients reduced in fp32, the sharded optimizer step). Under FSDP the trainer runs eagerly (its collectives
    are not captured in CUDA graphs); today's path replays graphs unless `--graphs off`: both figures are
    printed. The weight sync into the engine replica is timed on its own."""
    from exactrl.distributed.env import init_from_env, rank_device
    from exactrl.distributed.parallelize import Parallelism
    from exactrl.train.optim import MasterAdamW
    from exactrl.train.trainer import PolicyTrainer, TrainerSettings

    ctx = init_from_env(resolve_device(args.device))
    if ctx.world_size != 1:
        raise ValueError(f"bench train --fsdp measures world size 1; this launch has {ctx.world_size} ranks")
    args.device = rank_device(ctx, resolve_device(args.device))
    base = bench_train(args)  # today's path
    device, model, tok = _load(args)
    rollouts, tokens = _bench_rollouts(args, model, tok)
    par = Parallelism(ctx)
    replica = par.engine_model(model)
    par.parallelize(model)
    par.bind(model, replica)
    settings = TrainerSettings(
        algorithm="grpo",
        max_tokens_per_microbatch=args.tokens_per_microbatch,
        exact=True,
        cuda_graphs=False,
        on_mismatch="warn",  # synthetic rollouts, as in bench_train
    )
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5, dist=ctx), dist=ctx)
    wall = _seconds_per_step(lambda: trainer.step(rollouts), args.steps, device)
    sync = [par.sync_weights() for _ in range(3)]
    rec = {
        **base,
        "bench": "train-fsdp",
        "fsdp_step_s": wall,
        "fsdp_tokens_per_s": tokens / wall,
        "fsdp_over_today": wall / base["step_s"],
        "today_cuda_graphs": base["cuda_graphs"],
        "weight_sync_s": min(x["time/weight_sync_s"] for x in sync),
        "weight_sync_bytes": sync[0]["weight_sync/bytes"],
    }
    print(f"{'path':28} {'step s':>9} {'tok/s':>10}")
    graphs = "CUDA graphs" if base["cuda_graphs"] else "eager"
    print(f"{'today (' + graphs + ')':28} {base['step_s']:9.4f} {base['tokens_per_s']:10.1f}")
    print(f"{'FSDP2, 1 rank (eager)':28} {wall:9.4f} {tokens / wall:10.1f}")
    print(f"{'ratio FSDP / today':28} {rec['fsdp_over_today']:9.3f}")
    print(f"{'weight sync (s, bytes)':28} {rec['weight_sync_s']:9.4f} {rec['weight_sync_bytes']:10.3g}")
    return rec


def main(args) -> int:
    if getattr(args, "max_tokens", None) is None:
        args.max_tokens = 2048 if args.what == "rl" else 256
    if getattr(args, "steps", None) is None:
        args.steps = 3 if args.what == "rl" else 5
    if args.what == "rl":
        from exactrl import bench_rl

        for flag, given in (("--vs", getattr(args, "vs", None)), ("--fsdp", getattr(args, "fsdp", False))):
            if given:
                raise ValueError(f"bench rl does not implement {flag}")
        if getattr(args, "reward", None) is None:
            args.reward = ["numeric_match"]
        return bench_rl.main(args)
    if args.what == "train" and getattr(args, "fsdp", False):
        from exactrl.distributed.env import under_torchrun

        if not under_torchrun():  # the FSDP path needs a process group: run this very command on one rank
            import sys as _sys

            from exactrl.cli import launch_torchrun

            return launch_torchrun(1, _sys.argv[1:])
        rec = bench_train_fsdp(args)
        _emit(args, rec)
        return 0
    rec = bench_rollout(args) if args.what == "rollout" else bench_train(args)
    keys = [k for k in rec if isinstance(rec[k], float)]
    print(f"{'metric':28} value")
    for k in keys:
        print(f"{k:28} {rec[k]:.4g}")
    _emit(args, rec)
    return 0
