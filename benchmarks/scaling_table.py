"""Side by side: `exactrl bench train --fsdp` and `bench rollout` records at several world sizes, as a Markdown table.

    python benchmarks/scaling_table.py benchmarks/results/train-qwen3-1.7b-fsdp*-NVIDIA-H200.json ...

Each argument is a result JSON written by `exactrl bench ... [--nproc N]`; rows are sorted by benchmark and world
size. The scaling efficiency is the aggregate tokens/s per GPU over the world-size-1 record's of the same benchmark
and shape among the arguments (or the record's own `--baseline` figure when no such record is given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPE = ("bench", "preset", "mode", "dtype", "tokens_per_rank", "prompt_len", "max_tokens")


def _shape(rec: dict) -> tuple:
    # A rollout's global batch (concurrency) is part of its shape: the requests are split over the ranks.
    return tuple(rec.get(k) for k in SHAPE) + ((rec.get("concurrency"),) if rec["bench"] == "rollout" else ())


def _fmt(xs: list[float], digits: int) -> str:
    return ", ".join(f"{x:.{digits}f}" for x in xs)


def table(records: list[dict]) -> str:
    ws1 = {_shape(r): r for r in records if r["world_size"] == 1}
    rows = [
        "| bench | world size | batch | step or wall (s) | aggregate tok/s | tok/s per rank | MFU per GPU "
        "| peak memory per rank (GB) | scaling efficiency |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(records, key=lambda r: (r["bench"], str(r.get("preset")), r["world_size"])):
        n = r["world_size"]
        if r["bench"] == "rollout":
            batch = (
                f"{r['concurrency']} requests ({_fmt(r.get('concurrency_per_rank', [r['concurrency']]), 0)})"
            )
            secs = r["seconds"]
            per_rank = [p["tokens_per_s"] for p in r["per_rank"]]
            mfu = "-"
        else:
            batch = f"{r['global_tokens_per_step']} tokens ({r['tokens_per_rank']} per rank)"
            secs = r["step_s_median"]
            per_rank = r["tokens_per_s_per_rank"]
            mfu = _fmt(r["mfu_per_gpu"], 3)
        base = ws1.get(_shape(r))
        if base is not None:
            eff = f"{r['aggregate_tokens_per_s'] / n / base['aggregate_tokens_per_s']:.3f}"
        else:
            eff = f"{r['scaling_efficiency']:.3f}" if "scaling_efficiency" in r else "-"
        rows.append(
            f"| {r['bench']} {r.get('preset')} | {n} | {batch} | {secs:.4f} | {r['aggregate_tokens_per_s']:,.0f} | "
            f"{_fmt(per_rank, 0)} | {mfu} | {_fmt(r['peak_memory_gb'], 2)} ({r['peak_memory_kind']}) | {eff} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="result JSON files of `exactrl bench ... [--nproc N]`")
    records = []
    for p in ap.parse_args(argv).results:
        rec = json.loads(Path(p).read_text().strip().splitlines()[-1])
        if "world_size" not in rec or "per_rank" not in rec:
            print(
                f"{p}: not a multi-rank benchmark record (no world_size / per_rank); skipped", file=sys.stderr
            )
            continue
        records.append(rec)
    if not records:
        print("no multi-rank benchmark records among the arguments", file=sys.stderr)
        return 2
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
