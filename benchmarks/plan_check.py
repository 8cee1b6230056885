"""Predicted (exactrl plan) vs measured peak device memory per phase of a short run, on a GPU.

    python benchmarks/plan_check.py CONFIG [--set ...] [--out-dir DIR]     a short `exactrl train` of CONFIG
    python benchmarks/plan_check.py --bench-rl [-- BENCH RL FLAGS ...]      `exactrl bench rl`'s workload, by
        default the README's `exactrl bench rl --preset qwen3-1.7b --mode exact` with every other flag at its default

The run is the config's own, with train.check_memory off (a refusal would hide the measurement) and its memory
phases as configured (engine.release_memory, on by default: the KV cache is freed while the trainer runs). Each
phase's peak is torch.cuda.max_memory_allocated (and _reserved) between its boundaries: generation = the engine's
generate calls (the KV cache's allocation included), training = the trainer's step up to the optimizer, optimizer
= MasterAdamW's step. Also the phase switches' costs: KV allocations, decode graphs captured again because the cache
or a weight moved, and their seconds. Prints a table and one JSON line; the ratio measured / predicted is what the
plan's 10% target is about.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

import torch
from _script import require_cuda  # benchmarks/: the script's own folder is on sys.path

from exactrl.config import RunConfig, apply_overrides, load_config
from exactrl.engine.engine import RolloutEngine
from exactrl.train.loop import RLRun
from exactrl.train.memory import MemoryPlan
from exactrl.train.memory_fit import make_plan
from exactrl.train.optim import MasterAdamW
from exactrl.train.trainer import PolicyTrainer

PHASES = ("generation", "training", "optimizer")
MARK_BYTES = 512 * 12347  # the phase-start mark in the allocator's trace (see PhasePeaks.start)


class PhasePeaks:
    """Peak allocated / reserved bytes per phase, over every time the phase ran. With `trace` set to a phase, the
    allocator's history is recorded and, each time that phase reaches a new peak, what was live at the peak is
    grouped by the allocating line of exactrl's code (`peak_breakdown`)."""

    def __init__(self, trace: str | None = None) -> None:
        self.allocated = dict.fromkeys(PHASES, 0)
        self.reserved = dict.fromkeys(PHASES, 0)
        self.trace = trace
        self.breakdown: list[tuple[str, int]] = []
        if trace is not None:
            torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")

    def start(self) -> None:
        torch.cuda.synchronize()
        if (
            self.trace is not None
        ):  # a block of a size nothing else asks for marks the phase's start in the trace
            torch.empty(MARK_BYTES, dtype=torch.uint8, device="cuda")  # freed at once
        torch.cuda.reset_peak_memory_stats()

    def end(self, phase: str) -> None:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        if phase == self.trace and peak > self.allocated[phase]:
            self.breakdown = peak_breakdown(torch.cuda.memory._snapshot())
        self.allocated[phase] = max(self.allocated[phase], peak)
        self.reserved[phase] = max(self.reserved[phase], torch.cuda.max_memory_reserved())


def _site(frames: list[dict[str, Any]]) -> str:
    """An allocation's place: the innermost two frames of its Python stack in exactrl's own code (line, then its
    caller), else the innermost frame."""
    ours = [
        f"{f['filename'].split('exactrl/', 1)[1]}:{f.get('line')} {f.get('name')}"
        for f in frames
        if "exactrl/" in f.get("filename", "") and "benchmarks/" not in f.get("filename", "")
    ]
    if ours:
        return " <- ".join(ours[:2])
    return f"{frames[0].get('filename')}:{frames[0].get('line')}" if frames else "?"


