"""Predicted (exactrl plan) vs measured peak device memory per phase of a short `exactrl train` run, on a GPU.

    python benchmarks/plan_check.py CONFIG [--set ...] [--out-dir DIR]

The run is the config's own, with train.check_memory off (a refusal would hide the measurement). Each phase's peak
is torch.cuda.max_memory_allocated (and _reserved) between its boundaries: generation = the engine's generate
calls, training = the trainer's step up to the optimizer, optimizer = MasterAdamW's step. Prints a table and one
JSON line; the ratio measured / predicted is what the plan's 10% target is about.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from exactrl.config import apply_overrides, load_config
from exactrl.engine.engine import RolloutEngine
from exactrl.train.loop import RLRun
from exactrl.train.memory import make_plan
from exactrl.train.optim import MasterAdamW
from exactrl.train.trainer import PolicyTrainer

PHASES = ("generation", "training", "optimizer")


class PhasePeaks:
    """Peak allocated / reserved bytes per phase, over every time the phase ran."""

    def __init__(self) -> None:
        self.allocated = dict.fromkeys(PHASES, 0)
        self.reserved = dict.fromkeys(PHASES, 0)

    def start(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def end(self, phase: str) -> None:
        torch.cuda.synchronize()
        self.allocated[phase] = max(self.allocated[phase], torch.cuda.max_memory_allocated())
        self.reserved[phase] = max(self.reserved[phase], torch.cuda.max_memory_reserved())


def wrap(cls: type, name: str, before, after) -> None:
    real = getattr(cls, name)

    def wrapped(self, *a, **k):
        before()
        try:
            return real(self, *a, **k)
        finally:
            after()

    setattr(cls, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out-dir", default="/tmp/exactrl-plan-check")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    cfg = apply_overrides(cfg, ["train.check_memory=false", f"run.output_dir={args.out_dir}"])
    total = torch.cuda.get_device_properties(0).total_memory
    plan = make_plan(cfg, world_size=1, gpu_memory=total, device="cuda")

    peaks = PhasePeaks()
    wrap(RolloutEngine, "generate", peaks.start, lambda: peaks.end("generation"))
    # The trainer's step holds the optimizer's: training is measured up to the optimizer step, and again after it.
    wrap(PolicyTrainer, "step", peaks.start, lambda: peaks.end("training"))
    wrap(
        MasterAdamW,
        "clip_and_step_async",
        lambda: (peaks.end("training"), peaks.start()),
        lambda: (peaks.end("optimizer"), peaks.start()),
    )
    run = RLRun(cfg, overwrite=True)
    try:
        run.run()
    finally:
        run.close()

    rows: dict[str, Any] = {}
    print(f"{'phase':<12}{'predicted GiB':>15}{'allocated GiB':>15}{'reserved GiB':>14}{'alloc/pred':>12}")
    for ph in PHASES:
        pred = plan.phase(ph).peak
        a, r = peaks.allocated[ph], peaks.reserved[ph]
        rows[ph] = {"predicted": pred, "allocated": a, "reserved": r, "ratio": a / pred if pred else None}
        print(f"{ph:<12}{pred / 2**30:>15.2f}{a / 2**30:>15.2f}{r / 2**30:>14.2f}{a / pred:>12.3f}")
    print(plan.table())
    record = {
        "plan_check": rows,
        "config": args.config,
        "set": args.set,
        "device": torch.cuda.get_device_name(0),
        "plan": plan.to_json(),
    }
    print(json.dumps(record, separators=(",", ":")))


if __name__ == "__main__":
    main()
