"""Compare a new benchmark result with the best recorded one of the same benchmark, shape and device.

    python benchmarks/bench_check.py NEW.json [NEW2.json ...] [--results benchmarks/results] [--min-ratio 0.9]

NEW is what `exactrl bench rollout|train|rl --json` wrote (a .json record, or a .jsonl of records). For every
record, the recorded results (every .json / .jsonl under --results, one record per line) of the same benchmark,
preset, mode, dtype, GPU and shape (the keys in `IDENTITY` below) are the candidates; the best of them by the
benchmark's metric is the reference. Prints one table row and one JSON line per new record with the ratio
new / best (for a time, best / new: above 1 is always faster), and exits 1 when any ratio is below --min-ratio.

The default --min-ratio of 0.9 is the run-to-run spread measured on one H100 (about 10%, docs/benchmarks.md):
a drop inside it is not evidence of a regression; repeat the run, alternating with the old commit, before calling
one. A record with no comparable recorded result is reported as "new" and passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Which keys make two records comparable (besides bench, preset, mode, dtype and gpu), and which metric is compared
# (True: higher is better).
IDENTITY: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "rollout": (("concurrency", "prompt_len", "max_tokens", "split_kv", "world_size"), "tokens_per_s", True),
    "train": (("tokens_per_step", "seq_len", "cuda_graphs", "world_size"), "tokens_per_s", True),
    "train-fsdp": (("tokens_per_step", "seq_len", "cuda_graphs", "world_size"), "tokens_per_s", True),
    "rl": (
        ("prompts", "samples", "max_tokens", "completion_median", "split_kv", "world_size"),
        "step_s",
        False,
    ),
}
COMMON = ("bench", "preset", "mode", "dtype", "gpu")
DEFAULTS = {"split_kv": "auto", "world_size": 1}  # records written before a key existed ran with its default


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every JSON object in a .json or .jsonl file (one per non-empty line); lines that are not a record are
    skipped (a results folder also holds tables and plots)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("bench") in IDENTITY:
            rec.setdefault("_file", path.name)
            out.append(rec)
    return out


def identity(rec: dict[str, Any]) -> tuple[Any, ...]:
    keys, _, _ = IDENTITY[rec["bench"]]
    # model.precision: "fp8" records are compared with fp8 ones; records from before the key are "dtype"
    return (
        tuple(rec.get(k) for k in COMMON)
        + tuple(rec.get(k, DEFAULTS.get(k)) for k in keys)
        + (rec.get("precision", "dtype"),)
    )


def compare(new: dict[str, Any], recorded: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison of one new record with the best comparable recorded one."""
    _, metric, higher = IDENTITY[new["bench"]]
    same = [
        r
        for r in recorded
        if identity(r) == identity(new) and isinstance(r.get(metric), (int, float)) and r is not new
    ]
    out: dict[str, Any] = {
        "bench": new["bench"],
        "preset": new.get("preset"),
        "mode": new.get("mode"),
        "gpu": new.get("gpu"),
        "metric": metric,
        "value": new.get(metric),
        "commit": new.get("commit"),
        "candidates": len(same),
    }
    if not same or not isinstance(new.get(metric), (int, float)):
        out.update(best=None, ratio=None, verdict="new")
        return out
    best = max(same, key=lambda r: r[metric]) if higher else min(same, key=lambda r: r[metric])
    ratio = new[metric] / best[metric] if higher else best[metric] / new[metric]
    out.update(
        best=best[metric],
        best_file=best.get("_file"),
        best_commit=best.get("commit"),
        best_date=best.get("date"),
        ratio=ratio,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new", nargs="+", type=Path, help="result files of the new run (.json or .jsonl)")
    ap.add_argument(
        "--results", type=Path, default=Path(__file__).parent / "results", help="recorded results"
    )
    ap.add_argument("--min-ratio", type=float, default=0.9, help="fail below this ratio to the best recorded")
    args = ap.parse_args(argv)

    for p in [*args.new, args.results]:
        if not p.exists():
            print(f"bench_check: {p} does not exist", file=sys.stderr)
            return 2
    new_paths = {p.resolve() for p in args.new}
    recorded = [
        r
        for p in sorted(args.results.rglob("*.json*"))
        if p.suffix in (".json", ".jsonl") and p.resolve() not in new_paths
        for r in read_records(p)
    ]
    new_records = [r for p in args.new for r in read_records(p)]
    if not new_records:
        print(f"bench_check: no benchmark record in {', '.join(map(str, args.new))}", file=sys.stderr)
        return 2

    failed = False
    print(
        f"{'bench':<10} {'preset':<14} {'mode':<6} {'metric':<13} {'new':>12} {'best':>12} {'ratio':>6}  best from"
    )
    rows = []
    for rec in new_records:
        c = compare(rec, recorded)
        if c["ratio"] is None:
            c["verdict"] = "new"
        else:
            c["verdict"] = "ok" if c["ratio"] >= args.min_ratio else "slower"
            failed |= c["verdict"] == "slower"
        best = "-" if c["best"] is None else f"{c['best']:.4g}"
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
        src = (
            ""
            if c["best"] is None
            else f"{c['best_file']} ({c['best_commit'] or 'commit ?'}, {c['best_date'] or 'date ?'})"
        )
        print(
            f"{c['bench']:<10} {str(c['preset']):<14} {str(c['mode']):<6} {c['metric']:<13} "
            f"{c['value']:>12.4g} {best:>12} {ratio:>6}  {c['verdict']} {src}"
        )
        rows.append(c)
    print(json.dumps({"bench_check": rows, "min_ratio": args.min_ratio, "ok": not failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