def peak_breakdown(snapshot: dict[str, Any], top: int = 14) -> list[tuple[str, int]]:
    """Replay the allocator's trace (every alloc and completed free since recording began) and return what was
    live at its highest point after the last phase-start mark, in bytes per allocating line, largest first.
    Raises when the trace buffer wrapped (the live set would be incomplete)."""
    events = snapshot["device_traces"][0]
    if len(events) >= 4_000_000:
        raise RuntimeError("the allocator trace wrapped: the live set at the peak is unknown")
    marks = [i for i, e in enumerate(events) if e["action"] == "alloc" and e["size"] == MARK_BYTES]
    since = marks[-1] if marks else 0
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_at = -1
    for i, e in enumerate(events):
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = (e["size"], "")
            total += e["size"]
        elif a == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        if i > since and total > best:
            best, best_at = total, i
    live.clear()
    for e in events[: best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_site: dict[str, int] = {}
    for size, site in live.values():
        by_site[site] = by_site.get(site, 0) + size
    return sorted(by_site.items(), key=lambda kv: -kv[1])[:top] + [("(all live at the peak)", best)]


def wrap(cls: type, name: str, before, after) -> None:
    real = getattr(cls, name)

    def wrapped(self, *a, **k):
        before()
        try:
            return real(self, *a, **k)
        finally:
            after()

    setattr(cls, name, wrapped)


def instrument(trace: str | None = None) -> tuple[PhasePeaks, list[RLRun]]:
    """Phase boundaries on the classes the run uses, and a list that receives the run object."""
    peaks = PhasePeaks(trace)
    wrap(RolloutEngine, "generate", peaks.start, lambda: peaks.end("generation"))
    # The trainer's step holds the optimizer's: training is measured up to the optimizer step, and again after it.
    wrap(PolicyTrainer, "step", peaks.start, lambda: peaks.end("training"))
    wrap(
        MasterAdamW,
        "clip_and_step_async",
        lambda: (peaks.end("training"), peaks.start()),
        lambda: (peaks.end("optimizer"), peaks.start()),
    )
    runs: list[RLRun] = []
    real_init = RLRun.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        runs.append(self)

    RLRun.__init__ = init
    return peaks, runs


def switch_costs(run: RLRun) -> dict[str, Any]:
    r = run.engine.runner
    if r is None:
        return {}
    return {
        "release_memory": run.phases.release,
        "kv_cache_bytes": r.kv_cache_bytes,
        "kv_allocations": r.kv_allocations,
        "kv_allocate_s": r.kv_allocate_s,
        "decode_graphs_dropped": r.graphs_dropped,
        "decode_graph_capture_s": r.capture_seconds,
    }


def report(plan: MemoryPlan, peaks: PhasePeaks, run: RLRun | None, what: dict[str, Any]) -> None:
    rows: dict[str, Any] = {}
    print(f"{'phase':<12}{'predicted GiB':>15}{'allocated GiB':>15}{'reserved GiB':>14}{'alloc/pred':>12}")
    for ph in PHASES:
        pred = plan.phase(ph).peak
        a, r = peaks.allocated[ph], peaks.reserved[ph]
        rows[ph] = {"predicted": pred, "allocated": a, "reserved": r, "ratio": a / pred if pred else None}
        print(f"{ph:<12}{pred / 2**30:>15.2f}{a / 2**30:>15.2f}{r / 2**30:>14.2f}{a / pred:>12.3f}")
    if peaks.breakdown:
        print(f"live at the {peaks.trace} phase's peak, by allocating line (GiB):")
        for site, n in peaks.breakdown:
            print(f"  {n / 2**30:8.2f}  {site}")
    costs = switch_costs(run) if run is not None else {}
    if costs:
        print(
            "phase switches: "
            + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in costs.items())
        )
    print(plan.table())
    record = {
        "plan_check": rows,
        **what,
        "switches": costs,
        "device": torch.cuda.get_device_name(0),
        "plan": plan.to_json(),
        **({"peak_breakdown": peaks.breakdown} if peaks.breakdown else {}),
    }
    print(json.dumps(record, separators=(",", ":")))


def bench_rl_config(flags: list[str]) -> tuple[Any, RunConfig]:
    """`exactrl bench rl`'s arguments from its own parser (the README's command unless flags say otherwise), and
    the run config it trains with."""
    import exactrl.bench_rl as bench_rl
    from exactrl.cli import main

    got: dict[str, Any] = {}
    real = bench_rl.main
    bench_rl.main = lambda args: got.setdefault("args", args) and 0
    try:
        main(["bench", "rl", "--preset", "qwen3-1.7b", "--mode", "exact", "--device", "cuda", *flags])
    finally:
        bench_rl.main = real
    args = got["args"]
    return args, bench_rl._config(args, tempfile.mkdtemp(prefix="plan-check-"), args.warmup + args.steps)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--bench-rl"]:  # the rest are bench rl's own flags (after an optional --)
        flags = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        bargs, cfg = bench_rl_config(flags)
        argv = ["--bench-rl"]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out-dir", default="/tmp/exactrl-plan-check")
    ap.add_argument(
        "--trace",
        choices=PHASES,
        help="record the allocator's history; print what is live at this phase's peak",
    )
    ap.add_argument(
        "--bench-rl", action="store_true", help="first: the bench rl workload, its flags after it"
    )
    args = ap.parse_args(argv)
    require_cuda("plan_check.py")
    total = torch.cuda.get_device_properties(0).total_memory
    peaks, runs = instrument(args.trace)
    if args.bench_rl:
        from exactrl.bench_rl import run_bench

        plan = make_plan(cfg, world_size=1, gpu_memory=total, device="cuda")
        rec = run_bench(bargs)
        what = {"bench_rl": flags, "step_s": rec.get("step_s"), "generate_s": rec.get("generate_s")}
    else:
        if args.config is None:
            ap.error("a CONFIG (and --set overrides), or --bench-rl first")
        cfg = load_config(args.config, args.set)
        cfg = apply_overrides(cfg, ["train.check_memory=false", f"run.output_dir={args.out_dir}"])
        plan = make_plan(cfg, world_size=1, gpu_memory=total, device="cuda")
        run = RLRun(cfg, overwrite=True)
        try:
            run.run()
        finally:
            run.close()
        what = {"config": args.config, "set": args.set}
    report(plan, peaks, runs[-1] if runs else None, what)


if __name__ == "__main__":
    sys.exit(main())
