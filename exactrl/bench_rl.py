"""`exactrl bench rl`: the time of whole GRPO steps, as `exactrl train` runs them, and where it goes.

Users feel the time of a step (generate, reward, train, weight sync), not a kernel's tok/s. This benchmark runs
the RL loop's own step (its step driver, exactrl/train/drivers/) on a random-init preset (or a checkpoint) and
times its stages from outside: each stage method (`rollout`, `rank_scores`, `update`, `parallel.sync_weights`) is
wrapped on the run object with a timer that waits for the device at the stage's end. What remains of the step
(prompt drawing, metrics) is `idle_s`, so the breakdown sums to the step time.

The workload, seeded and the same in every step and in both modes:

- `--prompts` prompts of uniformly drawn lengths in [--prompt-min, --prompt-max], random token ids (a random-init
  model has no use for text), each sampled `--samples` times (a GRPO group);
- each sample's completion length is drawn from a log-normal distribution (median `--completion-median`, shape
  `--completion-sigma`) capped at `--max-tokens`: a random-init model never stops by itself, so each sample
  gets its own length limit (`Sequence.max_tokens_per_sample`) in place of a stop rule. The model's end-of-text
  token still ends a sample, as in any run (with a random-init model: a handful per step).

The rewards are the configured reward functions (`--reward`, default the built-in `numeric_match`): on random text
they score 0, which changes no kernel's work. The engine records the number of running and waiting sequences
at every engine step (`RolloutEngine.trace`), drawn as the concurrency over the generation phase: the long
tail, where the last long completions decode at low concurrency, is visible there.

`--max-off-policy-steps 1` runs the one-step-off loop (algorithm.max_off_policy_steps, exactrl/train/offpolicy.py):
the engine samples the next batch in a worker thread (its own CUDA stream) while the trainer updates, so
`generate_s` and `reward_s` are the worker's seconds for the *next* batch, overlapped with `train_s`; the record
says `overlapped`, adds `offpolicy_wait_s` (the trainer waiting for the worker after its update) and
`offpolicy_guard_s` (the guard's forward on the engine's copy, in the worker), and `idle_s` is what remains of
the step outside train, weight sync and that wait. The whole-step ratio against the synchronous loop is the
ratio of the two runs' `step_s`. `--max-off-policy-steps 2 --partial-rollouts` adds partial rollouts
(exactrl/train/partial.py): each generation stops once the step's groups are complete, `--partial-oversample`
more groups in flight, the unfinished samples resumed (recomputed) in the next; the record adds where the cut
fell (`offpolicy_partial_engine_steps`), what resuming cost (`offpolicy_partial_recomputed_tokens`) and the
staleness (`offpolicy_versions_behind_max`, at most 2). Request ids count up over the run, and request r gets the
workload's prompt r % --prompts with its length plan.

`--overlap tail` runs the on-policy tail overlap (algorithm.overlap, exactrl/train/overlap.py): each finished
group is trained on while the rest of the batch generates, one optimizer step per batch. Its stages run inside
one call, so their seconds are the step's own metrics: `generate_s` (the generate call, training overlapped
inside it), `reward_s` (scoring the groups), `train_s` (the trainer's calls: on a GPU mostly queuing, since they
run asynchronously), `train_after_generate_s` (from the last finished sequence to the update applied: the
training that was not hidden), `overlap_wait_s` (the loop's thread waiting for the next group) and
`overlap_share_during_generation` (the share of completion tokens queued for training before generation ended);
`idle_s` is the step outside generate, that after-generation training and the weight sync.

Prints a table and one JSON line (without the trace), and writes the JSON (with the trace) and a PNG under
`--out-dir`. `--plot-from A.json B.json` draws earlier results (e.g. exact and fast) on one plot without running.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exactrl.bench_records import baseline_of, record_head, result_path
from exactrl.engine.engine import RolloutEngine
from exactrl.train.hooks import WRAPPED_STAGES, RunHooks

# What each timed stage is called in the JSON, and the stage it wraps (on `run.stages`, or `run.parallel`).
STAGES = (
    ("generate_s", "rollout"),
    ("reward_s", "rank_scores"),  # this rank's rewards (the gathers after are cheap)
    ("train_s", "update"),
    ("weight_sync_s", "sync_weights"),
)


# Partial rollouts' per-step figures (offpolicy/<key> in the step's metrics) that the record carries.
PARTIAL_KEYS = (
    "partial/engine_steps",
    "partial/resumed_samples",
    "partial/recomputed_tokens",
    "partial/carried_samples",
    "partial/due_groups",
    "versions_behind/max",
    "mixed_version_seqs",
)


@dataclass(frozen=True)
class Workload:
    """The step's prompts and each sample's completion length limit, drawn once from `seed`."""

    prompt_ids: list[list[int]]  # [prompts][len]
    max_tokens: np.ndarray  # [prompts, samples] int64, each sample's length limit

    @staticmethod
    def draw(
        *,
        prompts: int,
        samples: int,
        prompt_min: int,
        prompt_max: int,
        completion_median: float,
        completion_sigma: float,
        max_tokens: int,
        vocab: int,
        seed: int = 0,
    ) -> Workload:
        for name, v, lo in (
            ("--prompts", prompts, 1),
            ("--samples", samples, 1),
            ("--prompt-min", prompt_min, 1),
            ("--max-tokens", max_tokens, 1),
        ):
            if v < lo:
                raise ValueError(f"bench rl: {name} must be >= {lo}, got {v}")
        if prompt_max < prompt_min:
            raise ValueError(f"bench rl: --prompt-max ({prompt_max}) must be >= --prompt-min ({prompt_min})")
        if not completion_median >= 1:
            raise ValueError(f"bench rl: --completion-median must be >= 1, got {completion_median}")
        if not completion_sigma >= 0:
            raise ValueError(f"bench rl: --completion-sigma must be >= 0, got {completion_sigma}")
        rng = np.random.default_rng(seed)
        lens = rng.integers(prompt_min, prompt_max + 1, size=prompts)
        prompt_ids = [rng.integers(0, vocab, size=int(n)).tolist() for n in lens]
        lengths = rng.lognormal(np.log(completion_median), completion_sigma, size=(prompts, samples))
        limits = np.clip(np.ceil(lengths), 1, max_tokens).astype(np.int64)
        return Workload(prompt_ids, limits)


class PlannedLengthEngine(RolloutEngine):
    """The rollout engine, with each sample's length limit taken from a `Workload` (by the request's prompt
    index in the step: RLRun keys requests as step * prompts_per_step + index). Everything else is the engine's
    own path; the limit only ends a sample earlier than `params.max_tokens` would."""

    def __init__(self, *args: Any, workload: Workload, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.workload = workload

    def _start(  # type: ignore[override]
        self, prompts, request_ids, valid, params, progress, max_total_tokens=None, extra_rows: int = 0
    ):
        if max_total_tokens is not None:
            raise ValueError("bench rl plans single-turn completions; multi-turn episodes are not supported")
        call = super()._start(prompts, request_ids, valid, params, progress, extra_rows=extra_rows)
        plan = self.workload.max_tokens
        for seq in call.sched.waiting:  # group parents, not yet forked
            limits = plan[seq.request_id % plan.shape[0]][: seq.num_samples]
            if len(limits) != seq.num_samples:
                raise ValueError(
                    f"bench rl: the workload has {plan.shape[1]} samples per prompt, the call asks for "
                    f"{seq.num_samples}"
                )
            # never beyond what the engine allowed (params.max_tokens, room left in max_model_len)
            seq.set_max_tokens_per_sample([min(int(x), seq.max_tokens) for x in limits])
        return call


def _sync(device: str, stream_only: bool = False) -> None:
    """Wait for the device's work; stream_only: only the calling thread's current stream (with the off-policy
    worker, the other thread's kernels are not this stage's)."""
    if torch.device(device).type == "cuda":
        if stream_only:
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda.synchronize()


class _StageTimers:
    """Times the run's stages (`wrap`: the run's `RunHooks.wrap_stage`, exactrl/train/hooks.py): seconds and calls
    per stage in the current step."""

    def __init__(self, device: str, overlapped=False, tail=False, partial=False, disaggregated=False) -> None:
        self.device = device
        # Tail overlap: generate, score and the update run inside one stage of the loop (exactrl/train/overlap.py);
        # their seconds come from the step's metrics, and only the weight sync is wrapped (a wrapped stage's wait
        # for the device would stall the overlap).
        self.tail = tail
        # Off-policy: generate and score run in the worker thread, overlapped with update; each stage waits only
        # for its own stream, and a step may run them twice (the first step) or not at all (the last).
        self.overlapped = overlapped
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.gen_start: float | None = None
        # Peak device memory per stage of the step (bytes allocated): the allocator's peak is read and restarted
        # at every stage boundary, each reading credited to the stages open then (a nested stage's to its outer
        # ones too) and to the step (`peak`). Not with overlapped stages (their peaks would mix); CUDA only.
        self.memory: tuple[Callable[[], int], Callable[[], None]] | None = None
        if torch.device(device).type == "cuda" and not (overlapped or tail):
            self.memory = (torch.cuda.max_memory_allocated, torch.cuda.reset_peak_memory_stats)
        self.stage_peaks: dict[str, int] = {}
        self.peak = 0
        self._open: list[str] = []
        self.profile_generate = False  # set for one step: its generate stage runs under torch.profiler
        self.kernels: list[dict[str, Any]] | None = None
        # Which of the run's stages (`WRAPPED_STAGES`' names) this benchmark times, as what: the STAGES, except
        # what the tail overlap runs inside one stage; with partial rollouts, the pool's generation (cut by count)
        # is the generate stage; disaggregated, the trainers' send of the new weights to the generators.
        self.keys = {name: key for key, name in STAGES if not (tail and name != "sync_weights")}
        if partial:  # (never with tail: the config refuses the pair)
            self.keys["generate"] = self.keys.pop("rollout")
        self.disaggregated = disaggregated
        if disaggregated:
            self.keys["push"] = "weight_send_s"
        if set(self.keys) - {n for names in WRAPPED_STAGES.values() for n in names}:
            raise RuntimeError(
                f"bench rl: a stage of {sorted(self.keys)} is not in exactrl/train/hooks.py's WRAPPED_STAGES"
            )

    def wrap(self, name: str, stage: Callable[..., Any]) -> Callable[..., Any]:
        """The run's stage `name`, timed when this benchmark times it (`RunHooks.wrap_stage`)."""
        key = self.keys.get(name)
        return stage if key is None else self._wrap(key, stage)

    def _wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            if key == "generate_s":
                self.gen_start = t
            self.bank_memory()
            self._open.append(key)
            try:
                if key == "generate_s" and self.profile_generate:
                    return self._profiled(fn, *args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                _sync(self.device, self.overlapped)  # the stage's device work counts to the stage
                self.bank_memory()
                self._open.pop()
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t
                self.calls[key] = self.calls.get(key, 0) + 1

        return timed

    def bank_memory(self) -> int:
        """The allocator's peak since the last boundary, credited to the open stages and the step, then restarted;
        returns the step's peak so far (0 without `memory`)."""
        if self.memory is None:
            return 0
        read, reset = self.memory
        p = read()
        for k in self._open:
            self.stage_peaks[k] = max(self.stage_peaks.get(k, 0), p)
        self.peak = max(self.peak, p)
        reset()
        return self.peak

    def _profiled(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn under torch.profiler; `kernels`: time per GPU kernel (CUDA) or per operator's own CPU time (CPU),
        largest first. The profiler's overhead lands in this step's generate time: the step is marked."""
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.device(self.device).type == "cuda"
        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            out = fn(*args, **kwargs)
            _sync(self.device)
        if cuda:
            rows = [
                (e.key, e.self_device_time_total, e.count)
                for e in prof.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA
            ]
        else:
            rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
        rows.sort(key=lambda r: r[1], reverse=True)
        self.kernels = [{"kernel": k[:120], "ms": round(us / 1e3, 3), "count": n} for k, us, n in rows]
        return out

    def start_step(self) -> None:
        self.seconds, self.calls, self.gen_start = {}, {}, None
        self.stage_peaks, self.peak, self._open = {}, 0, []

    def check_step(self) -> None:
        """Every stage ran once: otherwise the breakdown would silently miss time (the loop changed)."""
        if self.disaggregated and self.calls.get("weight_send_s") != 1:
            raise RuntimeError(
                f"bench rl: the weight send ran {self.calls.get('weight_send_s', 0)} times in one step (expected once)"
            )
        for key, name in STAGES:
            if self.tail and name != "sync_weights":
                continue
            if self.overlapped and key in ("generate_s", "reward_s"):
                if self.calls.get(key, 0) > 2:
                    raise RuntimeError(
                        f"bench rl: {name!r} ran {self.calls[key]} times in one off-policy step"
                    )
                self.seconds.setdefault(key, 0.0)
                continue
            if self.calls.get(key) != 1:
                raise RuntimeError(
                    f"bench rl: the step driver called {name!r} {self.calls.get(key, 0)} times in one step (expected "
                    "once); update exactrl/bench_rl.py to the loop's stages"
                )


def _config(args: Any, out_dir: str, steps: int):
    from exactrl.config import RunConfig, config_from_dict

    p_max = args.prompt_max
    seq_len = p_max + args.max_tokens
    d = {
        "run": {
            "name": "bench-rl",
            "output_dir": out_dir,
            "seed": args.seed,
            "device": args.device,
            "exact": args.mode == "exact",
            "on_mismatch": args.on_mismatch,
            "tensorboard": False,
            "progress": False,
        },
        "model": {
            "dtype": args.dtype,
            "precision": getattr(args, "precision", "dtype"),
            **({"path": args.model} if args.model else {"preset": args.preset}),
        },
        "engine": {
            "max_model_len": seq_len,
            "max_num_seqs": args.max_num_seqs,
            "kv_memory_fraction": args.kv_memory_fraction,
            "cuda_graphs": args.graphs == "on",
        },
        "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens},
        # The task only supplies held-out prompts nobody evaluates; the step's prompts are the workload's.
        "task": {"name": "arithmetic", "num_eval": 0, "max_prompt_tokens": p_max, "use_chat_template": False},
        "reward": {"functions": list(args.reward)},
        "algorithm": {
            "name": "grpo",
            "group_size": args.samples,
            "rollouts_per_step": args.prompts * args.samples,
            "max_off_policy_steps": getattr(args, "max_off_policy_steps", 0),
            "overlap": getattr(args, "overlap", "none"),
            "partial_rollouts": bool(getattr(args, "partial_rollouts", False)),
            "partial_oversample": getattr(args, "partial_oversample", 0.25),
        },
        "distributed": {"generator_ranks": getattr(args, "generator_ranks", 0)},
        "train": {
            "steps": steps,
            "max_tokens_per_microbatch": max(args.tokens_per_microbatch, seq_len),
            "cuda_graphs": args.graphs == "on",
            "save_at_end": False,
            "save_every": 0,
        },
    }
    cfg = config_from_dict(d, RunConfig, source="exactrl bench rl")
    overrides = list(getattr(args, "overrides", None) or [])
    if overrides:  # --set: the user's keys over the benchmark's (the memory settings a large model needs)
        from exactrl.config import apply_overrides

        cfg = apply_overrides(cfg, overrides)
    cfg.validate()
    return cfg


def check_options(args: Any) -> None:
    """Refuse options the benchmark cannot run (its step counts, its workload's shape): on each rank, and by the
    `--nproc N` launcher before torchrun starts them (exactrl.commands._bench_before_launch)."""
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"bench rl: --steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    _workload(
        args, None, None, vocab=1
    )  # the same checks on one token of vocabulary: nothing here needs the model


def run_bench(args: Any, on_step: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
    """Run `args.warmup` + `args.steps` RL steps; the record of the median timed step (lower middle for an even
    count; every timed step is in `steps_detail`). on_step(record so far) after each timed step: a run cut
    short (a timeout) still leaves its finished steps."""
    from exactrl.distributed.env import under_torchrun
    from exactrl.model.loading import resolve_device
    from exactrl.train.loop import RLRun
    from exactrl.train.resolved import resolve_run

    check_options(args)
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="exactrl-bench-rl-") as tmp:
        # Off-policy, every step samples the next step's batch during its update: one step more in the config
        # keeps the last timed step in that steady state (its batch, sampled ahead, is never trained on).
        cfg = _config(args, tmp, total + (1 if getattr(args, "max_off_policy_steps", 0) else 0))
        quiet = lambda *a, **k: print(*a, file=sys.stderr)  # noqa: E731
        if not under_torchrun() and cfg.distributed.generator_ranks:
            raise ValueError("bench rl: --generator-ranks needs --nproc N (torchrun ranks)")
        # The run resolved as `exactrl train` resolves it (--nproc N: colocated ranks, or generator ranks apart).
        resolved = resolve_run(cfg)
        layout = resolved.layout if under_torchrun() else None
        if resolved.layout.role == "generator":
            return _serve_as_generator(args, cfg, resolved.layout)
        a = cfg.algorithm
        overlapped = a.max_off_policy_steps > 0
        device_type = str(resolve_device(cfg.run.device))  # what the timers wait for and measure
        tail, disagg = a.overlap == "tail", resolved.layout.disaggregated
        timers = _StageTimers(device_type, overlapped, tail, a.partial_rollouts, disagg)
        parts = _BenchParts(args, resolved.layout.local, partial=a.partial_rollouts)
        # The run as `exactrl train` builds it, with the workload's engine and prompts and the timed stages.
        hooks = RunHooks(engine=parts.engine, prompts=parts.prompts, wrap_stage=timers.wrap)
        run = RLRun(resolved, out=quiet, hooks=hooks)
        remote = run.remote is not None
        try:
            device = str(run.device)
            wl = parts.workload(run.tok, run.model)
            t_build = time.perf_counter()
            run.build_trainer()
            print(f"trainer and engine built: {_setup_note(device, t_build)}", file=sys.stderr)
            t_sync = time.perf_counter()
            full_sync = _full_weight_sync(run)
            print(f"every weight synced once: {_setup_note(device, t_sync)}", file=sys.stderr)
            records = []
            for k in range(total):
                timers.profile_generate = bool(getattr(args, "profile", False)) and k == total - 1
                records.append(_one_step(run, timers, device, timed=k >= args.warmup))
                if timers.profile_generate:
                    records[-1]["generate_kernels"] = timers.kernels
                    records[-1]["profiled"] = True
                print(
                    f"step {k + 1}/{total}{' (warm-up)' if k < args.warmup else ''}: "
                    f"{records[-1]['step_s']:.2f} s",
                    file=sys.stderr,
                )
                if on_step is not None and k >= args.warmup and run.dist.is_main and not remote:
                    partial = _record(args, device, wl, run, records[args.warmup :], records[: args.warmup])
                    on_step({**partial, "partial": k + 1 < total})
        finally:
            run.close()
    timed = records[args.warmup :]
    rec = _record(args, device, wl, run, timed, records[: args.warmup])
    rec.update(full_sync)
    if layout is not None:
        rec.update(_roles(layout, run, timed))
    return rec


def _setup_note(device: str, since: float) -> str:
    """A set-up stage's seconds and, on a GPU, the memory it left allocated and its peak (a long set-up, a 30B
    model's, says where it is)."""
    note = f"{time.perf_counter() - since:.1f} s"
    if torch.device(device).type == "cuda":
        note += (
            f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated"
            f" (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)"
        )
    return note


def _workload(args: Any, tok: Any, model: Any, vocab: int | None = None) -> Workload:
    """The step's workload from the command's options (`vocab`: the token ids drawn; default the model's)."""
    return Workload.draw(
        prompts=args.prompts,
        samples=args.samples,
        prompt_min=args.prompt_min,
        prompt_max=args.prompt_max,
        completion_median=args.completion_median,
        completion_sigma=args.completion_sigma,
        max_tokens=args.max_tokens,
        vocab=vocab if vocab is not None else min(tok.vocab_size, model.config.vocab_size),
        seed=args.seed,
    )


def _full_weight_sync(run: Any) -> dict[str, Any]:
    """Every weight once, timed, before the first step: disaggregated, trainer 0's broadcast to the generators
    (after the trainers' all-gather into its replica; the generators then hold the trainers' weights); colocated
    under torchrun, the all-gather into each rank's replica. The figure for a whole model's move."""
    if not run.parallel.sharded:
        return {}
    sync = run.parallel.sync_weights(full=True)
    rec = {
        "weight_sync_full_bytes": sync["weight_sync/bytes"],
        "weight_sync_full_s": sync["time/weight_sync_s"],
    }
    if run.remote is not None:
        send = run.remote.push(run.parallel.replica_weights(full=True))
        rec["weight_send_full_s"] = send["time/weight_send_s"]
        rec["weight_send_full_gb_per_s"] = send.get("perf/weight_send_gb_per_s", 0.0)
    else:
        rec["weight_sync_full_gb_per_s"] = (
            rec["weight_sync_full_bytes"] / max(rec["weight_sync_full_s"], 1e-9) / 1e9
        )
    return rec


def _serve_as_generator(args: Any, cfg: Any, layout: Any) -> dict[str, Any]:
    """A generator rank of `bench rl --generator-ranks G`: the run's generator (its memory plan checked, the plan's
    cache) on an engine with the workload's length plan; then its rounds go to rank 0 (`_roles`, a collective of every rank)."""
    from exactrl.train.disagg import run_generator

    loop = run_generator(cfg, layout, make=_BenchParts(args).engine)
    layout.all_gather_object({"rank": layout.world.rank, "rounds": [_asdict(r) for r in loop.rounds]})
    return {}


def _overlap_s(windows: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in windows)


def _roles(layout: Any, run: Any, timed: list[dict[str, Any]]) -> dict[str, Any]:
    """Under torchrun: the layout, and per role what its ranks did during the timed steps (a collective of every
    rank of the job). Trainers: each stage's seconds (rank 0's, the record's median step) and the rest idle;
    generators: from their rounds' wall-clock windows, the seconds generating and receiving weights in each timed
    step, the rest idle. Tokens per second per GPU divide the step's completion tokens by every rank of the job."""
    mine = {"rank": layout.world.rank, "rounds": None}
    parts = layout.all_gather_object(mine)
    world = layout.world.world_size
    steps = [(r["wall_start"], r["wall_end"]) for r in timed]
    out: dict[str, Any] = {
        "world_size": world,
        "generator_ranks": layout.generators,
        "trainer_ranks": layout.trainers,
    }
    med = median_step(timed)
    out["tokens_per_s_per_gpu"] = med["generated_tokens"] / med["step_s"] / world
    out["trainer_idle_s"] = med["idle_s"]
    gens = [p for p in parts if p["rounds"] is not None]
    if gens:
        per_gen = []
        for p in gens:
            rounds = p["rounds"]
            gen_w = [(x["start"], x["end"]) for x in rounds if x["kind"] == "generate"]
            sync_w = [(x["start"], x["end"]) for x in rounds if x["kind"] == "sync"]
            gen_s = [_overlap_s(gen_w, s, e) for s, e in steps]
            sync_s = [_overlap_s(sync_w, s, e) for s, e in steps]
            idle_s = [(e - s) - g - w for (s, e), g, w in zip(steps, gen_s, sync_s)]
            # The engine's steps and preemptions of the generate rounds that started in the timed steps.
            timed_rounds = [
                x for x in rounds if x["kind"] == "generate" and any(s <= x["start"] < e for s, e in steps)
            ]
            per_gen.append(
                {
                    "rank": p["rank"],
                    "generate_s": statistics.median(gen_s),
                    "weight_recv_s": statistics.median(sync_s),
                    "idle_s": statistics.median(idle_s),
                    "engine_steps": sum(x["engine_steps"] for x in timed_rounds),
                    "preemptions": sum(x["preemptions"] for x in timed_rounds),
                    "kv_cache_tokens": max((x["kv_cache_tokens"] for x in rounds), default=0),
                }
            )
        out["generators"] = per_gen
        out["generator_generate_s"] = max(g["generate_s"] for g in per_gen)
        out["generator_weight_recv_s"] = max(g["weight_recv_s"] for g in per_gen)
        out["generator_idle_s"] = min(g["idle_s"] for g in per_gen)
        out["generator_engine_steps"] = sum(g["engine_steps"] for g in per_gen)
        out["generator_preemptions"] = sum(g["preemptions"] for g in per_gen)
        out["generator_kv_cache_tokens"] = min(g["kv_cache_tokens"] for g in per_gen)
    return out


class _BenchParts:
    """The benchmark's parts of the run (`RunHooks`, exactrl/train/hooks.py): the workload, drawn once the run has
    its tokenizer (by the first engine made, or `workload`); an engine with its length plan; the step's prompts."""

    def __init__(self, args: Any, dist: Any = None, partial: bool = False) -> None:
        self.args, self.dist, self.partial = args, dist, partial
        self.wl: Workload | None = None
        self.cursor = 0  # partial rollouts: the next of the workload's prompts

    def workload(self, tok: Any, model: Any) -> Workload:
        self.wl = self.wl or _workload(self.args, tok, model)
        return self.wl

    def engine(self, model: Any, config: Any, tokenizer: Any) -> PlannedLengthEngine:
        """The run's engine (the policy's, or its weight copy's) with the workload's length plan."""
        return PlannedLengthEngine(
            model, config, tokenizer=tokenizer, workload=self.workload(tokenizer, model)
        )

    def prompts(
        self, count: int | None = None, *, shard: bool = True
    ) -> tuple[list[Any], list[list[int]], list[int]]:
        """The workload's prompts, the same every step; under torchrun this trainer's share, as RunStages.prompts
        shares them (request ids: their index in the step). Partial rollouts top their pool up with `count` at a
        time, the workload's prompts round and round: request r (ids count up from 0, train/partial.py) gets prompt
        r % P and PlannedLengthEngine's length plan for it."""
        from exactrl.tasks import Example

        assert self.wl is not None, "bench rl draws the workload before the first step"
        ids = self.wl.prompt_ids
        if self.partial:
            count = len(ids) if count is None else count
            idx = [(self.cursor + j) % len(ids) for j in range(count)]
            self.cursor += count
            mine, index = idx, list(range(count))
        else:
            mine = index = list(self.dist.shard(len(ids)))
        return (
            [Example(prompt="", answer="0", meta={"bench": "rl"}) for _ in mine],
            [ids[i] for i in mine],
            index,
        )


def _asdict(x: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(x)


def _one_step(run: Any, timers: _StageTimers, device: str, timed: bool) -> dict[str, Any]:
    # Disaggregated, the engine runs on the generator ranks (its figures: `_roles`); here a stand-in without any.
    eng = run.engine if getattr(run, "remote", None) is None else _NoEngine()
    eng = getattr(eng, "engine", eng)  # a group's shared engine: this rank's engine, whose figures these are
    eng.trace = []
    eng.reset_stats()
    graph_capture_before = _train_capture_s(run)
    engine_capture_before = eng.runner.capture_seconds if eng.runner is not None else 0.0
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timers.start_step()
    _sync(device)
    t0, wall0 = time.perf_counter(), time.time()
    m = run.driver.step()
    _sync(device)
    step_s = time.perf_counter() - t0
    timers.check_step()
    sr = run.last_rollouts
    if timers.tail:  # the stages ran inside the tail-overlap stage: its own figures
        timers.seconds["generate_s"] = float(m["perf/generate_s"])
        timers.seconds["reward_s"] = float(m["perf/score_s"])
        timers.seconds["train_s"] = float(m["perf/train_s"])
    rec: dict[str, Any] = {"step_s": step_s, **{k: timers.seconds[k] for k, _ in STAGES}}
    rec["wall_start"], rec["wall_end"] = wall0, wall0 + step_s  # wall clock: the generators' rounds line up
    if "weight_send_s" in timers.seconds:  # disaggregated: trainer 0's broadcast to the generators
        rec["weight_send_s"] = timers.seconds["weight_send_s"]
    if timers.tail:
        rec["train_after_generate_s"] = float(m["perf/train_after_generate_s"])
        rec["overlap_wait_s"] = float(m["perf/wait_s"])
        rec["overlap_share_during_generation"] = float(m["overlap/share_during_generation"])
        rec["overlap_microbatches"] = int(m["overlap/microbatches"])
        rec["overlap_microbatches_during_generation"] = int(m["overlap/microbatches_during_generation"])
        rec["idle_s"] = step_s - rec["generate_s"] - rec["train_after_generate_s"] - rec["weight_sync_s"]
    elif timers.overlapped:
        rec["overlapped"] = True
        rec["offpolicy_wait_s"] = float(m.get("offpolicy/wait_s", 0.0))
        rec["offpolicy_guard_s"] = float(m.get("offpolicy/guard_s", 0.0))
        rec["offpolicy_versions_behind"] = float(m.get("offpolicy/versions_behind/token_mean", 0.0))
        for key in PARTIAL_KEYS:  # partial rollouts: where the cut fell and what resuming cost
            if f"offpolicy/{key}" in m:
                rec[f"offpolicy_{key.replace('/', '_')}"] = float(m[f"offpolicy/{key}"])
        rec["idle_s"] = step_s - rec["train_s"] - rec["weight_sync_s"] - rec["offpolicy_wait_s"]
        rec["idle_s"] -= rec.get("weight_send_s", 0.0)
    else:
        rec["idle_s"] = step_s - sum(timers.seconds.values())
    rec["generated_tokens"] = int(sum(sr.lengths))
    # every rank's prompts (this rank's rollouts are its share)
    rec["prompt_tokens"] = int(run.dist.sum(sum(len(r.prompt_ids) for r in sr.rollouts)))
    rec["truncated"] = int(sum(sr.truncated))
    rec["lengths"] = [int(x) for x in sr.lengths]
    # Disaggregated, a trainer has no engine: the generators' figures are `_roles`', not a row of zeros here.
    if not isinstance(eng, _NoEngine):
        rec["engine_steps"] = int(eng.stats["steps"])
        rec["preemptions"] = int(eng.stats["preemptions"])
        rec["kv_cache_tokens"] = (
            eng.runner.num_blocks * eng.config.block_size if eng.runner is not None else 0
        )
        rec["cuda_graph_steps"] = int(eng.stats["cuda_graph_steps"])
        rec["engine_graph_capture_s"] = (
            eng.runner.capture_seconds if eng.runner is not None else 0.0
        ) - engine_capture_before
    rec["train_graph_capture_s"] = _train_capture_s(run) - graph_capture_before
    for key in ("mismatch/num_tokens", "mismatch/num_mismatched_tokens"):
        if key in m:
            rec[key.replace("/", "_")] = int(m[key])
    if cuda:
        rec["gpu_memory_peak_gb"] = max(timers.bank_memory(), torch.cuda.max_memory_allocated()) / 1e9
        rec["gpu_memory_reserved_peak_gb"] = torch.cuda.max_memory_reserved() / 1e9
        if timers.stage_peaks:
            # Per stage, beside the plan's phases (generate: generation; train: training and the optimizer step).
            rec["gpu_memory_stage_peak_gb"] = {k[:-2]: v / 1e9 for k, v in timers.stage_peaks.items()}
    g0 = timers.gen_start
    if g0 is None:  # tail overlap: generate was not wrapped; its first engine step marks its start
        g0 = eng.trace[0][1] if eng.trace else t0
    # [seconds since generate began, running, waiting] per engine step of this step's generate call
    rec["trace"] = [[round(t - g0, 6), r, w] for _, t, r, w in eng.trace]
    eng.trace = None
    return rec


class _NoEngine:
    """The engine figures of a trainer rank that has no engine (disaggregated): none."""

    runner = None
    config = None
    stats = {"steps": 0, "preemptions": 0, "cuda_graph_steps": 0}
    trace: list[Any] | None = None

    def reset_stats(self) -> None:
        pass


def _train_capture_s(run: Any) -> float:
    graphs = getattr(getattr(run, "trainer", None), "graphs", None)
    return float(getattr(graphs, "capture_s", 0.0) or 0.0)


def median_step(timed: list[dict[str, Any]]) -> dict[str, Any]:
    """The record's median step: a step that ran (its stages add up to it), the lower middle of an even count. A
    profiled step carries the profiler's overhead: the median is of the others when there are others. `step_s`,
    `step_s_median` and the table's "step_s (median step)" are all this step's."""
    pool = [r for r in timed if not r.get("profiled")] or timed
    return sorted(pool, key=lambda r: r["step_s"])[(len(pool) - 1) // 2]


def _record(
    args: Any, device: str, wl: Workload, run: Any, timed: list[dict], warm: list[dict]
) -> dict[str, Any]:
    profiled = [r for r in timed if r.get("profiled")]
    med = median_step(timed)
    lengths = np.array(med["lengths"])
    rec: dict[str, Any] = {
        **record_head("rl", args, device, args.preset if not args.model else Path(args.model).name),
        "algorithm": "grpo",
        "prompts": args.prompts,
        "samples": args.samples,
        "prompt_min": args.prompt_min,
        "prompt_max": args.prompt_max,
        "max_tokens": args.max_tokens,
        "completion_median": args.completion_median,
        "completion_sigma": args.completion_sigma,
        "max_num_seqs": args.max_num_seqs,
        "kv_memory_fraction": args.kv_memory_fraction,
        "tokens_per_microbatch": run.cfg.train.max_tokens_per_microbatch,
        # The trainer's microbatch as it ran (under FSDP2 the plan may take a larger one).
        "train_microbatch_tokens": run.microbatch_tokens,
        "graphs": args.graphs,
        # What else shaped the run: the model's depth, the engine's split, the user's --set keys.
        "num_layers": run.model.config.num_layers,
        "tensor_parallel": run.cfg.engine.tensor_parallel,
        "expert_parallel": run.cfg.engine.expert_parallel,
        "overrides": list(getattr(args, "overrides", None) or []),
        "warmup_steps": len(warm),
        "timed_steps": len(timed),
        "step_s": med["step_s"],
        "step_s_all": [r["step_s"] for r in timed],
        "step_s_median": med["step_s"],  # one median: the step whose stages the record holds
        "warmup_step_s": [r["step_s"] for r in warm],
    }
    for k, _ in STAGES:
        rec[k] = med[k]
    rec["idle_s"] = med["idle_s"]
    rec["max_off_policy_steps"] = run.cfg.algorithm.max_off_policy_steps
    rec["overlap"] = run.cfg.algorithm.overlap
    rec["partial_rollouts"] = run.cfg.algorithm.partial_rollouts
    partial = [f"offpolicy_{key.replace('/', '_')}" for key in PARTIAL_KEYS]
    for k in (
        "weight_send_s",
        "overlapped",
        "offpolicy_wait_s",
        "offpolicy_guard_s",
        "offpolicy_versions_behind",
        "train_after_generate_s",
        "overlap_wait_s",
        "overlap_share_during_generation",
        "overlap_microbatches",
        "overlap_microbatches_during_generation",
        *partial,
    ):
        if k in med:
            rec[k] = med[k]
    rec["generated_tokens"] = med["generated_tokens"]
    rec["prompt_tokens"] = med["prompt_tokens"]
    rec["tokens_per_s"] = med["generated_tokens"] / med["step_s"]
    rec["generate_tokens_per_s"] = med["generated_tokens"] / med["generate_s"]
    rec["train_tokens_per_s"] = (med["generated_tokens"] + med["prompt_tokens"]) / med["train_s"]
    rec["completion_len_mean"] = float(lengths.mean())
    rec["completion_len_p50"] = float(np.percentile(lengths, 50))
    rec["completion_len_p90"] = float(np.percentile(lengths, 90))
    rec["completion_len_max"] = int(lengths.max())
    rec["planned_tokens"] = int(wl.max_tokens.sum())
    rec["truncated"] = med["truncated"]
    for k in (
        "engine_steps",
        "preemptions",
        "kv_cache_tokens",
        "cuda_graph_steps",
        "engine_graph_capture_s",
        "train_graph_capture_s",
        "mismatch_num_tokens",
        "mismatch_num_mismatched_tokens",
    ):
        if k in med:
            rec[k] = med[k]
    if "gpu_memory_peak_gb" in med:
        rec["gpu_memory_peak_gb"] = max(r["gpu_memory_peak_gb"] for r in timed)
        rec["gpu_memory_reserved_peak_gb"] = max(r["gpu_memory_reserved_peak_gb"] for r in timed)
    stages = {k for r in timed for k in r.get("gpu_memory_stage_peak_gb", {})}
    if stages:
        rec["gpu_memory_stage_peak_gb"] = {
            k: max(r.get("gpu_memory_stage_peak_gb", {}).get(k, 0.0) for r in timed) for k in sorted(stages)
        }
    plan = getattr(run, "memory_plan", None)
    if plan is not None:  # the plan's peak per phase (GiB per rank), beside the measured peaks above
        rec["plan_peak_gib"] = {ph.name: round(ph.peak / 2**30, 2) for ph in plan.phases}
        rec["plan_tokens_per_microbatch"] = int(plan.counts["tokens_per_microbatch"])
    # The time after which fewer than a quarter of the step's samples were still running: the tail.
    tr = med["trace"]
    peak = max((r for _, r, _ in tr), default=0)
    tail = [t for t, r, w in tr if w == 0 and r < 0.25 * peak]
    rec["tail_start_s"] = tail[0] if tail else None
    if profiled:
        rec["generate_kernels"] = profiled[-1]["generate_kernels"]
        rec["profiled_generate_s"] = profiled[-1]["generate_s"]
    rec["steps_detail"] = [
        {k: v for k, v in r.items() if k not in ("trace", "lengths", "generate_kernels")} for r in timed
    ]
    rec["trace"] = tr
    return rec


def plot_concurrency(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Running sequences per engine step and over the generation phase (one line per record, e.g. exact and
    fast), and each record's step broken into its stages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 6))
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1])
    by_step, by_time, parts = (
        fig.add_subplot(grid[0, 0]),
        fig.add_subplot(grid[0, 1]),
        fig.add_subplot(grid[1, :]),
    )
    names = [
        f"{r['mode']}" + (f" ({r['preset']})" if r["preset"] != records[0]["preset"] else "") for r in records
    ]
    for name, rec in zip(names, records):
        tr = rec["trace"]
        label = f"{name}: generate {rec['generate_s']:.1f} s"
        (line,) = by_step.plot(
            range(len(tr)), [r[1] for r in tr], label=label, lw=1.2, drawstyle="steps-post"
        )
        c = line.get_color()
        by_time.plot(
            [r[0] for r in tr], [r[1] for r in tr], label=label, lw=1.2, color=c, drawstyle="steps-post"
        )
        by_time.axvline(rec["generate_s"], ls="--", lw=0.8, color=c)
    by_step.set_xlabel("engine step (prefill and decode)")
    by_time.set_xlabel("seconds since generate began (dashed: generate ends)")
    for ax in (by_step, by_time):
        ax.set_ylabel("running sequences")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    # The step, stage by stage: where the seconds go.
    colors = {"generate_s": "C0", "reward_s": "C2", "train_s": "C3", "weight_sync_s": "C4", "idle_s": "0.6"}
    for y, rec in enumerate(records):
        left = 0.0
        for key, color in colors.items():
            if rec.get("overlapped") and key in ("generate_s", "reward_s"):
                continue  # the worker's seconds, under train_s: not a part of the step's sum
            v = max(rec[key], 0.0)
            parts.barh(y, v, left=left, color=color, label=key[:-2] if y == 0 else None)
            left += v
        parts.text(left, y, f" {rec['step_s']:.1f} s", va="center", fontsize=8)
    parts.set_yticks(range(len(records)), names)
    parts.invert_yaxis()
    parts.set_xlabel("seconds of the median step")
    parts.set_xlim(0, 1.12 * max(r["step_s"] for r in records))
    parts.legend(fontsize=8, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    r0 = records[0]
    fig.suptitle(
        f"bench rl, {r0['preset']} ({r0['dtype']}, {r0.get('gpu') or r0['device']}): {r0['prompts']} prompts x "
        f"{r0['samples']} samples, prompts {r0['prompt_min']}-{r0['prompt_max']} tokens, completions log-normal "
        f"(median {r0['completion_median']:g}) up to {r0['max_tokens']}",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(rec: dict[str, Any]) -> str:
    rows = [
        ("step_s (median step)", rec["step_s"]),
        ("  generate_s", rec["generate_s"]),
        ("  reward_s", rec["reward_s"]),
        ("  train_s", rec["train_s"]),
        ("  weight_sync_s", rec["weight_sync_s"]),
        ("  weight_send_s (to generators)", rec.get("weight_send_s")),
        ("  idle_s", rec["idle_s"]),
        ("world_size", rec.get("world_size")),
        ("generator_ranks", rec.get("generator_ranks")),
        ("generators: generate_s", rec.get("generator_generate_s")),
        ("generators: weight_recv_s", rec.get("generator_weight_recv_s")),
        ("generators: idle_s", rec.get("generator_idle_s")),
        ("generators: engine_steps", rec.get("generator_engine_steps")),
        ("generators: preemptions", rec.get("generator_preemptions")),
        ("generators: kv_cache_tokens", rec.get("generator_kv_cache_tokens")),
        ("tokens_per_s_per_gpu", rec.get("tokens_per_s_per_gpu")),
        ("full weight send GB/s", rec.get("weight_send_full_gb_per_s")),
        ("full weight sync GB/s", rec.get("weight_sync_full_gb_per_s")),
        ("speedup_vs_baseline", rec.get("speedup_vs_baseline")),
        ("  offpolicy_wait_s", rec.get("offpolicy_wait_s")),
        ("  offpolicy_guard_s", rec.get("offpolicy_guard_s")),
        ("offpolicy_versions_behind", rec.get("offpolicy_versions_behind")),
        (
            "offpolicy_versions_behind max",
            rec.get("offpolicy_versions_behind_max"),
        ),  # with or without partial
        ("  train_after_generate_s", rec.get("train_after_generate_s")),
        ("  overlap_wait_s", rec.get("overlap_wait_s")),
        ("overlap_share_during_generation", rec.get("overlap_share_during_generation")),
        ("  partial: engine steps", rec.get("offpolicy_partial_engine_steps")),
        ("  partial: resumed samples", rec.get("offpolicy_partial_resumed_samples")),
        ("  partial: recomputed tokens", rec.get("offpolicy_partial_recomputed_tokens")),
        ("  partial: carried samples", rec.get("offpolicy_partial_carried_samples")),
        ("generated_tokens", rec["generated_tokens"]),
        ("tokens_per_s (over the step)", rec["tokens_per_s"]),
        ("generate_tokens_per_s", rec["generate_tokens_per_s"]),
        ("train_tokens_per_s", rec["train_tokens_per_s"]),
        ("completion_len_mean", rec["completion_len_mean"]),
        ("completion_len_max", rec["completion_len_max"]),
        ("tail_start_s", rec["tail_start_s"]),
        ("engine_steps", rec.get("engine_steps")),
        ("preemptions", rec.get("preemptions")),
        ("mismatched tokens", rec.get("mismatch_num_mismatched_tokens")),
        ("gpu_memory_peak_gb", rec.get("gpu_memory_peak_gb")),
        *[(f"  {k} stage peak gb", v) for k, v in rec.get("gpu_memory_stage_peak_gb", {}).items()],
    ]
    out = [f"{'metric':30} value"]
    for k, v in rows:
        if v is None:
            continue
        out.append(f"{k:30} {v:.4g}" if isinstance(v, float) else f"{k:30} {v}")
    if rec.get("generate_kernels"):
        what = "GPU time by kernel" if rec["device"] == "cuda" else "CPU time by operator"
        out.append(f"generate, {what} (profiled step: {rec['profiled_generate_s']:.2f} s)")
        out += [
            f"  {k['ms']:10.1f} ms {k['count']:7d}x  {k['kernel'][:80]}" for k in rec["generate_kernels"][:15]
        ]
    return "\n".join(out)


def main(args: Any) -> int:
    if args.plot_from:
        recs = [json.loads(Path(p).read_text()) for p in args.plot_from]
        for p, r in zip(args.plot_from, recs):
            if r.get("bench") != "rl" or "trace" not in r:
                raise ValueError(f"{p}: not a `bench rl` result with a trace")
        out = Path(args.plot or Path(args.out_dir) / f"rl-{recs[0]['preset']}-concurrency.png")
        print(f"plot written to {plot_concurrency(recs, out)}", file=sys.stderr)
        return 0
    import os

    from exactrl.model.loading import resolve_device

    name = args.preset if not args.model else Path(args.model).name
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # next to the one-process record, not over it
        name += f"-nproc{world}" + (
            f"-gen{args.generator_ranks}" if getattr(args, "generator_ranks", 0) else ""
        )
    if getattr(args, "max_off_policy_steps", 0):
        name += f"-offpolicy{args.max_off_policy_steps}"  # next to the synchronous record, not over it
    if getattr(args, "overlap", "none") != "none":
        name += f"-overlap-{args.overlap}"
    if getattr(args, "partial_rollouts", False):
        name += "-partial"
    if getattr(args, "precision", "dtype") != "dtype":
        name += f"-{args.precision}"
    path = result_path(args.out_dir, "rl", name, args.mode, resolve_device(args.device))
    baseline = baseline_of(args)
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 (a trainer) writes the record
    if main_rank:
        path.parent.mkdir(parents=True, exist_ok=True)
    rec = run_bench(args, on_step=lambda r: path.write_text(json.dumps(r) + "\n"))
    if not main_rank:
        return 0
    rec.setdefault("world_size", 1)
    rec.setdefault("generator_ranks", 0)
    if baseline is not None:
        rec["baseline"] = str(args.baseline)
        rec["baseline_world_size"] = baseline.get("world_size", 1)
        rec["baseline_generator_ranks"] = baseline.get("generator_ranks", 0)
        rec["baseline_max_off_policy_steps"] = baseline.get("max_off_policy_steps", 0)
        rec["speedup_vs_baseline"] = baseline["step_s_median"] / rec["step_s_median"]
    rec["partial"] = False
    if rec["trace"]:
        try:
            png = plot_concurrency([rec], Path(args.plot) if args.plot else path.with_suffix(".png"))
            # Beside the record, by default: its file name (no path of the machine that ran it); --plot as given.
            rec["plot"] = str(args.plot) if args.plot else png.name
        except ImportError as err:  # the JSON holds the trace: `--plot-from` draws it where matplotlib is
            print(f"no plot drawn ({err}); draw it later with --plot-from {path}", file=sys.stderr)
    path.write_text(json.dumps(rec) + "\n")
    print(_table(rec))
    line = {k: v for k, v in rec.items() if k not in ("trace", "steps_detail", "generate_kernels")}
    line["trace_points"] = len(rec["trace"])
    print(json.dumps(line))
    print(f"result written to {path}", file=sys.stderr)
    return 0
