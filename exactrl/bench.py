"""`exactrl bench rollout|train|rl`: throughput benchmarks that print a table and one JSON line.

rollout: output tokens/s of `RolloutEngine.generate` (random-init preset, random prompts, no early stop), and on
CUDA the achieved memory bandwidth of decode (weights + KV read per step) next to a copy bandwidth measured in
the same run. `--vs hf` runs transformers `generate` on the same weights and prompts in the same process.

train: tokens/s and MFU of the trainer's step (forward, GRPO loss, backward, AdamW; replayed from CUDA graphs
unless `--graphs off`) against a bf16 matmul rate measured in the same run; `--vs hf` trains the transformers
model on the same weights and data (cross-entropy loss, eager); `--vs torch` a compiled stock-PyTorch step of the
same shape and loss (exactrl/bench_torch.py).

rl: whole GRPO steps of the RL loop and the seconds of their stages (exactrl/bench_rl.py).

Several ranks (`--nproc N`, torchrun; NCCL on CUDA, gloo on the CPU): `bench rollout` splits the `--concurrency`
requests over the ranks, one engine each (data-parallel rollout, as the RL loop does: the global batch is fixed);
`bench train --fsdp` trains `--tokens-per-microbatch` tokens of its own on every rank (the global batch grows
with the ranks, as the RL loop's per-rank microbatches do). Both report every rank's figures and peak memory,
the aggregate tokens/s, and with `--baseline` (the JSON of a run at another world size) the scaling efficiency.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from exactrl.bench_records import (
    baseline_of,
    read_baseline,
    record_head,
    result_path,
    source_commit,
    source_hash,
)
from exactrl.model.loading import load_policy, resolve_device

__all__ = [
    "baseline_of",
    "read_baseline",
    "record_head",
    "result_path",
    "source_commit",
    "source_hash",
]  # kept importable from here


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def back_to_back_step_times(step, steps: int, device) -> list[float]:
    """Seconds of each of `steps` calls of step() run back to back after one warm-up call. On CUDA, events recorded
    between consecutive calls time each from the stream, with one synchronization at the end: a step that never
    waits for the GPU still overlaps its host work with the step before, and the times sum to the whole run's
    (their mean is `_seconds_per_step`'s figure). Elsewhere each call is timed on the host clock."""
    step()
    _sync(device)
    if torch.device(device).type == "cuda":
        with torch.cuda.device(torch.device(device)):  # the events on the stream of the step's device
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            marks[0].record()
            for i in range(steps):
                step()
                marks[i + 1].record()
            torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _seconds_per_step(step, steps: int, device) -> float:
    """Mean wall time of step() over `steps` calls, after one warm-up call."""
    step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t) / steps


