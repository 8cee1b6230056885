"""Print the step-time split of an `exactrl train` run from its metrics.jsonl: one row per step and one JSON line.

    python benchmarks/step_split.py RUN_DIR [RUN_DIR ...]

Columns: generate (the engine), train (forward, backward and the optimizer, as the loop times it), optimizer (the
device time of the optimizer's steps, offload's copies in and out included: perf/optimizer_s), whole step, peak
device memory (GiB). The first step carries warm-up (graph capture, the first pinned allocations); the JSON line
gives the mean over the steps after it when there are any.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("perf/generate_s", "perf/train_s", "perf/optimizer_s", "perf/step_s")


def split(run_dir: Path) -> dict[str, object]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "perf/step_s" in r]
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no step with perf/step_s")
    print(f"{run_dir.name}: step  generate_s  train_s  optimizer_s  step_s  peak_GB")
    for r in rows:
        vals = "".join(f"{r.get(k, float('nan')):>11.2f}" for k in KEYS)
        peak = r.get("perf/gpu_memory_peak_gb", float("nan"))
        print(f"{'':>{len(run_dir.name) + 2}}{int(r.get('step', 0)):>4}{vals}{peak:>10.2f}")
    tail = rows[1:] or rows
    mean = {k: sum(r.get(k, 0.0) for r in tail) / len(tail) for k in KEYS}
    return {"run": run_dir.name, "steps_averaged": len(tail), **mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="an `exactrl train` run's output_dir")
    for d in ap.parse_args().run_dirs:
        print(json.dumps({"step_split": split(Path(d))}, separators=(",", ":")))


if __name__ == "__main__":
    main()
