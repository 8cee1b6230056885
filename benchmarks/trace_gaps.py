"""Where the GPU waits: idle gaps between kernels in a torch.profiler Chrome trace, and the host code during them.

A step whose wall time exceeds the sum of its kernel times has gaps in which no kernel runs. This reads a trace
written by `prof.export_chrome_trace` (plain or .gz), merges the GPU activity (kernels, memcpy, memset) into busy
intervals, and prints the idle time between the first and the last GPU event, the largest gaps, and for each gap
the innermost host events (Python functions when the trace was taken with `with_stack=True`, else torch ops)
that were running when the gap began. One JSON line at the end.

Usage: python benchmarks/trace_gaps.py TRACE.json[.gz] [--top 25] [--min-us 20]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_HOST_CATS = {"python_function", "cpu_op", "user_annotation"}


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("cat") in _GPU_CATS and e.get("ph") == "X"
    )
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def host_stack_at(events: list[dict], t: float) -> list[str]:
    """Host events (one thread's nesting) that contain time t, outermost first, shortest names kept."""
    inside = [
        e
        for e in events
        if e.get("cat") in _HOST_CATS and e.get("ph") == "X" and e["ts"] <= t <= e["ts"] + e.get("dur", 0)
    ]
    inside.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    return [e["name"][:80] for e in inside]


def analyse(events: list[dict], top: int, min_us: float) -> dict:
    busy = busy_intervals(events)
    if not busy:
        return {"error": "no GPU events in the trace"}
    span = busy[-1][1] - busy[0][0]
    gaps = [(b0[1], b1[0]) for b0, b1 in zip(busy, busy[1:]) if b1[0] - b0[1] >= min_us]
    idle_all = sum(b1[0] - b0[1] for b0, b1 in zip(busy, busy[1:]))
    by_site: dict[str, float] = defaultdict(float)
    host = [e for e in events if e.get("cat") in _HOST_CATS and e.get("ph") == "X"]
    host.sort(key=lambda e: e["ts"])
    rows = []
    for a, b in gaps:
        stack = host_stack_at(host, a)
        # The gap's site: the innermost few Python frames (or ops) of the host when the GPU went idle.
        site = " > ".join(stack[-3:]) if stack else "(no host event)"
        by_site[site] += b - a
        rows.append({"start_us": a - busy[0][0], "gap_us": b - a, "site": site})
    rows.sort(key=lambda r: -r["gap_us"])
    sites = sorted(by_site.items(), key=lambda kv: -kv[1])
    print(f"GPU span {span / 1e3:.2f} ms, busy {sum(b - a for a, b in busy) / 1e3:.2f} ms, idle {idle_all / 1e3:.2f} ms "
          f"({idle_all / span:.1%}); {len(gaps)} gaps >= {min_us:g} us sum {sum(r['gap_us'] for r in rows) / 1e3:.2f} ms")  # fmt: skip
    print("\nidle time by host site (gaps >= min-us):")
    for site, us in sites[:top]:
        print(f"{us / 1e3:9.2f} ms  {site}")
    print("\nlargest gaps:")
    for r in rows[:top]:
        print(f"{r['gap_us'] / 1e3:9.3f} ms at +{r['start_us'] / 1e3:8.2f} ms  {r['site']}")
    return {
        "span_ms": span / 1e3,
        "busy_ms": sum(b - a for a, b in busy) / 1e3,
        "idle_ms": idle_all / 1e3,
        "gaps": len(gaps),
        "top_sites": [{"site": s, "ms": us / 1e3} for s, us in sites[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-us", type=float, default=20.0)
    args = ap.parse_args(argv)
    rec = analyse(load(args.trace), args.top, args.min_us)
    print(json.dumps({"trace_gaps": args.trace.rsplit("/", 1)[-1], **rec}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