def _step_times(step, steps: int, device) -> list[float]:
    """Wall time of each of `steps` calls of step(), after one warm-up call."""
    step()
    _sync(device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return times


def peak_memory_gb(device) -> tuple[float, str]:
    """This process's peak memory in GB and what was measured: on CUDA the peak of the tensors allocated on its
    GPU since the last `torch.cuda.reset_peak_memory_stats`; on the CPU the process's peak resident set (over
    its whole life: the kernel keeps no resettable peak)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "cuda_max_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "host_max_rss"  # Linux: KiB


def _reset_peak_memory(device) -> None:
    """Free what an earlier measurement left (CUDA graphs' pools hang on reference cycles) and restart the
    CUDA peak, so that the next figure is this measurement's own."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _scaling(rec: dict, baseline: dict | None) -> dict:
    """Scaling efficiency: aggregate tokens/s per rank here over the same in the baseline (1.0 = linear)."""
    if baseline is None:
        return {}
    per_rank = rec["aggregate_tokens_per_s"] / rec["world_size"]
    base = baseline["aggregate_tokens_per_s"] / baseline["world_size"]
    return {
        "baseline_world_size": baseline["world_size"],
        "baseline_aggregate_tokens_per_s": baseline["aggregate_tokens_per_s"],
        "speedup_vs_baseline": rec["aggregate_tokens_per_s"] / baseline["aggregate_tokens_per_s"],
        "scaling_efficiency": per_rank / base,
    }


def _print_ranks(rec: dict) -> None:
    """The per-rank figures as a table (rank 0 prints; the record holds them under `per_rank`)."""
    cols = [
        k
        for k in ("tokens_per_s", "step_s_median", "seconds", "mfu", "peak_memory_gb")
        if k in rec["per_rank"][0]
    ]
    print(f"{'rank':>4} " + " ".join(f"{c:>15}" for c in cols))
    for r in rec["per_rank"]:
        print(f"{r['rank']:>4} " + " ".join(f"{r[c]:15.4g}" for c in cols))
    line = f"world size {rec['world_size']}: aggregate {rec['aggregate_tokens_per_s']:.1f} tok/s"
    if "scaling_efficiency" in rec:
        line += (
            f", {rec['speedup_vs_baseline']:.3f}x world size {rec['baseline_world_size']}, scaling efficiency "
            f"{rec['scaling_efficiency']:.3f}"
        )
    print(line)
    print(
        f"peak memory per rank (GB, {rec['peak_memory_kind']}): {[round(x, 3) for x in rec['peak_memory_gb']]}"
    )


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


def decode_weight_bytes(model, tokens: int) -> float:
    """Weight bytes one decode step of `tokens` sequences reads. Dense: every weight. An MoE's routed experts:
    only those hit, E * (1 - (1 - k/E)^tokens) per sparse layer in expectation when the router spreads tokens
    evenly (as a random-init router does), so the memory roofline is not overstated by the experts no token
    reads."""
    from exactrl.model.moe import Experts

    total = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    cfg = model.config
    for m in model.modules():
        if isinstance(m, Experts):
            e, k = m.num_experts, cfg.num_experts_per_tok
            hit = e * (1.0 - (1.0 - k / e) ** tokens)
            stacked = sum(p.numel() * p.element_size() for p in (m.gate_up, m.down))
            total -= stacked * (1.0 - hit / e)
    return total


def _emit(args, record: dict) -> None:
    name = args.preset if not args.model else Path(args.model).name
    if args.what == "rollout":
        name += f"-c{args.concurrency}"
    elif getattr(args, "graphs", "on") == "off":
        name += "-eager"
    if record.get("bench") == "train-fsdp":
        name += "-fsdp"
    if record.get("world_size", 1) > 1:
        name += f"-ws{record['world_size']}"
    if getattr(args, "precision", "dtype") != "dtype":
        name += f"-{args.precision}"
    path = result_path(args.out_dir, args.what, name, args.mode, record["device"])
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
        precision=getattr(args, "precision", "dtype"),
    )
    return device, model, tok


def bench_rollout(args) -> dict:
    """Under torchrun every rank runs an engine of its own on its share of the `--concurrency` requests (the
    global batch is fixed, as in the RL loop); the aggregate is all ranks' tokens over the slowest rank's wall
    time. Without torchrun: world size 1, the same record."""
    from exactrl.distributed.env import init_from_env, rank_device

    ctx = init_from_env(resolve_device(args.device))
    if ctx.world_size > 1 and args.vs:
        raise ValueError(f"bench rollout --vs {args.vs} runs at world size 1; drop --vs or --nproc")
    check_ranks(args, ctx.world_size)
    baseline = baseline_of(args)
    args.device = rank_device(ctx, resolve_device(args.device))
    _reset_peak_memory(args.device)
    rec = _rollout_on_rank(args, ctx)
    # Each rank's own figures (its requests, tokens, wall time, engine timings, memory), gathered to every rank.
    run_keys = ("bench", "preset", "mode", "gpu", "dtype", "prompt_len", "max_tokens", "peak_memory_kind")
    ranks = ctx.all_gather_object({"rank": ctx.rank, **{k: v for k, v in rec.items() if k not in run_keys}})
    total = sum(r["output_tokens"] for r in ranks)
    wall = max(r["seconds"] for r in ranks)
    if ctx.world_size > 1:
        # The record speaks for the whole run; each engine's own figures (prefill and decode time, bandwidth,
        # graph steps) are under per_rank.
        rec = {k: rec[k] for k in run_keys} | {
            "device": rec["device"],
            "concurrency": args.concurrency,
            "concurrency_per_rank": [r["concurrency"] for r in ranks],
            "output_tokens": total,
            "seconds": wall,
            "tokens_per_s": total / wall,
            "tokens_per_s_per_rank": [r["tokens_per_s"] for r in ranks],
            "cuda_graphs": all(r["cuda_graphs"] for r in ranks),
        }
    rec.update(
        world_size=ctx.world_size,
        aggregate_tokens_per_s=total / wall,
        peak_memory_gb=[r["peak_memory_gb"] for r in ranks],
        per_rank=ranks,
    )
    rec.update(_scaling(rec, baseline))
    return rec


def _rollout_on_rank(args, ctx, loaded: tuple | None = None) -> dict:
    """This rank's share of the benchmark's requests through an engine of its own; its record. loaded: (device,
    model, tokenizer) already built (benchmarks/fp8_decode.py alternates precisions on one model), else `_load`."""
    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.runner import kv_bytes_per_token
    from exactrl.engine.sampler import SamplingParams

    device, model, tok = loaded or _load(args)
    g = torch.Generator().manual_seed(0)
    P, N = args.prompt_len, args.max_tokens
    every = torch.randint(0, min(tok.vocab_size, model.config.vocab_size), (args.concurrency, P), generator=g)
    # The same global requests on every rank; each takes its contiguous share, and the global request ids key
    # the sampling noise (as in the RL loop), so no two ranks sample alike.
    request_ids = list(ctx.shard(args.concurrency))
    prompts = every[request_ids].tolist()
    C = len(prompts)
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
    engine.generate(warm, SamplingParams(temperature=1.0, max_tokens=4, seed=1), request_ids=request_ids)
    _sync(device)
    engine.reset_stats()
    ctx.barrier()  # the ranks start the timed call together: the aggregate divides by the slowest rank's wall
    t = time.perf_counter()
    outs = engine.generate(prompts, params, request_ids=request_ids)
    _sync(device)
    wall = time.perf_counter() - t
    peak_gb, peak_kind = peak_memory_gb(device)  # weights, KV cache, graphs: before the bandwidth probe below
    n_out = sum(len(s.token_ids) for o in outs for s in o.samples)
    weight_bytes = decode_weight_bytes(model, C)
    kvpt = kv_bytes_per_token(model)
    # Decode step k (k = 1..N-1) reads the weights (of an MoE, the experts its C tokens hit) and the KV of every
    # running sequence: C * (P + k) tokens.
    decode_bytes = sum(weight_bytes + C * (P + k) * kvpt for k in range(1, N))
    decode_s = engine.stats.get("decode_s", 0.0)
    rec = {
        **record_head("rollout", args, device),
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
        "peak_memory_gb": peak_gb,
        "peak_memory_kind": peak_kind,
    }
    if decode_s > 0 and getattr(args, "precision", "dtype") == "dtype":
        # (fp8: decode_weight_bytes counts the model dtype's bytes, not the fp8 copy's, so no bandwidth figure)
        rec["decode_bandwidth_GBps"] = decode_bytes / decode_s / 1e9
    copy_bw = measure_copy_bandwidth(device)
    if copy_bw and "decode_bandwidth_GBps" in rec:
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


def _bench_rollouts(args, model, tok, seed: int = 0) -> tuple[list, int]:
    """One microbatch of random sequences (up to 1024 tokens each) as GRPO rollouts, and its token count; `seed`
    draws the tokens (each rank trains on tokens of its own)."""
    from exactrl.train.trainer import Rollout

    T = args.tokens_per_microbatch
    seq_len = min(1024, T)
    n_seq = max(1, T // seq_len)
    g = torch.Generator().manual_seed(seed)
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
    if args.vs == "torch" and model.config.is_moe:
        raise ValueError(
            f"bench train --vs torch covers dense models; {args.model or args.preset} is a mixture of experts"
        )
    T = args.tokens_per_microbatch
    seq_len = min(1024, T)
    n_seq = max(1, T // seq_len)
    rollouts, _ = _bench_rollouts(args, model, tok)
    seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
    # The rollouts are synthetic (no engine logprobs): the exactness check runs at its usual cost, and "warn"
    # keeps its verdict from stopping the benchmark.
    settings = TrainerSettings(
        max_tokens_per_microbatch=T,
        exact=True,
        cuda_graphs=args.graphs == "on",
        on_mismatch="warn",
    )
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5))

    def step():
        trainer.step(rollouts)

    times = back_to_back_step_times(step, args.steps, device)
    wall = statistics.fmean(times)
    tokens = n_seq * seq_len
    flops = 3 * model.flops_per_token(context=seq_len // 2) * tokens
    peak = measure_matmul_rate(device)
    rec = {
        **record_head("train", args, device),
        "tokens_per_step": tokens,
        "seq_len": seq_len,
        "cuda_graphs": trainer.graphs.replays > 0,
        "step_s": wall,
        "tokens_per_s": tokens / wall,
        # The steady rate: a few slow steps (10-20% on an H100, 0-8 in 30) move the mean (docs/benchmarks.md).
        "step_s_median": statistics.median(times),
        "tokens_per_s_median": tokens / statistics.median(times),
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
    if args.vs == "torch":
        del trainer, step  # exactrl's optimizer state and graph pools: the baseline's step gets the memory
        model.zero_grad(set_to_none=True)  # and the trainer's persistent gradient buffers
        _reset_peak_memory(device)
        rec.update(_vs_torch(model, rollouts, args.steps, device, flops, peak))
        rec["over_torch"] = rec["tokens_per_s"] / rec["torch_tokens_per_s"]
        print(f"{'step':28} {'tokens/s':>10} {'MFU':>7}")
        print(f"{'exactrl (' + args.mode + ')':28} {rec['tokens_per_s']:10.1f} {rec['mfu']:7.3f}")
        print(f"{'torch (compiled, stock)':28} {rec['torch_tokens_per_s']:10.1f} {rec['torch_mfu']:7.3f}")
    return rec


def _vs_torch(model, rollouts, steps: int, device, flops: float, peak: float) -> dict:
    """The stock-PyTorch step (`exactrl.bench_torch`) on a copy of `model`'s weights and the same sequences."""
    from exactrl.bench_torch import (
        GrpoBatch,
        TorchDecoder,
        TorchGrpoStep,
        compiled_graph_count,
        stock_numerics,
    )

    batch = GrpoBatch.from_rollouts(rollouts, device)
    tokens = int(batch.loss_mask.numel())
    with stock_numerics():
        tstep = TorchGrpoStep(TorchDecoder.from_model(model).compile_blocks(), lr=1e-5)
        graphs = compiled_graph_count()
        t = time.perf_counter()
        tstep(batch)  # the first call compiles (dynamo + inductor, forward and backward)
        _sync(device)
        compile_s = time.perf_counter() - t
        wall = _seconds_per_step(lambda: tstep(batch), steps, device)
    return {
        "torch_step_s": wall,
        "torch_tokens_per_s": tokens / wall,
        "torch_mfu": flops / wall / peak,
        "torch_compile_s": compile_s,
        "torch_compiled_graphs": compiled_graph_count() - graphs,
    }


def _profile_step(step, device, show: bool, top: int = 18) -> None:
    """One more step under torch.profiler: the operators by device time and by host time of their own, and how
    much of the step's wall time the device was busy (printed; the timed steps are not profiled)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        _sync(device)
    wall = time.perf_counter() - t
    if not show:
        return
    ka = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ka) / 1e6
    print(f"profiled step: {wall * 1e3:.1f} ms wall (profiler on), device busy {busy * 1e3:.1f} ms")
    for key in ("self_device_time_total", "self_cpu_time_total"):
        print(ka.table(sort_by=key, row_limit=top, max_name_column_width=60))


def bench_train_fsdp(args) -> dict:
    """The trainer's GRPO step (`bench_train`'s) under FSDP2 on every rank of a torchrun launch (`exactrl bench
    train --fsdp [--nproc N]` launches it). Each rank trains `--tokens-per-microbatch` tokens of its own, so the
    global batch is N times that (weak scaling: the RL loop at a fixed global batch gives each rank fewer
    microbatches of the same size, which this matches step for step). Reported: the step time (median over the
    timed steps of the slowest rank's time), the aggregate tokens/s (global tokens over that), every rank's
    tokens/s, MFU (against its own GPU's matmul rate) and peak memory, the weight sync into the engine replica,
    and with `--baseline` the scaling efficiency.

    At world size 1 the same step also runs on today's path first (CUDA graphs unless `--graphs off`): the cost
    of the sharded layout itself (per-layer all-gather and reduce-scatter hooks, fp32 shards cast to the model
    dtype in every forward, gradients reduced in fp32, the sharded optimizer step; under FSDP the trainer runs
    eagerly, its collectives are not captured in graphs), as `today_*` and `fsdp_over_today`."""
    from exactrl.distributed.env import init_from_env, rank_device
    from exactrl.distributed.parallelize import Parallelism
    from exactrl.train.optim import MasterAdamW
    from exactrl.train.trainer import PolicyTrainer, TrainerSettings

    ctx = init_from_env(resolve_device(args.device))
    if ctx.world_size > 1 and args.vs:
        raise ValueError(f"bench train --fsdp --vs {args.vs} runs at world size 1; drop --vs or --nproc")
    check_ranks(args, ctx.world_size)
    baseline = baseline_of(args)
    args.device = rank_device(ctx, resolve_device(args.device))
    today = bench_train(args) if ctx.world_size == 1 else None
    _reset_peak_memory(args.device)  # the FSDP run's own peak, without today's path's
    device, model, tok = _load(args)
    rollouts, tokens = _bench_rollouts(args, model, tok, seed=ctx.rank)
    seq_len = min(1024, args.tokens_per_microbatch)
    par = Parallelism(ctx, fp8_copies=args.fsdp_fp8_copies)
    replica = par.engine_model(model)
    par.parallelize(model)
    par.bind(model, replica)
    settings = TrainerSettings(
        max_tokens_per_microbatch=args.tokens_per_microbatch,
        exact=True,
        cuda_graphs=False,
        on_mismatch="warn",  # synthetic rollouts, as in bench_train
    )
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-5, dist=ctx), dist=ctx)
    times = _step_times(lambda: trainer.step(rollouts), args.steps, device)
    if getattr(args, "profile", False):
        _profile_step(lambda: trainer.step(rollouts), device, show=ctx.rank == 0)
    sync = [par.sync_weights() for _ in range(3)]
    peak_gb, peak_kind = peak_memory_gb(
        device
    )  # weights, replica, AdamW state, activations: before the probe
    rate = measure_matmul_rate(device)  # this rank's GPU
    flops = 3 * model.flops_per_token(context=seq_len // 2) * tokens
    mine_s = statistics.median(times)
    ranks = ctx.all_gather_object(
        {
            "rank": ctx.rank,
            "device": device,
            "step_s": times,
            "step_s_median": mine_s,
            "tokens_per_s": tokens / mine_s,
            "matmul_peak_TFLOPs": rate / 1e12,
            "mfu": flops / mine_s / rate,
            "peak_memory_gb": peak_gb,
            "weight_sync_s": min(x["time/weight_sync_s"] for x in sync) if sync[0] else 0.0,
        }
    )
    # A step ends for the run when its slowest rank is done (the ranks meet in every step's collectives).
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
    median_s = statistics.median(step_s)
    world = ctx.world_size
    rec = {
        **record_head("train-fsdp", args, device),
        "fsdp_fp8_copies": args.fsdp_fp8_copies if args.precision == "fp8" else None,
        "world_size": world,
        "batch": "per-rank tokens fixed: the global batch is world_size x tokens_per_rank",
        "tokens_per_rank": tokens,
        "global_tokens_per_step": tokens * world,
        "seq_len": seq_len,
        "steps": args.steps,
        "step_s": step_s,
        "step_s_median": median_s,
        "aggregate_tokens_per_s": tokens * world / median_s,
        "tokens_per_s_per_rank": [r["tokens_per_s"] for r in ranks],
        "mfu_per_gpu": [r["mfu"] for r in ranks],
        "mfu": statistics.mean(r["mfu"] for r in ranks),
        "peak_memory_gb": [r["peak_memory_gb"] for r in ranks],
        "peak_memory_kind": peak_kind,
        "weight_sync_s": max(r["weight_sync_s"] for r in ranks),
        "weight_sync_bytes": sync[0].get("weight_sync/bytes", 0.0),
        "per_rank": ranks,
        # the names of the world-size-1 record before the multi-rank one, kept for comparisons
        "fsdp_step_s": median_s,
        "fsdp_tokens_per_s": tokens * world / median_s,
    }
    if today is not None:
        rec.update(
            today_step_s=today["step_s"],
            today_tokens_per_s=today["tokens_per_s"],
            today_mfu=today["mfu"],
            today_cuda_graphs=today["cuda_graphs"],
            fsdp_over_today=median_s / today["step_s"],
        )
    rec.update(_scaling(rec, baseline))
    print(f"{'path':28} {'step s':>9} {'tok/s':>10}")
    if today is not None:
        graphs = "CUDA graphs" if today["cuda_graphs"] else "eager"
        print(f"{'today (' + graphs + ')':28} {today['step_s']:9.4f} {today['tokens_per_s']:10.1f}")
    print(f"{f'FSDP2, {world} rank(s) (eager)':28} {median_s:9.4f} {rec['aggregate_tokens_per_s']:10.1f}")
    if today is not None:
        print(f"{'ratio FSDP / today':28} {rec['fsdp_over_today']:9.3f}")
    print(f"{'weight sync (s, bytes)':28} {rec['weight_sync_s']:9.4f} {rec['weight_sync_bytes']:10.3g}")
    return rec


def check_ranks(args, world_size: int) -> None:
    """What the options ask of `world_size` ranks, or of the benchmark at all, that it cannot give: said on each
    rank, and by the `--nproc N` launcher before torchrun starts them (exactrl.cli.check_before_launch)."""
    if args.what == "rl":
        for flag, given in (("--vs", getattr(args, "vs", None)), ("--fsdp", getattr(args, "fsdp", False))):
            if given:
                raise ValueError(f"bench rl does not implement {flag}")
    if args.what == "rollout" and args.vs == "torch":
        raise ValueError(
            "bench rollout --vs torch: the torch baseline is a training step (bench train --vs torch)"
        )
    if args.what == "train" and getattr(args, "fsdp", False) and args.vs == "torch":
        raise ValueError(
            "bench train --fsdp --vs torch: the torch baseline is the one-device step; drop --fsdp"
        )
    if args.what == "rollout" and args.concurrency < world_size:
        raise ValueError(
            f"bench rollout: --concurrency {args.concurrency} requests for {world_size} ranks; every rank "
            "needs at least one"
        )


def apply_defaults(args) -> None:
    """The defaults that depend on the benchmark: --max-tokens, --steps, bench rl's reward."""
    if getattr(args, "max_tokens", None) is None:
        args.max_tokens = 2048 if args.what == "rl" else 256
    if getattr(args, "steps", None) is None:
        args.steps = 3 if args.what == "rl" else 5
    if args.what == "rl" and getattr(args, "reward", None) is None:
        args.reward = ["numeric_match"]


def main(args) -> int:
    apply_defaults(args)
    if getattr(args, "busy_cores", 0) and os.environ.get("LOCAL_RANK", "0") == "0":
        from exactrl.bench_records import busy_cores

        busy_cores(args.busy_cores)  # one set per host: rank 0 of a node starts them
    if getattr(args, "split_kv", "auto") == "off":
        from exactrl.ops.triton import attention as triton_attention

        triton_attention.SPLIT_DECODE = False
    if args.what == "rl":
        from exactrl import bench_rl

        check_ranks(args, int(os.environ.get("WORLD_SIZE", "1")))
        return bench_rl.main(args)
    if args.what == "train" and getattr(args, "fsdp", False):
        from exactrl.distributed.env import under_torchrun

        if not under_torchrun():  # the FSDP path needs a process group: run this very command on one rank
            import sys as _sys

            check_ranks(args, 1)  # before the launch

            from exactrl.distributed.launch import launch_torchrun

            return launch_torchrun(1, _sys.argv[1:])
        rec = bench_train_fsdp(args)
        _print_ranks(rec)
        _emit_rank0(args, rec)
        return 0
    if args.what == "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("bench train on several ranks measures the FSDP2 step: add --fsdp")
    if args.what == "train" and args.baseline:
        raise ValueError("bench train --baseline compares world sizes of the FSDP2 step: add --fsdp")
    rec = bench_rollout(args) if args.what == "rollout" else bench_train(args)
    keys = [k for k in rec if isinstance(rec[k], float)]
    print(f"{'metric':28} value")
    for k in keys:
        print(f"{k:28} {rec[k]:.4g}")
    if "per_rank" in rec:
        _print_ranks(rec)
    _emit_rank0(args, rec)
    return 0


def _emit_rank0(args, rec: dict) -> None:
    """Every rank holds the whole record; rank 0 alone writes it (the others' stdout is closed already)."""
    if os.environ.get("RANK", "0") == "0":
        _emit(args, rec)
